"""FSDP1's flat parameters (use_orig_params=False, verl's default), told from their sizes.

FSDP1 concatenates the parameters of each wrapped module (a unit) into one flat parameter, in module order, without
alignment padding; each rank holds a torch.chunk block of it (ceil(N / W) elements, the last ranks' blocks padded with
zeros to that size). torch.optim keys the optimizer state by flat parameter, in `model.parameters()` order: the root
unit's first (registered on the root module itself), then the nested units in module order. The root holds what no
nested unit does, a run at the start of the model's order and one at its end (embeddings; final norm and head); each
nested unit one run between.

The saved files name no parameter of a flat one, so which parameters each holds is found from the sizes alone: every
way the model's parameters (in order, sizes known) cut into those runs with each unit's block size; a cut is used only
where it is the one way, else the checkpoint is refused (two units of a model rarely tie on every size).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from reshard.core.geometry import ceil_div


@dataclass(frozen=True)
class FlatParam:
    """One flat parameter: its parameters, in the order they are concatenated, and their sizes."""
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def runs(self, start: int, stop: int) -> list[tuple[str, int, int, int]]:
        """[(name, first element of it, count, at)] of the flat range [start, stop): `at` its offset from start."""
        out, offset = [], 0
        for name, size in zip(self.names, self.sizes, strict=True):
            first, last = max(start, offset), min(stop, offset + size)
            if first < last:
                out.append((name, first - offset, last - first, first - start))
            offset += size
        return out


def cuts(params: Sequence[tuple[str, int]], blocks: Sequence[int], world: int,
         enough: int = 2) -> list[tuple[FlatParam, ...]]:
    """Ways (up to `enough`: a caller needs to know only whether there is one) `params` ((name, numel) in model
    order) are the flat parameters whose per-rank block sizes at `world` ranks are `blocks` (the optimizer's order):
    the root's a prefix and a suffix of the order and the nested units runs between, or, for a root holding none,
    every unit a run."""
    sizes = [n for _, n in params]
    before = list(itertools.accumulate(sizes, initial=0))     # before[i]: elements of params[:i]
    n = len(params)

    def fits(unit: int, numel: int) -> bool:
        return numel > 0 and ceil_div(numel, world) == blocks[unit]

    def runs(unit: int, at: int) -> Iterator[list[tuple[int, int]]]:
        """Units unit.. as consecutive runs from params[at] on (each way, ending anywhere)."""
        if unit == len(blocks):
            yield []
            return
        for stop in range(at + 1, n + 1):
            numel = before[stop] - before[at]
            if ceil_div(numel, world) > blocks[unit]:
                return
            if fits(unit, numel):
                for rest in runs(unit + 1, stop):
                    yield [(at, stop), *rest]

    found: dict[tuple, None] = {}
    for head in range(n + 1):         # the root's prefix params[:head]; its suffix is what the nested runs leave
        for nested in runs(1, head):
            tail = nested[-1][1] if nested else head
            if fits(0, before[head] + before[n] - before[tail]):
                found[((*range(head), *range(tail, n)), *(tuple(range(a, b)) for a, b in nested))] = None
            if len(found) >= enough:
                break
    for nested in runs(0, 0):         # no root unit of its own
        if nested[-1][1] == n:
            found[tuple(tuple(range(a, b)) for a, b in nested)] = None
    return [tuple(FlatParam(tuple(params[i][0] for i in unit), tuple(sizes[i] for i in unit)) for unit in cut)
            for cut in list(found)[:enough]]
