"""The storage interface: what reshard asks of wherever checkpoint bytes live. Modelled on
torch.distributed.checkpoint's StorageReader/StorageWriter split: reading sources and writing an output are two
objects, each with its call order written down. Paths are the storage's own names for files (POSIX paths, or
s3://bucket/key URLs for an object store): no file descriptor and no memory map crosses this surface. A third
object, FileTree, answers what a path holds (exists, folder, listing, size, the bytes as a file): the readers'
metadata reads and the checks around a conversion, through reshard.storage.files.

Reading (SourceStorage), any number of times, in any order, then `close()` once:
  read(path, offset, n) / read_into(path, offset, out)     positioned reads; a short count only at the file's end
  window(path, offset, n)                                  a read-only buffer over a range, for a sparse gather that
                                                           touches few of its bytes; released on leaving the `with`
  view(path)                                               the whole file as a read-only buffer, kept until close()
  done_with(path, offset, n)                               a hint: these bytes are not read again (drop them from
                                                           any cache)
  will_read(path, ranges)                                  a hint, before the reads: the byte ranges about to be
                                                           read (a storage that pays per request fetches
                                                           adjacent ones together)
  size(path)
  mapped(path)                                             does view(path) cost nothing until its bytes are
                                                           touched (a memory map)? Where not (object storage),
                                                           big reads are positioned reads instead

Writing an output (OutputStorage), in this order:
  1. lock(path)                                one writer per destination; `release()` the handle it returns last
  2. delete(staged) (unless resuming; else drop_unfinished(staged): a killed run's uploads), make_folder(staged/...)
  3. for each big file: stream(path, reserve), written front to back, closed; sync(path) makes it durable;
     append(journal, line) notes it finished
  4. put(path, data) and copy(source, path): the small files, each durable on return
  5. commit(staged, final): `staged`'s tree made durable, then it appears as `final` at once
     (replacing what was there); commit_file(staged_file, final) does the same for one file. Where a store has no
     atomic rename (object storage), the manifest, the last file it places, is the commit
  On any failure before 5: delete(staged), and `final` is untouched.
  A store with IN_PLACE (no rename: object storage) is given a new destination as `staged` itself
  (reshard.execution.staging marks it unfinished until its manifest, the last object put, and 5 is skipped); its
  delete() then removes a folder's manifest first and the unfinished marker last, so what is left part way never reads
  as a checkpoint. list(folder), exists(path), get(path), free_bytes(folder) may be asked at any point.

Beyond an output's own writing, what the lifecycle (prune, watch, thin) does to checkpoints already there:
  put_atomic(path, data)        a small file replaced whole: a reader sees the old bytes or the new, never a part
  set_aside(path, trash)        a checkpoint about to be deleted moved out of sight in one step where the storage
                                can (a rename to `trash`); returns where it now is, for delete()
  delete_file(path)             one file (delete() takes a folder's tree, or a prefix's objects, too)
A storage that renames (Renaming: a local filesystem) also gives what thin's swap needs: rename, exchange (two
paths swapped in one step), link_or_copy (a kept file in a new tree without writing its bytes again) and the
files' times kept. An object store has none of these; reshard.lifecycle.thin_objects does its swap another way.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Protocol

from reshard.digests import DEFAULT as DEFAULT_DIGEST


@dataclass(frozen=True)
class Found:
    """One name at or under a path, as a walk that follows no link finds it."""
    path: str
    size: int               # the bytes it holds
    disk_bytes: int         # the bytes it takes on its device (an object: its size)
    mtime: float
    folder: bool
    link: str | None = None     # a symbolic link: where it leads, resolved (never entered); None: not a link


class FileTree(Protocol):
    """Files by path, as the readers see them (reshard.storage.files dispatches a path to one): what os.path
    answers on a local disk, an object store's listing and HEAD requests for s3:// URLs."""

    def exists(self, path: str) -> bool: ...

    def isdir(self, path: str) -> bool: ...

    def isfile(self, path: str) -> bool: ...

    def islink(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]: ...

    def getsize(self, path: str) -> int: ...

    def mtime_ns(self, path: str) -> int: ...

    def files_under(self, path: str) -> list[tuple[str, int, float]]: ...    # (path, bytes, mtime) of each file

    def found_under(self, path: str) -> list[Found]: ...    # `path` and every name under it, links not entered

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]: ...    # as os.walk, links not entered

    def identity(self, path: str) -> tuple: ...     # what changes when the file is replaced or edited; () if none

    def open(self, path: str, mode: str = "r", newline: str | None = None, buffering: int = -1,
             random_access: bool = False) -> IO[Any]: ...


