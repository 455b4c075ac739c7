"""The CRC-32 every zip member carries, checked on the bytes a command reads, so bit rot is reported, never
copied into an output.

Reads come in blocks, out of order, some of a member only (a target file takes ranges of several source
members). Each block's CRC-32 is taken as it is read, the bytes being in memory then anyway; `verify` puts a
member's blocks in order and combines their CRCs (crc32_combine: no byte is hashed twice), reading from disk
only what no block covered — the bytes the command did not need (padding a target does not take), those
read through a map as a sparse box (never in memory whole), a block that overlaps another in part — and
compares the whole with the CRC the archive stores.

The rule, for every command: a checksummed member the command reads any byte of is verified whole before
its result is committed or reported; `expect` adds members verified whole even if nothing was read of them
(convert: every member its plan reads from, so files kept by --resume are covered too; validate --deep:
every member of the catalog's tensors).
"""
from __future__ import annotations

import bisect
from typing import BinaryIO

from reshard.errors import CheckpointError
from reshard.storage import files as fs

try:    # ISA-L's CRC-32 (python-isal): the same values as zlib's, about 4 times as fast here
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

_POLY = 0xEDB88320          # the CRC-32 polynomial of zip (and zlib), bit-reflected
_READ = 16 << 20            # bytes per read when verifying what no block covered


