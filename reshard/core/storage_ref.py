"""Where a run of a checkpoint's bytes lies: one storage (torch's word) inside one file. Readers make these from
metadata; fragments of the catalog point into them; nothing here opens a file."""
from __future__ import annotations

from dataclasses import dataclass

from reshard.core.dtypes import itemsize


@dataclass(frozen=True)
class StorageRef:
    """A run of raw bytes inside a file: one torch storage."""
    file: str          # path of the file holding it
    offset: int        # byte offset of the storage's first byte in `file`
    nbytes: int
    dtype: str         # element type name, e.g. "float32", "bfloat16"
    member: str = ""   # the zip member it is, for messages ("archive/data/3")
    crc: int | None = None     # the CRC-32 the archive stores for it (reshard.reading.checksums); None: no checksum

    @property
    def numel(self) -> int:
        return self.nbytes // itemsize(self.dtype)
