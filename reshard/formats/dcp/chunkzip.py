"""The items of a `.distcp` file: each one a small, complete torch.save zip, laid end to end.

DCP's FileSystemWriter torch.saves every chunk (and every non-tensor value) into the rank's file
one after the other and records each one's (offset, length) in `.metadata`; its reader hands
`torch.load` exactly that byte range. So a `.distcp` we write is a sequence of such archives whose
sizes are known before any tensor byte is written: the planner can compute `.metadata` up front.

An archive here has the members torch.load needs: `data.pkl`, `byteorder`, `data/0` (the chunk's
bytes, 64-byte aligned like torch.save's) and `version`. `data/0` is streamed, so its CRC-32 goes
in a data descriptor and the central directory, both written after it (as torch itself does).
No ZIP64: writers keep each chunk under CHUNK_LIMIT bytes by cutting tensors into row blocks.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, ClassVar

from reshard.formats.torchsave_write import ALIGNMENT

CHUNK_LIMIT = 1 << 31           # bytes of one chunk's data: well inside 32-bit zip offsets
ARCHIVE = "archive"
_LOCAL = struct.Struct("<IHHHHHIIIHH")            # local file header, 30 bytes
_DESCRIPTOR = struct.Struct("<IIII")              # data descriptor with signature, 16 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")    # central directory header, 46 bytes
_END = struct.Struct("<IHHHHIIH")                 # end of central directory, 22 bytes
_STREAMED = 0x08                                  # flag: sizes and CRC follow in a descriptor


class _Member:
    def __init__(self, name: str, data: bytes | None, nbytes: int, offset: int):
        self.name = f"{ARCHIVE}/{name}".encode()
        self.data = data                 # None: streamed (data/0)
        self.nbytes = nbytes
        self.offset = offset             # of the local header, from the archive's start
        header_end = offset + _LOCAL.size + len(self.name) + 4
        self.extra = struct.pack("<HH", 0x4246, (-header_end) % ALIGNMENT)   # "FB" padding, as torch
        self.extra += b"Z" * ((-header_end) % ALIGNMENT)
        self.crc = zlib.crc32(data) if data is not None else 0

    @property
    def streamed(self) -> bool:
        return self.data is None

    def local_header(self) -> bytes:
        flags = _STREAMED if self.streamed else 0
        crc, size = (0, 0) if self.streamed else (self.crc, self.nbytes)
        return _LOCAL.pack(0x04034B50, 20, flags, 0, 0, 0x21, crc, size, size,
                           len(self.name), len(self.extra)) + self.name + self.extra

    def trailer(self) -> bytes:
        return _DESCRIPTOR.pack(0x08074B50, self.crc, self.nbytes, self.nbytes) if self.streamed else b""

    def length(self) -> int:
        return len(self.local_header()) + self.nbytes + len(self.trailer())

    def central(self) -> bytes:
        flags = _STREAMED if self.streamed else 0
        return _CENTRAL.pack(0x02014B50, 20, 20, flags, 0, 0, 0x21, self.crc, self.nbytes, self.nbytes,
                             len(self.name), 0, 0, 0, 0, 0, self.offset) + self.name


class Archive:
    """One torch.save zip: fixed members around at most one streamed storage (`data/0`)."""

    def __init__(self, data_pkl: bytes, storage_nbytes: int | None = None):
        self.members, offset = [], 0
        for name, data, nbytes in (("data.pkl", data_pkl, len(data_pkl)), ("byteorder", b"little", 6),
                                   *((("data/0", None, storage_nbytes),) if storage_nbytes is not None else ()),
                                   ("version", b"3\n", 2)):
            member = _Member(name, data, nbytes, offset)
            self.members.append(member)
            offset += member.length()
        self._body = offset

    def head(self) -> bytes:
        """Bytes up to the first byte of the streamed storage (all of it when there is none)."""
        out = bytearray()
        for member in self.members:
            out += member.local_header()
            if member.data is None:      # streamed
                return bytes(out)
            out += member.data
        return bytes(out) + self.tail()

    def tail(self, crc: int = 0) -> bytes:
        """Bytes after the streamed storage, whose CRC-32 is `crc`."""
        out, after = bytearray(), False
        for member in self.members:
            if member.streamed:
                member.crc = crc
                out += member.trailer()
                after = True
            elif after and member.data is not None:      # (only the streamed member has none)
                out += member.local_header() + member.data
        directory = b"".join(m.central() for m in self.members)
        out += directory + _END.pack(0x06054B50, 0, 0, len(self.members), len(self.members), len(directory),
                                     self._body, 0)
        return bytes(out)

    @property
    def length(self) -> int:
        directory = sum(_CENTRAL.size + len(m.name) for m in self.members)
        return self._body + directory + _END.size

    def whole(self) -> bytes:
        """The complete archive (no streamed storage)."""
        assert all(not m.streamed for m in self.members)
        return self.head()


@dataclass(frozen=True)
class Item:
    """One archive of a `.distcp` file: a pickled value (`key` None), or the chunk of storage `key`; `nbytes` of
    the container's header are its fixed bytes (the whole archive of a value, the data.pkl of a chunk)."""
    kind: str           # VALUE or CHUNK
    key: str | None
    nbytes: int


