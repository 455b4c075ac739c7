"""Interval arithmetic on flat element ranges. Never a loop over elements."""
from __future__ import annotations


def intersect(a_start: int, a_stop: int, b_start: int, b_stop: int):
    """The overlap of [a_start, a_stop) and [b_start, b_stop), or None."""
    start, stop = max(a_start, b_start), min(a_stop, b_stop)
    return (start, stop) if start < stop else None


def coverage(ranges, total: int):
    """Gaps and overlaps of half-open ranges over [0, total).

    Returns (gaps, overlaps, outside), each a list of (start, stop): elements covered by no
    range, elements covered more than once, and ranges reaching outside [0, total).
    A sort and one sweep: O(k log k) in the number of ranges.
    """
    gaps, overlaps, outside = [], [], []
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


def total_length(ranges) -> int:
    return sum(stop - start for start, stop in ranges)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