class SourceStorage(Protocol):
    def read(self, path: str, offset: int, nbytes: int) -> bytes: ...

    def read_into(self, path: str, offset: int, out: memoryview) -> int: ...

    def window(self, path: str, offset: int, nbytes: int) -> AbstractContextManager[memoryview]: ...

    def view(self, path: str): ...     # a read-only buffer (bytes-like: len, slices, numpy.frombuffer)

    def done_with(self, path: str, offset: int, nbytes: int) -> None: ...

    def will_read(self, path: str, ranges: list[tuple[int, int]]) -> None: ...

    def size(self, path: str) -> int: ...

    def mapped(self, path: str) -> bool: ...   # view(path) costs nothing until touched (a map), not a download

    def close(self) -> None: ...


class WriteStream(Protocol):
    """A file written strictly front to back (never seeked), hashed as it goes: `size` bytes so far, `digest` (hex,
    of the algorithm it was opened with: reshard.digests) once closed."""
    size: int

    def write(self, data) -> int: ...

    def tell(self) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> WriteStream: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> object: ...

    @property
    def digest(self) -> str: ...


class LockHeld(Exception):
    """lock(path): another writer holds it."""


class Lock(Protocol):
    def release(self) -> None: ...


class OutputStorage(Protocol):
    STREAM_BUFFER_BYTES: int        # memory one open stream holds (its write buffers)
    IN_PLACE: bool                  # no rename: a new output is written at its destination (see above)

    def lock(self, path: str) -> Lock: ...

    def make_folder(self, path: str) -> None: ...

    def stream(self, path: str, reserve: int = 0, algorithm: str = DEFAULT_DIGEST) -> WriteStream: ...

    def sync(self, path: str) -> None: ...

    def append(self, path: str, data: bytes) -> None: ...

    def put(self, path: str, data: bytes) -> None: ...

    def copy(self, source: str, path: str) -> None: ...

    def get(self, path: str) -> bytes: ...

    def list(self, folder: str) -> list: ...

    def exists(self, path: str) -> bool: ...

    def delete(self, path: str) -> None: ...

    def drop_unfinished(self, path: str) -> None: ...     # what a killed writer left begun under `path` (uploads)

    def commit(self, staged: str, final: str) -> None: ...

    def commit_file(self, staged: str, final: str) -> None: ...

    def free_bytes(self, folder: str) -> int | None: ...     # None: the store states no free space

    def put_atomic(self, path: str, data: bytes) -> None: ...

    def set_aside(self, path: str, trash: str) -> str: ...

    def delete_file(self, path: str) -> None: ...


class Renaming(OutputStorage, Protocol):
    """An output storage with renames (a local filesystem): what thin's swap does with them. Each call is one step;
    `sync(folder)` makes the folder's names durable."""

    def rename(self, source: str, target: str) -> None: ...

    def exchange(self, a: str, b: str) -> bool: ...     # swapped in one atomic step; False where it cannot be

    def link_or_copy(self, source: str, target: str) -> None: ...   # `source`'s bytes and times at `target`

    def copy_times(self, source: str, target: str) -> None: ...

    def set_mtime(self, path: str, seconds: float) -> None: ...