VALUE, CHUNK = "value", "chunk"


@dataclass(frozen=True)
class Distcp:
    """The `.distcp` container (reshard.core.container.Container): `items`, in file order, say what the header's
    bytes are; the executor asks for the storages in item order."""
    items: tuple = ()       # Item
    name: ClassVar[str] = "distcp"

    def file_size(self, header: bytes, storages) -> int:
        """Bytes of the file on disk: every item's archive, end to end."""
        nbytes = {s.key: s.nbytes for s in storages}
        size = consumed = 0
        for item in self.items:
            n = item.nbytes
            size += n if item.kind == VALUE else Archive(header[consumed:consumed + n], nbytes[item.key]).length
            consumed += n
        return size

    def writer(self, out: BinaryIO, header: bytes, storages) -> DistcpWriter:
        return DistcpWriter(out, header, storages, self.items)


class DistcpWriter:
    """Writes a `.distcp` file into `out`: `header` is every item's fixed bytes end to end (Distcp); values
    between the storages are written as the executor asks for the storages."""

    def __init__(self, out: BinaryIO, header: bytes, storages, items: tuple):
        self._sink, self.header, self.items = out, header, items
        self.path = getattr(out, "name", "distcp")
        self.nbytes = {s.key: s.nbytes for s in storages}
        self._next = 0          # next item to write
        self._consumed = 0      # bytes of `header` used so far

    def __enter__(self):
        return self

    def _fixed(self, n: int) -> bytes:
        data = self.header[self._consumed:self._consumed + n]
        self._consumed += n
        return data

    def _values_until(self, key) -> Archive | None:
        while self._next < len(self.items):
            item = self.items[self._next]
            self._next += 1
            if item.kind == VALUE:
                self._sink.write(self._fixed(item.nbytes))
            elif item.key == key:
                return Archive(self._fixed(item.nbytes), self.nbytes[key])
            else:
                raise AssertionError(f"{self.path}: storage {item.key} skipped")
        if key is not None:
            raise AssertionError(f"{self.path}: no item for storage {key}")
        return None

    def storage(self, key: str, nbytes: int):
        archive = self._values_until(key)
        assert archive is not None      # (None only when no key is asked for)
        self._sink.write(archive.head())
        return _ChunkStream(self._sink, archive, nbytes, self.path)

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self._values_until(None)


class _ChunkStream:
    """Where the executor streams one chunk's bytes; closing it writes the archive's tail."""

    def __init__(self, sink, archive: Archive, nbytes: int, path: str):
        self._sink, self._archive, self._left, self._path = sink, archive, nbytes, path
        self._crc = 0

    def write(self, data) -> int:
        self._crc = zlib.crc32(data, self._crc)
        self._left -= len(data)
        return self._sink.write(data)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            if self._left != 0:
                raise AssertionError(f"{self._path}: chunk written with {self._left} bytes left over")
            self._sink.write(self._archive.tail(self._crc))
