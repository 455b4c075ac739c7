"""The storage interface (reshard.storage.protocol) on a local POSIX filesystem.

Reads are positioned (pread/preadv into the caller's memory), a big read once made is dropped from the page cache
(posix_fadvise), a sparse range is mapped so only the pages it touches are read. Big files are written through
the O_DIRECT ring of posix_sink; small ones written whole and fsynced; a commit fsyncs every folder of the staged
tree and renames it into place, so the destination appears whole or not at all.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import shutil

from reshard import digests
from reshard.errors import CheckpointError
from reshard.storage import files, posix_sink
from reshard.storage.names import ATOMIC_SUFFIX, REPLACED_SUFFIX
from reshard.storage.protocol import LockHeld

RENAME_EXCHANGE = 2     # renameat2's flag (linux/fs.h)
AT_FDCWD = -100         # renameat2's "relative to the working directory"


class PosixSource:
    """Checkpoint files opened read-only: one descriptor per path, opened when first asked for; a file mapped whole
    when first viewed; all closed together."""

    def __init__(self):
        self._fds = {}
        self._maps = {}

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(path, f"cannot read: {e.strerror}") from None
        return fd

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        return os.pread(self._fd(path), nbytes, offset)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Bytes read into `out` from `offset`: all of it, or fewer where the file ends."""
        fd, done, nbytes = self._fd(path), 0, out.nbytes
        while done < nbytes:
            got = os.preadv(fd, [out[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done

    def done_with(self, path: str, offset: int, nbytes: int) -> None:
        os.posix_fadvise(self._fd(path), offset, nbytes, os.POSIX_FADV_DONTNEED)

    @contextlib.contextmanager
    def window(self, path: str, offset: int, nbytes: int):
        """The range mapped, read ahead as a whole (not page by page as it is touched); unmapped on leaving. The
        caller lets go of every view of it first. OSError or ValueError where the file is shorter."""
        first = offset - offset % mmap.ALLOCATIONGRANULARITY
        window = mmap.mmap(self._fd(path), offset + nbytes - first, access=mmap.ACCESS_READ, offset=first)
        try:
            window.madvise(mmap.MADV_WILLNEED)
            with memoryview(window) as whole:
                part = whole[offset - first:]
            try:
                yield part
            finally:
                part.release()
        finally:
            window.close()

    def view(self, path: str) -> mmap.mmap:
        """The whole file, mapped once and kept until close (pages read as they are touched)."""
        m = self._maps.get(path)
        if m is None:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = m
        return m

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def mapped(self, path: str) -> bool:
        return True

    def will_read(self, path: str, ranges: list) -> None:
        pass    # the kernel's read-ahead joins adjacent reads already

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass   # a numpy view still uses it; the map goes when the last view does
        self._maps.clear()


class PosixLock:
    """An flock held on a lock file; released by unlinking the file, then closing it."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


class PosixOutput:
    """Writing an output on a POSIX filesystem (the order: reshard.storage.protocol). It holds no state, so it
    travels to worker processes as it is."""

    STREAM_BUFFER_BYTES = posix_sink.BUFFER_BYTES
    IN_PLACE = False        # a rename commits

    def lock(self, path: str) -> PosixLock:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise LockHeld(path) from None
        return PosixLock(path, fd)

    def make_folder(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def stream(self, path: str, reserve: int = 0, algorithm: str = digests.DEFAULT) -> posix_sink.HashingSink:
        return posix_sink.HashingSink(path, reserve, algorithm)

    def sync(self, path: str) -> None:
        fsync(path)

    def append(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, path: str, data: bytes) -> None:
        write_text(path, data)

    def copy(self, source: str, path: str) -> None:
        """`source` (a local path or any URL reshard.storage.files reads) copied to `path`, made durable."""
        if files.is_url(source):
            with files.open(source, "rb") as src, open(path, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
        else:
            shutil.copyfile(source, path)
        fsync(path)

    def get(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def list(self, folder: str) -> list:
        return os.listdir(folder)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def delete(self, path: str) -> None:
        """The file or folder tree at `path`, whatever of it can be removed (the first failure raised after); a
        missing one is already deleted."""
        if os.path.isdir(path) and not os.path.islink(path):
            failed = []
            shutil.rmtree(path, onerror=lambda function, name, info: failed.append(info[1]))
            if failed:
                raise failed[0]
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def drop_unfinished(self, path: str) -> None:
        pass    # a file left part written is written again from its start, or deleted with its folder

    def commit(self, staged: str, final: str) -> None:
        """`staged` (a folder) becomes `final`: every folder of it fsynced, an old `final` moved aside to
        `STAGED.old` and removed once the new one is in place, the parent fsynced."""
        for folder, _, _ in os.walk(staged):
            fsync(folder)
        if os.path.exists(final):
            trash = f"{staged}{REPLACED_SUFFIX}"
            os.rename(final, trash)
            os.rename(staged, final)
            shutil.rmtree(trash)
        else:
            os.rename(staged, final)
        fsync(os.path.dirname(final))

    def commit_file(self, staged: str, final: str) -> None:
        os.replace(staged, final)
        fsync(os.path.dirname(final))

    def free_bytes(self, folder: str) -> int:
        """The free bytes of the device `folder` is on, or will be once made (its nearest folder that exists)."""
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        return shutil.disk_usage(folder).free

    def put_atomic(self, path: str, data: bytes) -> None:
        """Written whole to a sibling, fsynced, renamed over `path`, the folder fsynced: the old file or the new."""
        staged = f"{path}{ATOMIC_SUFFIX}"
        write_text(staged, data)
        os.replace(staged, path)
        fsync(os.path.dirname(path))

    def set_aside(self, path: str, trash: str) -> str:
        """`path` renamed to `trash` (in its folder: one atomic step), the folder fsynced."""
        os.rename(path, trash)
        fsync(os.path.dirname(path))
        return trash

    def delete_file(self, path: str) -> None:
        os.unlink(path)

    def rename(self, source: str, target: str) -> None:
        os.rename(source, target)

    def exchange(self, a: str, b: str) -> bool:
        """Swap two paths in one atomic step (Linux renameat2); False where the system cannot."""
        try:
            call = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            return False
        if call(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
            return True
        errno = ctypes.get_errno()
        if errno in (22, 38, 95):      # EINVAL, ENOSYS, EOPNOTSUPP: not on this file system
            return False
        raise OSError(errno, os.strerror(errno), a)

    def link_or_copy(self, source: str, target: str) -> None:
        """A hard link to `source` at `target` (the same bytes, none written, its times its own), or a durable
        copy with `source`'s times where the file system has no links; `target`'s folder made first."""
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
            fsync(target)
            self.copy_times(source, target)

    def copy_times(self, source: str, target: str) -> None:
        st = os.stat(source)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

    def set_mtime(self, path: str, seconds: float) -> None:
        os.utime(path, (seconds, seconds))


def write_text(path: str, text: str | bytes) -> None:
    """A small file written whole and made durable."""
    with open(path, "wb" if isinstance(text, bytes) else "w") as fh:
        fh.write(text)
    fsync(path)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
