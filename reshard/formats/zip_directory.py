"""The central directory of a plain zip archive, parsed from the archive's last bytes.

torch.save writes a plain archive: one disk, no comment, no encryption, members stored, zip64 records where an
offset or size needs them. This reads exactly that kind from the tail of the archive (the end record, the zip64
locator and end record, the directory entries) with no further read; anything else (a comment, a directory
beyond the bytes given, a signature out of place) gives None, and the caller parses the archive with zipfile.
A DCP `.distcp` of a Megatron save embeds one archive per chunk, thousands per file: zipfile's objects and its
dozen small reads per archive were most of the time `reshard plan` took to open a 70B save.
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

_END = struct.Struct("<4s4H2LH")               # end of central directory record, 22 bytes
_LOCATOR64 = struct.Struct("<4sLQL")           # zip64 end of central directory locator, 20 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")           # zip64 end of central directory record, 56 bytes
_ENTRY = struct.Struct("<4s4B4HL2L5H2L")       # central directory file header, 46 bytes
_EXTRA = struct.Struct("<2H")
_ZIP64_EXTRA = 0x0001
_MAX32, _MAX16 = 0xFFFFFFFF, 0xFFFF
_TAIL = 4096
_LARGEST = 64 << 20        # a directory this large (a million members) goes to zipfile


@dataclass(frozen=True)
class Member:
    """One member as the central directory names it (the fields a torch.save reader uses of zipfile.ZipInfo)."""
    filename: str
    header_offset: int      # where its local header starts, from the archive's first byte
    file_size: int
    CRC: int
    compress_type: int


def members(read_tail: Callable[[int], bytes], archive_size: int) -> list[Member] | None:
    """The members of an archive of `archive_size` bytes, `read_tail(n)` giving its last n bytes (4 KiB first,
    more once if the directory is larger); None where the archive is not the plain kind this reads (the caller
    then uses zipfile, which reads every kind or says what is wrong)."""
    tail = read_tail(min(archive_size, _TAIL))
    found = _directory(tail, archive_size)
    if found is not None and found[0] < 0 and found[1] <= _LARGEST:    # a directory larger than the tail read
        tail = read_tail(found[1])
        found = _directory(tail, archive_size)
    if found is None or found[0] < 0:
        return None
    start, _, count, end = found
    return _entries(tail, start, count, end)


def _directory(tail: bytes, archive_size: int) -> tuple[int, int, int, int] | None:
    """(where the directory starts in `tail`, the tail length holding all of it, its entries, where it ends)."""
    base = archive_size - len(tail)         # the archive offset of tail[0]
    at = len(tail) - _END.size
    if at < 0:
        return None
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = _END.unpack_from(tail, at)
    if sig != b"PK\x05\x06" or comment or disk or cd_disk:
        return None
    if tail[at - _LOCATOR64.size:at - _LOCATOR64.size + 4] == b"PK\x06\x07" or count == _MAX16 or \
            _MAX32 in (cd_size, cd_offset):     # zip64 end records (torch.save writes them always)
        found = _zip64_end(tail, at, base)
        if found is None:
            return None
        count, cd_size, cd_offset, at = found
    if cd_offset + cd_size != base + at:    # the directory ends where the end records start
        return None
    return cd_offset - base, archive_size - cd_offset, count, at


def _zip64_end(tail: bytes, end_at: int, base: int) -> tuple[int, int, int, int] | None:
    """(entries, directory size, directory offset, where the zip64 end record starts in `tail`)."""
    at = end_at - _LOCATOR64.size
    if at < 0:
        return None
    sig, _, end64_offset, disks = _LOCATOR64.unpack_from(tail, at)
    at -= _END64.size
    if sig != b"PK\x06\x07" or disks != 1 or at < 0:
        return None
    sig, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = _END64.unpack_from(tail, at)
    if sig != b"PK\x06\x06" or disk or cd_disk or end64_offset != base + at:
        return None
    return count, cd_size, cd_offset, at


def _entries(tail: bytes, at: int, count: int, end: int) -> list[Member] | None:
    out = []
    for _ in range(count):
        if at + _ENTRY.size > end:
            return None
        (sig, _, _, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len, _, _, _,
         offset) = _ENTRY.unpack_from(tail, at)
        at += _ENTRY.size
        if sig != b"PK\x01\x02" or flags & 0x1 or at + name_len + extra_len + comment_len > end:
            return None     # (an encrypted member, or entries running past the directory)
        name = tail[at:at + name_len].decode("utf-8" if flags & 0x800 else "cp437")
        extra = tail[at + name_len:at + name_len + extra_len]
        at += name_len + extra_len + comment_len
        sizes = _zip64_fields(extra, size, csize, offset)
        if sizes is None:
            return None
        size, csize, offset = sizes
        out.append(Member(name, offset, size, crc, method))
    return out if at == end else None


def _zip64_fields(extra: bytes, size: int, csize: int, offset: int) -> tuple[int, int, int] | None:
    """The sizes and offset with each 0xFFFFFFFF replaced from the zip64 extra field, in the order the format
    gives them (size, compressed size, offset)."""
    wanted = [v == _MAX32 for v in (size, csize, offset)]
    if not any(wanted):
        return size, csize, offset
    at = 0
    while at + _EXTRA.size <= len(extra):
        kind, length = _EXTRA.unpack_from(extra, at)
        at += _EXTRA.size
        if kind == _ZIP64_EXTRA:
            values = [size, csize, offset]
            field = at
            for i in range(3):
                if wanted[i]:
                    if field + 8 > at + length:
                        return None
                    values[i] = int.from_bytes(extra[field:field + 8], "little")
                    field += 8
            return values[0], values[1], values[2]
        at += length
    return None
