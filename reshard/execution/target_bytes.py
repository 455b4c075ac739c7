"""The bytes of target storages, block by block: source reads (positioned, or a window for a sparse box, through
reshard.storage), strided gathers of boxes, casts and constants. The executor writes what these produce; nothing
here writes a file.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import math

import numpy as np

from reshard.core import geometry
from reshard.core.dtypes import cast_array, cast_into, itemsize, numpy_carrier
from reshard.core.geometry import strides
from reshard.core.placement import flat_boxes, intersect
from reshard.core.planner import Copy, Gather
from reshard.errors import ReshardError
from reshard.execution.checksums import Tally
from reshard.storage.protocol import SourceStorage
from reshard.storage.routing import sources

DROP_CACHE_BYTES = 1 << 20      # source reads at least this big are dropped from the page cache
SPARSE_SPAN = 2                 # a box spanning more than twice its bytes is mapped, not read whole
WINDOW_BYTES = 16 << 20         # the most a sparse box's read spans where the source is not mapped (object storage)


class BlockRing:
    """`count` buffers of `chunk` bytes each, handed out in turn: the source reads of a target are read into memory
    made once (a fresh 16 MiB buffer per block cost page faults: 7% of a conversion's CPU on tmpfs). A buffer is
    handed out again `count` blocks later: its consumer must be done with it by then (the executor holds
    READ_AHEAD + 1 blocks at once, each written out before the next is asked for). A block that is cast is read into
    `scratch` first, one more buffer, made when first needed: blocks are made one at a time (the executor's one
    reader thread), each done with it before the next."""

    def __init__(self, chunk: int, count: int):
        self._buffers = [np.empty(chunk, dtype=np.uint8) for _ in range(count)]
        self._next = 0
        self._chunk = chunk
        self._scratch: np.ndarray | None = None

    def scratch(self, nbytes: int) -> np.ndarray:
        """The first `nbytes` (at most `chunk`) of the buffer a block is read into before it is cast into its own."""
        if self._scratch is None:
            self._scratch = np.empty(self._chunk, dtype=np.uint8)
        return self._scratch[:nbytes]

    def take(self, nbytes: int) -> np.ndarray:
        """The next buffer's first `nbytes` (at most `chunk`)."""
        buffer = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        return buffer[:nbytes]


def storage_blocks(storage, chunk: int, sources, ring: BlockRing | None = None):
    """Callables producing the storage's bytes (target dtype) in blocks of at most `chunk` bytes (each a
    bytes-like object: bytes, or a memoryview of an array made for it or of a buffer of `ring`, whose callable takes
    it from the ring when it is made: blocks are made in the order they are consumed)."""
    for op in storage.ops:
        yield from _op_blocks(op, storage.dtype, chunk, sources, ring)


def _op_blocks(op, dtype: str, chunk: int, sources, ring: BlockRing | None = None):
    out_size = itemsize(dtype)
    if isinstance(op, Copy):
        in_size = itemsize(op.src_dtype)
        step = max(1, chunk // max(in_size, out_size))
        for first in range(0, op.count, step):
            n = min(step, op.count - first)
            into = ring.take(n * out_size) if ring is not None else None
            raw = (ring.scratch if op.src_dtype != dtype else None) if ring is not None else None
            yield functools.partial(_copy_block, sources, op, first * in_size, n * in_size, dtype, into, raw)
    elif isinstance(op, Gather):
        step = max(1, chunk // max([out_size] + [itemsize(box.src_dtype) for box in op.copies]))
        for first in range(0, op.count, step):
            n = min(step, op.count - first)
            into = ring.take(n * out_size) if ring is not None else None
            yield functools.partial(_gather_block, sources, op, first, n, dtype, into)
    else:
        step = max(1, chunk // out_size)
        for first in range(0, op.count, step):
            yield functools.partial(constant, op.value, dtype, min(step, op.count - first))


def fill(storage, out: np.ndarray, sources, chunk: int = 8 << 20) -> None:
    """The storage's bytes (target dtype) put into `out` (uint8, contiguous, `storage.nbytes` long), op by op:
    a read that needs no cast goes straight from the kernel into `out`; a cast or gather is done `chunk`
    bytes at a time, so nothing but `out` grows with the storage."""
    size = itemsize(storage.dtype)
    for op in storage.ops:
        if isinstance(op, Copy) and op.src_dtype == storage.dtype:
            sources.read_into(op.src_file, op.src_offset, out[op.dst * size:(op.dst + op.count) * size])
            continue
        at = op.dst * size
        for block in _op_blocks(op, storage.dtype, chunk, sources):
            data = np.frombuffer(block(), dtype=np.uint8)
            out[at:at + data.size] = data
            at += data.size


def _copy_block(sources, op, offset, nbytes, dtype, into: np.ndarray | None = None, scratch=None):
    """The block's bytes: read into `into` (a ring's buffer) where given, else into fresh memory; a block to cast
    read into `scratch(nbytes)` and cast from there into `into` (no temporary array of the block's size)."""
    if into is None:
        raw = sources.read(op.src_file, op.src_offset + offset, nbytes)
        return raw if op.src_dtype == dtype else cast(raw, op.src_dtype, dtype)
    if op.src_dtype == dtype:
        sources.read_into(op.src_file, op.src_offset + offset, into)
        return into.data.cast("B")
    raw = scratch(nbytes)
    sources.read_into(op.src_file, op.src_offset + offset, raw)
    cast_into(raw.view(numpy_carrier(op.src_dtype)), op.src_dtype, dtype, into.view(numpy_carrier(dtype)))
    return into.data.cast("B")


def _gather_block(sources, op, first: int, count: int, dtype: str, into: np.ndarray | None = None) -> memoryview:
    """Elements [first, first + count) of a Gather: the boxes of that flat range of its shard, each copied
    with strided views from one block read of its source, into `into` (a ring's buffer) where given."""
    out = np.empty(count, dtype=numpy_carrier(dtype)) if into is None else into.view(numpy_carrier(dtype))
    lo = op.start + first
    shard_strides = strides(op.shape)
    byte_strides = tuple(s * out.itemsize for s in shard_strides)
    filled = 0
    for box_at, box_shape in flat_boxes(op.shape, lo, lo + count):
        for box in op.copies:
            hit = intersect(box_at, box_shape, box.local, box.shape)
            if hit is None:
                continue
            at, shape = hit
            offset = box.src_offset + itemsize(box.src_dtype) * sum(
                (a - loc) * s for a, loc, s in zip(at, box.local, box.src_strides, strict=True))
            dst = geometry.offset(at, shard_strides) - lo
            target = np.lib.stride_tricks.as_strided(out[dst:], shape, byte_strides)
            sources.copy_box(target, box.src_file, offset, box.src_strides, box.src_dtype, dtype)
            filled += math.prod(shape)
    if filled != count:
        raise AssertionError(f"a gather filled {filled} of {count} elements")   # the planner counted them
    return out.data.cast("B")


def constant(value, dtype: str, count: int) -> bytes | memoryview:
    if dtype == "bfloat16":
        return cast(np.full(count, value, dtype="<f4").tobytes(), "float32", "bfloat16")
    return np.full(count, value, dtype=numpy_carrier(dtype)).tobytes()


def cast(raw, src: str, dst: str) -> memoryview:
    """Convert element type, rounding to nearest even as torch does (bfloat16 included)."""
    return cast_array(np.frombuffer(raw, dtype=numpy_carrier(src)), src, dst).data.cast("B")


def _assign(target: np.ndarray, values: np.ndarray, src: str, dst: str) -> None:
    target[...] = values if src == dst else cast_array(values, src, dst)


class SourceFiles:
    """Source files by path, read from `storage` (by default the local filesystem): positioned reads into fresh
    buffers (no mapped pages kept). A big read is dropped from the page cache after it, unless it overlaps a
    range `reread` says is read again. Every read is noted in `tally` (reshard.execution.checksums.Tally), which checks
    the CRC-32 of the members it was made with."""

    def __init__(self, reread: dict, tally: Tally | None = None, storage: SourceStorage | None = None):
        self._files = storage or sources()
        self._reread = reread
        self.tally = tally or Tally()

    def _read_again(self, path: str, offset: int, nbytes: int) -> bool:
        ranges = self._reread.get(path)
        if not ranges:
            return False
        i = bisect.bisect_right(ranges, (offset + nbytes,)) - 1
        return i >= 0 and ranges[i][1] > offset

    # The kernel's read-ahead is left on. It reads some pages twice (a target takes its pieces wherever
    # they lie in the file, and a page read and dropped may lie in a later read's read-ahead: 0.51 GB
    # read for 0.45 GB written, AutoEP --to ep=1), yet POSIX_FADV_RANDOM, which reads each page once,
    # made conversions 4-13% slower here (alternating cold-cache runs, 0.44 GB AutoEP and 1.9 GB ZeRO-3).

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        data = self._files.read(path, offset, nbytes)
        if len(data) != nbytes:
            raise ReshardError.at(path, f"truncated: needed bytes [{offset}, {offset + nbytes})")
        self.tally.note_at(path, offset, data)
        self._done_with(path, offset, nbytes)
        return data

    def read_into(self, path: str, offset: int, out: np.ndarray) -> None:
        """`out.nbytes` bytes of `path` from `offset` read straight into `out` (contiguous); dropped from the
        page cache afterwards as `read` drops them."""
        view, nbytes = out.data.cast("B"), out.nbytes
        if self._files.read_into(path, offset, view) != nbytes:
            raise ReshardError.at(path, f"truncated: needed bytes [{offset}, {offset + nbytes})")
        self.tally.note_at(path, offset, view)
        self._done_with(path, offset, nbytes)

    def _done_with(self, path: str, offset: int, nbytes: int) -> None:
        """A big read made once is dropped from the page cache: a conversion reads each byte once."""
        if nbytes >= DROP_CACHE_BYTES and not self._read_again(path, offset, nbytes):
            self._files.done_with(path, offset, nbytes)

    def copy_box(self, target: np.ndarray, path: str, offset: int, box_strides: tuple, src: str, dst: str) -> None:
        """Fill `target` with the box of `target.shape` whose first element is at byte `offset` of `path` and
        whose elements are `box_strides` elements apart. The box's span is read in one block; a sparse one
        (a column slice of wide rows) is read through a window instead (a map, on POSIX), so only the pages it
        touches are read, and left in the page cache for the targets that take the other columns."""
        size = itemsize(src)
        span = geometry.span(target.shape, box_strides) * size
        byte_strides = tuple(s * size for s in box_strides)
        if span <= SPARSE_SPAN * target.size * size or (span <= WINDOW_BYTES and not self._files.mapped(path)):
            block = np.frombuffer(self.read(path, offset, span), dtype=numpy_carrier(src))
            _assign(target, np.lib.stride_tricks.as_strided(block, target.shape, byte_strides), src, dst)
            return
        if not self._files.mapped(path):    # a window would be a read of the whole span into memory: in slabs
            self._copy_slabs(target, path, offset, box_strides, src, dst)
            return
        self.tally.touch_at(path, offset, span)      # (only some of the span's pages are read: verified later)
        with contextlib.ExitStack() as window:
            try:
                view = window.enter_context(self._files.window(path, offset, span))
            except (OSError, ValueError) as e:
                raise ReshardError.at(path, f"truncated: needed bytes [{offset}, {offset + span}) ({e})") from None
            block = np.frombuffer(view, dtype=numpy_carrier(src), count=(span - size) // size + 1)
            try:
                _assign(target, np.lib.stride_tricks.as_strided(block, target.shape, byte_strides), src, dst)
            finally:
                del block, view     # the window's views go before it does

    def _copy_slabs(self, target: np.ndarray, path: str, offset: int, box_strides: tuple, src: str,
                    dst: str) -> None:
        """copy_box of a sparse box from storage that is not mapped (object storage), cut along its first axis
        into slabs each spanning at most WINDOW_BYTES (one index spanning more: cut along the next axis), so
        the memory a read takes stays bounded whatever the box spans."""
        row = box_strides[0] * itemsize(src)
        rows = min(max(1, WINDOW_BYTES // max(1, row)), max(1, target.shape[0] // 2))
        for first in range(0, target.shape[0], rows):
            if rows == 1:
                self.copy_box(target[first, ...], path, offset + first * row, box_strides[1:], src, dst)
            else:
                self.copy_box(target[first:first + rows], path, offset + first * row, box_strides, src, dst)

    def will_read(self, reads: dict) -> None:
        """{path: byte ranges} about to be read (FilePlan.source_reads): a hint to the storage."""
        for path, ranges in reads.items():
            self._files.will_read(path, ranges)

    def close(self) -> None:
        self._files.close()

