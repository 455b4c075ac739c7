"""Where a logical tensor's elements sit: shards made of boxes, flat ranges of shards, and how they meet.

Parallelism cuts a logical tensor (the full tensor, row-major) in two ways that compose:
* a Shard is a tensor assembled from boxes (Blocks) of the logical tensor: a tensor-parallel rank's
  slice (one box, or several for fused q/k/v sub-params), a DCP chunk. `Shard.whole(shape)` is the
  logical tensor itself.
* a flat range [start, stop) of a shard, in the shard's row-major order: ZeRO's flat partitions cut
  through shards.
A source Fragment (reshard.core.catalog) is one flat range of one shard held contiguously in a storage; a
target Piece (reshard.core.write_requests) is one flat range of one shard laid contiguously in a target storage.
Everything here is closed form: a flat range of a shard is at most 2·ndim − 1 boxes (`flat_boxes`), a
box meets a block in at most one box, and nothing loops over rows or elements.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reshard.core.geometry import Range, box_runs, offset, span, strides

Index = tuple[int, ...]          # a position or a shape: one int per dim
Box = tuple[Index, Index]        # (first element, shape)


@dataclass(frozen=True, slots=True)
class Block:
    """A box of the logical tensor inside a shard: it starts at `at` in the logical tensor and at `local`
    in the shard."""
    at: Index
    local: Index
    shape: Index


@dataclass(frozen=True, slots=True)
class Shard:
    """A row-major tensor of `shape` whose `blocks` are boxes of the logical tensor. Elements in no block
    (vocabulary padding, a replicated block read from another rank) are not placed."""
    shape: Index
    blocks: tuple[Block, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Shard:
        dims = tuple(shape)
        zeros = (0,) * len(dims)
        return Shard(dims, (Block(zeros, zeros, dims),))

    @staticmethod
    def box(at: Sequence[int], shape: Sequence[int]) -> Shard:
        """A box of the logical tensor stored as a tensor of its own (a DCP chunk)."""
        dims = tuple(shape)
        return Shard(dims, (Block(tuple(at), (0,) * len(dims), dims),))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Region:
    """A box of the logical tensor held in a flat range of a shard: where it starts in the logical tensor
    (`at`), in the shard (`local`), its shape, and `offset`, the position of its first element counted
    from the range's first element."""
    at: Index
    local: Index
    shape: Index
    offset: int


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The flat range [start, stop) of a row-major tensor of `shape` as boxes (first element, shape),
    each contiguous, in order: at most 2·ndim − 1 of them."""
    out: list[Box] = []
    if start < stop:
        _split(tuple(shape), 0, start, stop, (), out)
    return out


def _split(shape: Index, d: int, start: int, stop: int, prefix: Index, out: list[Box]) -> None:
    """[start, stop) of the sub-tensor at index `prefix` of the first d dims."""
    if d == len(shape):                       # a 0-dim tensor
        out.append(((), ()))
        return
    inner = math.prod(shape[d + 1:])
    first, last = start // inner, (stop - 1) // inner
    rest, ones = (0,) * (len(shape) - d - 1), (1,) * d
    if not inner or start % inner == 0 and stop % inner == 0:
        out.append((prefix + (first,) + rest, ones + (last - first + 1,) + shape[d + 1:]))
        return
    if first == last:
        _split(shape, d + 1, start - first * inner, stop - first * inner, prefix + (first,), out)
        return
    if start % inner:                          # the partial first row
        _split(shape, d + 1, start - first * inner, inner, prefix + (first,), out)
        first += 1
    full_stop = last if stop % inner else last + 1
    if full_stop > first:
        out.append((prefix + (first,) + rest, ones + (full_stop - first,) + shape[d + 1:]))
    if stop % inner:                           # the partial last row
        _split(shape, d + 1, 0, stop - last * inner, prefix + (last,), out)


def intersect(a_at: Sequence[int], a_shape: Sequence[int], b_at: Sequence[int],
              b_shape: Sequence[int]) -> Box | None:
    """The overlap of two boxes (first element, shape) as (first element, shape), or None."""
    at: list[int] = []
    shape: list[int] = []
    for a0, an, b0, bn in zip(a_at, a_shape, b_at, b_shape, strict=True):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if lo >= hi:
            return None
        at.append(lo)
        shape.append(hi - lo)
    return tuple(at), tuple(shape)


def regions(shard: Shard, start: int, stop: int) -> list[Region]:
    """The boxes of the logical tensor that the flat range [start, stop) of `shard` holds, as Regions."""
    out: list[Region] = []
    shard_strides = strides(shard.shape)
    for box_at, box_shape in flat_boxes(shard.shape, start, stop):
        for block in shard.blocks:
            hit = intersect(box_at, box_shape, block.local, block.shape)
            if hit is None:
                continue
            local, shape = hit
            at = tuple(a + loc - b for a, loc, b in zip(block.at, local, block.local, strict=True))
            out.append(Region(at, local, shape, offset(local, shard_strides) - start))
    return out


def local_extent(shard: Shard, at: Sequence[int], shape: Sequence[int]) -> Range | None:
    """The flat range of `shard` spanning every element of the logical box (at, shape) it places, or None."""
    extent: Range | None = None
    shard_strides = strides(shard.shape)
    for block in shard.blocks:
        hit = intersect(at, shape, block.at, block.shape)
        if hit is None:
            continue
        first = tuple(a - b + loc for a, b, loc in zip(hit[0], block.at, block.local, strict=True))
        a = offset(first, shard_strides)
        b = a + span(hit[1], shard_strides)
        extent = (a, b) if extent is None else (min(extent[0], a), max(extent[1], b))
    return extent


def tiles(shape: Sequence[int], boxes: Iterable[Box]) -> bool:
    """Do the boxes (first element, shape) tile a tensor of `shape`: each inside it, no two overlapping, all
    of it covered? A sort along dim 0 and a sweep over the boxes still open there."""
    total = 0
    open_: list[Box] = []       # the boxes still open at the current position along dim 0
    for at, size in sorted(boxes):
        if any(a < 0 or a + n > d for a, n, d in zip(at, size, shape, strict=True)):
            return False
        open_ = [(a, n) for a, n in open_ if a[0] + n[0] > at[0]] if shape else open_
        if any(intersect(at, size, a, n) for a, n in open_):
            return False
        open_.append((at, size))
        total += math.prod(size)
    return total == math.prod(shape)


def flat_runs(shape: Sequence[int], at: Sequence[int], size: Sequence[int]) -> list[Range]:
    """The box (at, size) of a row-major tensor of `shape` as flat ranges [start, stop), for messages."""
    starts, _, lengths = box_runs(shape, at, size)
    return [(a, a + n) for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


def full_index(shard: Shard, full_shape: Sequence[int], index: int) -> int | None:
    """The flat index in the logical tensor of `shard`'s flat element `index` (None: no block places it)."""
    local = [0] * len(shard.shape)
    for d, s in enumerate(strides(shard.shape)):
        local[d], index = divmod(index, s) if s else (0, index)
    for block in shard.blocks:
        if all(lo <= i < lo + n for i, lo, n in zip(local, block.local, block.shape, strict=True)):
            at = [a + i - lo for a, i, lo in zip(block.at, local, block.local, strict=True)]
            return offset(at, strides(full_shape))
    return None


def through(shard: Shard, view: Iterable[Block]) -> Shard:
    """`shard` of a tensor T seen as a shard of another tensor U whose boxes sit in T as `view` says (each
    Block: `at` in U, `local` in T): the same stored elements, each block of the result a box of U. What `view`
    does not place in T (another tensor's rows, fused beside U's) is not placed. Closed form: a block meets a view
    box in at most one box."""
    out: list[Block] = []
    for block in shard.blocks:
        for box in view:
            hit = intersect(block.at, block.shape, box.local, box.shape)
            if hit is None:
                continue
            at, shape = hit
            out.append(Block(tuple(v + a - loc for v, a, loc in zip(box.at, at, box.local, strict=True)),
                             tuple(b + a - t for b, a, t in zip(block.local, at, block.at, strict=True)), shape))
    return Shard(shard.shape, tuple(out))
