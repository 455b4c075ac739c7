"""A DCP chunk is a box of the global tensor; the Catalog holds flat row-major runs."""
from __future__ import annotations

import itertools
import math


def flat_runs(shape: tuple, offsets: tuple, sizes: tuple):
    """Yield (global flat start, count, flat start within the chunk) of each contiguous run of a
    dense box `sizes` at `offsets` in a row-major tensor of `shape`. A box spanning whole trailing
    dimensions (a dim-0 shard) is a single run; a column shard is one run per row."""
    if not shape:
        yield 0, 1, 0
        return
    k = len(shape) - 1      # the runs are contiguous over dims k.. (full extent after k)
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = sizes[k] * strides[k]
    base = sum(o * s for o, s in zip(offsets, strides))
    for i, idx in enumerate(itertools.product(*(range(n) for n in sizes[:k]))):
        yield base + sum(j * s for j, s in zip(idx, strides)), run, i * run