def _multiply(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial, both polynomials over GF(2) in the reflected bit order CRC-32 uses."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list:
    """x^(2^k) modulo the polynomial, k = 0..63: any x^n is a product of some of them."""
    out, p = [], 1 << 30       # x^1
    for _ in range(64):
        out.append(p)
        p = _multiply(p, p)
    return out


_X2K = _powers()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from crc1 = crc32(A), crc2 = crc32(B) and len(B) (bytes): crc1 carried over B's
    8·len2 bit shifts is crc1·x^(8·len2) mod P, the power built from the squares in _X2K (as zlib does)."""
    shift, k, n = 1 << 31, 3, len2      # x^0; 8·len2 = len2 << 3
    while n:
        if n & 1:
            shift = _multiply(_X2K[k & 63], shift)
        n >>= 1
        k += 1
    return _multiply(shift, crc1) ^ crc2


class Tally:
    """The CRC-32 of every block read from checksummed members (StorageRef with a `crc`), by member;
    `verify` checks each member touched, and each one expected, whole. Blocks may be noted from several
    threads (list appends); `pieces`/`merge` carry them between processes."""

    def __init__(self, members=()):
        self._members = {}      # (path, offset) -> StorageRef
        self._starts = {}       # path -> sorted member offsets (the index of note_at)
        self._pieces = {}       # (path, offset) -> [(first byte, byte past the last, crc | None)]
        for storage in members:
            self._know(storage)

    def _know(self, storage) -> bool:
        if storage.crc is None:
            return False
        key = (storage.file, storage.offset)
        if key not in self._members:
            self._members[key] = storage
            bisect.insort(self._starts.setdefault(storage.file, []), storage.offset)
        return True

    def expect(self, members) -> None:
        """Members verified whole by `verify`, whether or not anything is read of them."""
        for storage in members:
            if self._know(storage):
                self._pieces.setdefault((storage.file, storage.offset), [])

    def note(self, storage, offset: int, data) -> None:
        """`data` (bytes-like, contiguous) was read from byte `offset` of the file, inside `storage`."""
        if self._know(storage):
            self._add(storage, offset, memoryview(data).nbytes, crc32(data))

    def touch(self, storage, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of `storage` were used but not hashed (a sparse box through a map)."""
        if self._know(storage):
            self._add(storage, offset, nbytes, None)

    def note_at(self, path: str, offset: int, data) -> None:
        """As `note`, the member found by where the bytes lie (one of the members this tally was made with)."""
        storage = self._member_at(path, offset)
        if storage is not None:
            self._add(storage, offset, memoryview(data).nbytes, crc32(data))

    def touch_at(self, path: str, offset: int, nbytes: int) -> None:
        storage = self._member_at(path, offset)
        if storage is not None:
            self._add(storage, offset, nbytes, None)

    def _member_at(self, path: str, offset: int):
        starts = self._starts.get(path)
        if not starts:
            return None
        i = bisect.bisect_right(starts, offset) - 1
        storage = self._members[(path, starts[i])] if i >= 0 else None
        return storage if storage is not None and offset < storage.offset + storage.nbytes else None

    def _add(self, storage, offset: int, nbytes: int, crc) -> None:
        if offset < storage.offset or offset + nbytes > storage.offset + storage.nbytes:
            crc = None          # (reaching outside the member: only the member's own bytes are hashed, at verify)
            offset, nbytes = max(offset, storage.offset), min(offset + nbytes, storage.offset + storage.nbytes)
        self._pieces.setdefault((storage.file, storage.offset), []).append((offset, offset + nbytes, crc))

    def pieces(self) -> dict:
        """What was noted, to `merge` into another process's tally."""
        return {key: (self._members[key], list(found)) for key, found in self._pieces.items()}

    def merge(self, pieces: dict) -> None:
        for key, (storage, found) in pieces.items():
            self._know(storage)
            self._pieces.setdefault(key, []).extend(found)

    def problems(self):
        """A CheckpointError for each member whose bytes do not have the CRC-32 its archive stores (or cannot be
        read to be checked)."""
        fds: dict[str, BinaryIO] = {}     # source file -> its open handle, shared by its members
        try:
            for key in sorted(self._pieces):
                storage = self._members[key]
                try:
                    read = _member_crc(storage, self._pieces[key], fds)
                except CheckpointError as e:
                    yield e
                    continue
                if read != storage.crc:
                    yield CheckpointError(storage.file, f"member {storage.member}: CRC-32 mismatch (stored "
                                                        f"0x{storage.crc:08x}, read 0x{read:08x}): the file is corrupt")
        finally:
            for f in fds.values():
                f.close()

    def verify(self) -> None:
        """Raise the first mismatch (CheckpointError), if any."""
        for problem in self.problems():
            raise problem


def problems_of(pieces, expected=()):
    """The mismatches (CheckpointError) of the members several tallies (Tally.pieces: ranks, processes) read
    from, and of those `expected`, each verified whole from all their blocks together."""
    tally = Tally()
    for read in pieces:
        tally.merge(read)
    tally.expect(expected)
    return tally.problems()


def _member_crc(storage, pieces: list, fds: dict) -> int:
    """The CRC-32 of the member's bytes: a chain of blocks tiling it, their CRCs combined in order, with the
    fewest bytes read from disk where no chain of blocks reaches (blocks read twice with other boundaries
    overlap in part; a touched range has no CRC of its own). The chain is a shortest path over the blocks'
    boundaries: a block is a free step from its first byte to the byte past its last, reading from disk a
    step that costs its length."""
    first, end = storage.offset, storage.offset + storage.nbytes
    hashed: dict[tuple[int, int], int] = {}
    for lo, hi, crc in pieces:
        if crc is not None and hashed.get((lo, hi), crc) == crc:
            hashed[(lo, hi)] = crc
    points = sorted({first, end} | {p for lo, hi in hashed for p in (lo, hi)})
    from_here: dict[int, list[int]] = {}
    for lo, hi in hashed:
        from_here.setdefault(lo, []).append(hi)
    cost, step = {first: 0}, {}         # fewest disk bytes to reach a point; how it was reached
    for i, at in enumerate(points):
        if at not in cost:
            continue
        moves = [(hi, 0) for hi in from_here.get(at, ())]
        if i + 1 < len(points):
            moves.append((points[i + 1], points[i + 1] - at))
        for to, bytes_read in moves:
            if cost[at] + bytes_read < cost.get(to, float("inf")):
                cost[to], step[to] = cost[at] + bytes_read, (at, bytes_read == 0 and (at, to) in hashed)
    chain, at = [], end
    while at != first:
        back, block = step[at]
        chain.append((back, at, block))
        at = back
    crc = 0
    for lo, hi, block in reversed(chain):
        crc = crc32_combine(crc, hashed[(lo, hi)] if block else _disk_crc(storage.file, lo, hi, fds), hi - lo)
    return crc


def _disk_crc(path: str, start: int, stop: int, fds: dict) -> int:
    f = fds.get(path)
    if f is None:
        try:
            f = fds[path] = fs.open(path, "rb", buffering=0)   # exactly the bytes no block read
        except OSError as e:
            raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    crc = 0
    f.seek(start)
    for at in range(start, stop, _READ):
        data = f.read(min(_READ, stop - at))
        if len(data) != min(_READ, stop - at):
            raise CheckpointError(path, f"truncated: needs byte {stop}, file has {at + len(data)}")
        crc = crc32(data, crc)
    return crc
