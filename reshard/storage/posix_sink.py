"""How reshard.storage.posix writes a big file: strictly front to back, hashed as it goes, past the page cache.

Bytes are gathered into a ring of page-aligned blocks. A full block is hashed (reshard.digests: BLAKE3 by default,
one thread, in order) and written at its place in the file (two threads, so two writes are in flight) while the producer
fills the next block; a block is filled again once both are done. The file is opened with O_DIRECT where
the filesystem allows it: a buffered write costs this machine's kernel about as much CPU as everything
else a conversion does (copying each byte into the page cache, then reclaiming it), and a checkpoint
written once is not read back soon. The last block is written whole (direct I/O writes whole pages) and
the file then truncated to its size.

A file in memory (tmpfs, ramfs) is written buffered (direct I/O there is a buffered write by another path, with
alignment rules) and not reserved (a reservation there zero-fills every page that the write then fills again: 13%
of a conversion's CPU on /dev/shm); a write of a block or more goes to it straight from the caller's memory, hashed
meanwhile, without the copy into the ring, and returns once both are done, so the caller may reuse its buffer.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from reshard import digests

BLOCK = 8 << 20         # bytes per block
BLOCKS = 4              # blocks per open file: one filling, the others hashed and written
BUFFER_BYTES = BLOCK * BLOCKS
WRITERS = 2             # writes in flight: one at a time leaves the device idle between requests
PAGE = 4096             # direct I/O writes whole pages from page-aligned memory
IN_MEMORY = {0x01021994, 0x858458F6}    # statfs f_type of tmpfs and ramfs (linux/magic.h)


def _open(path: str) -> tuple:
    """(fd, direct): the file opened for writing, with O_DIRECT unless the filesystem refuses it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError:
            pass            # tmpfs and some network filesystems: buffered
    return os.open(path, flags, 0o644), False


def in_memory(fd: int) -> bool:
    """Does the file live in memory (tmpfs, ramfs)? False where the platform cannot say (no Linux fstatfs)."""
    try:
        fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return False
    buffer = ctypes.create_string_buffer(256)     # struct statfs, whose first field is the long f_type
    if fstatfs(fd, buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value in IN_MEMORY


class HashingSink(io.RawIOBase):
    """A file written strictly front to back, hashed (`algorithm`, reshard.digests) as it goes.

    It claims not to be seekable, so zipfile streams each member and appends a data descriptor instead
    of seeking back to patch its header: the bytes hashed are the bytes on disk. `digest` (or `close`)
    finishes the file; `size` is the bytes written so far.
    """

    def __init__(self, path: str, reserve: int = 0, algorithm: str = digests.DEFAULT):
        super().__init__()
        self.name = path
        self._fd, self._direct = _open(path)
        self._in_memory = in_memory(self._fd)
        if self._in_memory and self._direct:
            self._buffered()
        self._digest = digests.new(algorithm)
        self._hasher = ThreadPoolExecutor(max_workers=1)        # one worker: blocks are hashed in order
        self._writers = ThreadPoolExecutor(max_workers=WRITERS)
        self._blocks: Sequence[mmap.mmap] = [mmap.mmap(-1, BLOCK) for _ in range(BLOCKS)]
        # each block's pending hash and write
        self._flushing: list[tuple[Future[None], ...]] = [()] * BLOCKS
        self._current = self._fill = 0
        self._finished = False
        self.size = 0
        if reserve and not self._in_memory:
            # Reserve the blocks up front: filling a sparse file costs this disk several times the write.
            try:
                os.posix_fallocate(self._fd, 0, reserve)
            except OSError:
                pass    # a filesystem without fallocate: write as usual

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def write(self, data) -> int:
        if self._finished:      # (its threads are gone): say so rather than submit to a closed pool
            raise ValueError(f"{self.name}: write after close")
        view = memoryview(data).cast("B")
        if self._in_memory and len(view) >= BLOCK:
            if self._fill:
                self._flush()       # (a short block: a buffered write takes any length)
            self._write_through(view)
            return len(view)
        done = 0
        while done < len(view):
            n = min(BLOCK - self._fill, len(view) - done)
            self._blocks[self._current][self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            self.size += n
            if self._fill == BLOCK:
                self._flush()
        return done

    def _write_through(self, view: memoryview) -> None:
        """`view` written at the end of the file from where it is, and hashed after the blocks before it (the one
        hashing thread takes them in order) while this thread writes."""
        hashed = self._hasher.submit(self._hash, view, len(view))
        try:
            written = 0
            while written < len(view):
                written += os.pwrite(self._fd, view[written:], self.size + written)
        finally:
            hashed.result()
        self.size += len(view)

    def _flush(self) -> None:
        """Hash and write the current block; the next block becomes current once its last flush is done."""
        i, block, nbytes = self._current, self._blocks[self._current], self._fill
        at = self.size - nbytes
        self._flushing[i] = (self._hasher.submit(self._hash, block, nbytes),
                             self._writers.submit(self._write, block, nbytes, at))
        self._current, self._fill = (i + 1) % BLOCKS, 0
        self._wait(self._current)

    def _wait(self, i: int) -> None:
        pending, self._flushing[i] = self._flushing[i], ()
        for job in pending:
            job.result()    # a failed write (disk full) is raised here, in the producer

    def _hash(self, block: mmap.mmap | memoryview, nbytes: int) -> None:
        with memoryview(block) as view:
            self._digest.update(view[:nbytes])

    def _write(self, block: mmap.mmap, nbytes: int, at: int) -> None:
        with memoryview(block) as view:
            written = 0
            while written < nbytes:
                if self._direct:
                    try:    # whole pages: the last block's tail past `nbytes` is cut off by _finish
                        written += os.pwrite(self._fd, view[written:-(-nbytes // PAGE) * PAGE], at + written)
                        continue
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        self._buffered()    # a device wanting larger alignment than a page
                written += os.pwrite(self._fd, view[written:nbytes], at + written)

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            if self._fill:
                self._flush()
            for i in range(BLOCKS):
                self._wait(i)
            os.ftruncate(self._fd, self.size)   # the last block's page tail, and the unused reservation
        finally:
            self._hasher.shutdown(wait=True)
            self._writers.shutdown(wait=True)

    @property
    def digest(self) -> str:
        self._finish()
        return self._digest.hexdigest()

    def close(self) -> None:
        if self._fd is not None:
            try:
                self._finish()
            finally:
                os.close(self._fd)
                self._fd = None
                self._blocks = ()   # freed with the last view (a failed write's traceback may hold one)
        super().close()
