"""Which source fragments hold a range of a logical tensor: the one lookup the planner and the readers share.

A request is a flat range of a shard (reshard.core.placement) of the logical tensor, the way a target storage
or a reader asks for elements. Where the source holds that very shard, the answer is flat: runs of
fragments, found by bisection (`Locator.runs`). Otherwise it is boxes (`Locator.boxes`): the request's
regions, met with the regions of the fragments of each source shard whose flat extent can hold them.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass

from reshard.core.catalog import Fragment, LogicalTensor
from reshard.core.geometry import offset, strides
from reshard.core.placement import Index, Region, Shard, intersect, local_extent, regions


@dataclass(frozen=True, slots=True)
class Run:
    """Request elements [offset, offset + count) are fragment elements starting at storage element `elem`."""
    offset: int
    count: int
    fragment: Fragment
    elem: int


@dataclass(frozen=True, slots=True)
class BoxHit:
    """A box of the request held by one fragment: its first element and shape in the requested shard, and
    the storage element of the fragment holding that first element, with the fragment's shard strides."""
    local: Index
    shape: Index
    fragment: Fragment
    elem: int
    strides: Index

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Group:
    """The fragments of one source shard, sorted by start."""

    def __init__(self, shard: Shard, fragments: list[Fragment]):
        self.shard = shard
        self.fragments = sorted(fragments, key=lambda f: f.start)
        self.starts = [f.start for f in self.fragments]
        self.strides = strides(shard.shape)
        self._regions: dict[int, list[Region]] = {}

    def overlapping(self, lo: int, hi: int) -> Iterator[Fragment]:
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        for frag in self.fragments[i:]:
            if frag.start >= hi:
                return
            if frag.stop > lo:
                yield frag

    def regions(self, frag: Fragment) -> list[Region]:
        found = self._regions.get(id(frag))
        if found is None:
            found = self._regions[id(frag)] = regions(self.shard, frag.start, frag.stop)
        return found


class Locator:
    """Lookups into one logical tensor's fragments."""

    def __init__(self, tensor: LogicalTensor):
        self.tensor = tensor
        whole = Shard.whole(tensor.shape)
        by_shard: dict[Shard, list[Fragment]] = {}
        for frag in tensor.fragments:
            by_shard.setdefault(frag.shard or whole, []).append(frag)
        self.groups = {shard: _Group(shard, frags) for shard, frags in by_shard.items()}
        # the groups by where their blocks start and end along the first axis: a request meets only the few
        # shards beside it (a layer-stacked Megatron tensor has a shard per layer and tensor-parallel rank)
        spans = sorted(((min((b.at[0] for b in g.shard.blocks), default=0),
                         max((b.at[0] + b.shape[0] for b in g.shard.blocks), default=0), i, g)
                        for i, g in enumerate(self.groups.values())), key=lambda s: s[:3]) if tensor.shape else []
        self._firsts = [s[0] for s in spans]
        self._spans = [(s[1], s[3]) for s in spans]
        self._longest = max((s[1] - s[0] for s in spans), default=0)

    def holds_as(self, shard: Shard | None) -> bool:
        """Is `shard` (None: the whole tensor) one of the source's own shards, so that `runs` answers?"""
        return (shard or Shard.whole(self.tensor.shape)) in self.groups

    def runs(self, shard: Shard | None, start: int, stop: int) -> list[Run]:
        """The fragments of source shard `shard` covering [start, stop) of it, as Runs in order (gaps left out:
        the caller checks the count)."""
        group = self.groups[shard or Shard.whole(self.tensor.shape)]
        out: list[Run] = []
        for frag in group.overlapping(start, stop):
            lo, hi = max(start, frag.start), min(stop, frag.stop)
            out.append(Run(lo - start, hi - lo, frag, frag.elem_offset + lo - frag.start))
        return out

    def _beside(self, at: Index, shape: Index) -> Iterator[_Group]:
        """The groups whose blocks may meet the box (at, shape): all but those apart from it along axis 0."""
        if not at:
            yield from self.groups.values()
            return
        lo, hi = at[0], at[0] + shape[0]
        first = bisect.bisect_left(self._firsts, lo - self._longest)
        for i in range(first, bisect.bisect_left(self._firsts, hi)):
            stop, group = self._spans[i]
            if stop > lo:
                yield group

    def boxes(self, shard: Shard | None, start: int, stop: int) -> list[BoxHit]:
        """The boxes of [start, stop) of `shard` (None: the whole tensor) found in the fragments, as BoxHits."""
        shard = shard or Shard.whole(self.tensor.shape)
        out: list[BoxHit] = []
        for want in regions(shard, start, stop):
            for group in self._beside(want.at, want.shape):
                extent = local_extent(group.shard, want.at, want.shape)
                if extent is None:
                    continue
                for frag in group.overlapping(*extent):
                    for have in group.regions(frag):
                        hit = intersect(want.at, want.shape, have.at, have.shape)
                        if hit is None:
                            continue
                        at, shape = hit
                        local = tuple(loc + a - w for loc, a, w in zip(want.local, at, want.at, strict=True))
                        held = tuple(loc + a - h for loc, a, h in zip(have.local, at, have.at, strict=True))
                        elem = frag.elem_offset - frag.start + offset(held, group.strides)
                        out.append(BoxHit(local, shape, frag, elem, group.strides))
        return out
