"""Interval arithmetic on flat element ranges, and boxes cut into them. Never a loop over elements."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# a flat range [start, stop) of elements
Range = tuple[int, int]
IntArray = np.ndarray[Any, np.dtype[np.int64]]


def intersect(a_start: int, a_stop: int, b_start: int, b_stop: int) -> Range | None:
    """The overlap of [a_start, a_stop) and [b_start, b_stop), or None."""
    start, stop = max(a_start, b_start), min(a_stop, b_stop)
    return (start, stop) if start < stop else None


def coverage(ranges: Iterable[Range], total: int) -> tuple[list[Range], list[Range], list[Range]]:
    """Gaps and overlaps of half-open ranges over [0, total).

    Returns (gaps, overlaps, outside), each a list of (start, stop): elements covered by no
    range, elements covered more than once, and ranges reaching outside [0, total).
    A sort and one sweep: O(k log k) in the number of ranges.
    """
    gaps: list[Range] = []
    overlaps: list[Range] = []
    outside: list[Range] = []
    reach = 0  # everything below `reach` is covered
    for start, stop in sorted(ranges):
        if start < 0 or stop > total:
            outside.append((start, stop))
        if start > reach:
            gaps.append((reach, start))
        elif start < reach:
            overlaps.append((start, min(reach, stop)))
        reach = max(reach, stop)
    if reach < total:
        gaps.append((reach, total))
    return gaps, overlaps, outside


def total_length(ranges: Iterable[Range]) -> int:
    return sum(stop - start for start, stop in ranges)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chunks(rows: int, parts: int) -> list[Range]:
    """[first, stop) of each of `parts` blocks of `rows` as torch.chunk cuts them (FSDP's dim-0 shards): blocks of
    ceil(rows / parts), the last ones short or empty."""
    per = ceil_div(rows, parts) if rows else 0
    return [(min(rows, p * per), min(rows, (p + 1) * per)) for p in range(parts)]


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def offset(coords: Sequence[int], element_strides: Sequence[int]) -> int:
    """The flat position of the element at `coords` in storage with these strides."""
    return sum(i * s for i, s in zip(coords, element_strides, strict=True))


def span(shape: Sequence[int], element_strides: Sequence[int]) -> int:
    """Elements from the first of a box of `shape` to one past its last, in storage with these strides."""
    return sum((n - 1) * s for n, s in zip(shape, element_strides, strict=True)) + 1


def box_runs(full_shape: Sequence[int], full_start: Sequence[int], box: Sequence[int],
             holder_shape: Sequence[int] | None = None,
             holder_start: Sequence[int] | None = None) -> tuple[IntArray, IntArray, IntArray]:
    """The contiguous runs of a box of a row-major tensor, as three int64 arrays: flat start in the
    full tensor, flat start in the holder (the shard or chunk storing the box row-major: by default
    exactly the box), and length. A box is contiguous over the trailing dims it spans entirely in
    both tensors, so there is one run per index of the leading dims: a dim-0 shard is one run, a
    dim-1 shard one run per row. Computed with numpy, without a Python loop over rows."""
    holder_shape = tuple(box) if holder_shape is None else tuple(holder_shape)
    holder_start = (0,) * len(box) if holder_start is None else tuple(holder_start)
    if not box:                                  # a 0-dim tensor: one element
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)
    k = len(box) - 1
    while k > 0 and box[k] == full_shape[k] == holder_shape[k]:
        k -= 1
    length = math.prod(box[k:])
    if length == 0 or math.prod(box[:k]) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    full_strides, holder_strides = strides(full_shape), strides(holder_shape)
    f = np.array(offset(full_start, full_strides), dtype=np.int64)
    h = np.array(offset(holder_start, holder_strides), dtype=np.int64)
    for d in range(k):
        steps = np.arange(box[d], dtype=np.int64)
        f = np.add.outer(f, steps * full_strides[d])
        h = np.add.outer(h, steps * holder_strides[d])
    return f.reshape(-1), h.reshape(-1), np.full(f.size, length, dtype=np.int64)
