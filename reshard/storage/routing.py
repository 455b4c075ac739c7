"""Each path to the storage that holds it: local paths to the POSIX implementation, s3:// URLs to the object
store's (imported only once such a URL is used), so a plan may read from either and write to either."""
from __future__ import annotations

from reshard.storage import files
from reshard.storage.posix import PosixOutput, PosixSource
from reshard.storage.protocol import OutputStorage, Renaming, SourceStorage

# The memory one open output stream holds on a local disk: the executor's and a plan's buffer arithmetic where no
# destination is named (an object store's, for an s3:// destination: stream_buffer_bytes)
LOCAL_STREAM_BUFFER_BYTES = PosixOutput.STREAM_BUFFER_BYTES


class Sources:
    """SourceStorage over every path: each call goes to the storage of its path, made when first needed."""

    def __init__(self) -> None:
        self._local: SourceStorage | None = None
        self._remote: SourceStorage | None = None

    def _of(self, path: str) -> SourceStorage:
        if files.is_url(path):
            if self._remote is None:
                from reshard.storage import s3
                self._remote = s3.ObjectSource()
            return self._remote
        if self._local is None:
            self._local = PosixSource()
        return self._local

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        return self._of(path).read(path, offset, nbytes)

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        return self._of(path).read_into(path, offset, out)

    def window(self, path: str, offset: int, nbytes: int):
        return self._of(path).window(path, offset, nbytes)

    def view(self, path: str):
        return self._of(path).view(path)

    def done_with(self, path: str, offset: int, nbytes: int) -> None:
        self._of(path).done_with(path, offset, nbytes)

    def size(self, path: str) -> int:
        return self._of(path).size(path)

    def mapped(self, path: str) -> bool:
        return self._of(path).mapped(path)

    def will_read(self, path: str, ranges: list[tuple[int, int]]) -> None:
        self._of(path).will_read(path, ranges)

    def close(self) -> None:
        for storage in (self._local, self._remote):
            if storage is not None:
                storage.close()


def sources() -> Sources:
    return Sources()


def output_for(dst: str) -> OutputStorage:
    """Where an output at `dst` is written: an object store for an s3:// URL, else the local filesystem."""
    if files.is_url(dst):
        from reshard.storage import s3
        return s3.ObjectOutput()
    return PosixOutput()


def stream_buffer_bytes(dst: str | None = None) -> int:
    """The memory one open output stream holds where `dst` is written (None: a local disk)."""
    return output_for(dst).STREAM_BUFFER_BYTES if dst else LOCAL_STREAM_BUFFER_BYTES


def renaming(path: str) -> Renaming | None:
    """The storage holding `path` where it renames (a local filesystem), for a swap made of renames; None where
    it has no rename (object storage)."""
    return None if files.is_url(path) else PosixOutput()
