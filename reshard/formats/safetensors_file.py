"""Writing safetensors files front to back: the JSON header first, then each tensor streamed in.

Layout (safetensors 0.x): u64 little-endian header length N, N bytes of JSON, then the packed
tensor bytes (no gaps allowed). The header is padded with spaces to a multiple of 8 so the data
starts 8-byte aligned; tensors are ordered by decreasing element size, then name (as the
safetensors library orders them), so each tensor starts aligned to its own element size.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO, ClassVar

from reshard.core.dtypes import itemsize
from reshard.core.write_requests import Piece, TensorFile, TensorFileBuilder
from reshard.errors import ReshardError

DTYPE_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
}


def storage_order(slots) -> list:
    """The order tensors are laid out in: larger elements first, then by name."""
    return sorted(slots, key=lambda t: (-itemsize(t.dtype), t.key))


@dataclass(frozen=True)
class SafetensorsFile(TensorFile):
    """A safetensors file; `tree` is its string metadata, each slot's key is the tensor's name."""
    STEM, EXTENSION, SUFFIXES = "model", "safetensors", (".safetensors",)   # Hugging Face's names

    @classmethod
    def from_entries(cls, path, entries, aliases, metadata) -> SafetensorsFile:
        """A state dict file: one tensor per entry (NewTensor with a `source`); ties are listed in
        the metadata, never written twice (safetensors has no shared storage)."""
        file = SafetensorsFileBuilder(path)
        for e in entries:
            file.slot(e.dtype, e.shape, [Piece(e.numel, e.source, e.start, shard=e.shard)], key=e.key)
        return file.build(dict(metadata))

    def holds(self, name: str) -> bool:
        return any(t.key == name for t in self.slots)

    def header(self) -> bytes:
        entries: dict[str, dict] = {}
        offset = 0
        if self.tree:
            entries["__metadata__"] = {str(k): str(v) for k, v in self.tree.items()}
        for t in self.slots:
            if t.dtype not in DTYPE_CODES:
                raise ReshardError(f"{self.path}: safetensors has no dtype for {t.dtype} ({t.key})")
            entries[t.key] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def container(self) -> Safetensors:
        return Safetensors()


class SafetensorsFileBuilder(TensorFileBuilder):
    """A SafetensorsFile's tensors made one by one; `build(metadata)` lays them out in storage order."""

    def build(self, metadata: dict | None = None) -> SafetensorsFile:
        return SafetensorsFile(self.path, metadata, tuple(storage_order(self.slots)), self.frozen_pieces())


@dataclass(frozen=True)
class Safetensors:
    """The safetensors container (reshard.core.container.Container); it takes no options."""
    name: ClassVar[str] = "safetensors"

    def file_size(self, header: bytes, storages) -> int:
        """Bytes of the file on disk: the header, then the tensors packed without gaps."""
        return len(header) + sum(s.nbytes for s in storages)

    def writer(self, out: BinaryIO, header: bytes, storages) -> SafetensorsWriter:
        return SafetensorsWriter(out, header, storages)


class SafetensorsWriter:
    """Writes the header, then each storage's bytes in order through `storage(key, nbytes)`."""

    def __init__(self, out: BinaryIO, header: bytes, storages):
        self._file = out
        self.header = header
        self.storages = list(storages)
        self._next = 0

    def __enter__(self):
        self._file.write(self.header)
        return self

    def storage(self, key: str, nbytes: int):
        expected = self.storages[self._next]
        if expected.key != key or expected.nbytes != nbytes:
            raise AssertionError(f"{getattr(self._file, 'name', 'safetensors')}: storage {key} written out of order")
        self._next += 1
        return _Unclosable(self._file)

    def __exit__(self, *exc):
        pass


class _Unclosable:
    """The file, as a stream the caller may 'close' after each tensor."""

    def __init__(self, f):
        self._f = f

    def write(self, data) -> int:
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
