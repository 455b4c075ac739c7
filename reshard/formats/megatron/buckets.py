"""Where Megatron's distributed optimizer lays each parameter in its flat buffers, recomputed.

A `dp_reshardable` save stores the distributed optimizer's state as it holds it: per grad buffer and bucket one flat
fp32 tensor per state (param, exp_avg, exp_avg_sq), but not where each parameter lies in it. That follows from how
megatron-core (distributed/param_and_grad_buffer.py, 0.16) fills a buffer, which is recomputed here:

* the parameters that need a gradient, in the order the model registers them, are laid in REVERSE order (roughly
  the order backprop produces their gradients);
* with the distributed optimizer each parameter starts at a multiple of 64 elements;
* a bucket closes once it holds at least `bucket_size` elements (no limit without overlapped grad reduction), and a
  parameter shared between the first and last pipeline stage (a tied embedding) gets a bucket of its own;
* each bucket's end is padded to a multiple of lcm(dp, 128) (lcm(dp, 128, 2^16) with pad_buckets_for_high_nccl_busbw),
  and the next bucket starts there;
* `numel_unpadded` of a bucket runs from its start to the end of its last parameter (to the 64-aligned start of the
  next one where a shared parameter closed it early).

The saved tensor of a bucket is its unpadded length; data-parallel rank r holds the elements
[r·numel/dp, (r+1)·numel/dp) of it, each parameter's part (and each gap between parameters) a chunk of its own.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PARAM_ALIGNMENT = 64       # elements: 128 bytes of a 16-bit parameter
BUCKET_ALIGNMENT = 128     # elements; with the data-parallel degree
HIGH_BUSBW_ALIGNMENT = 2 ** 16


@dataclass(frozen=True)
class Placed:
    """A parameter's elements in its bucket: [start, stop), counted from the bucket's first element."""
    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class Bucket:
    params: tuple[Placed, ...]     # in the order laid (reverse registration order)
    numel: int                     # padded: a multiple of the data-parallel degree
    numel_unpadded: int

    def rank_range(self, dp: int, rank: int) -> tuple[int, int]:
        """The elements [start, stop) of the bucket that data-parallel rank `rank` holds."""
        share = self.numel // dp
        return rank * share, (rank + 1) * share

    def chunks(self, dp: int) -> list[tuple[int, int, str | None]]:
        """Every chunk the bucket's saved tensor is cut into: (start, size, parameter name or None for a gap), in
        order: each parameter's part held by each rank, and the gaps between them, up to numel_unpadded."""
        out: list[tuple[int, int, str | None]] = []
        for rank in range(dp):
            low, high = self.rank_range(dp, rank)
            high = min(high, self.numel_unpadded)
            at = low
            for param in self.params:
                start, stop = max(param.start, low), min(param.stop, high)
                if start >= stop:
                    continue
                if start > at:
                    out.append((at, start - at, None))
                out.append((start, stop - start, param.name))
                at = stop
            if at < high:
                out.append((at, high - at, None))
        return out


def bucket_size(args: Mapping[str, object], pp_rank: int, dp: int) -> int | None:
    """The bucket size of pipeline stage `pp_rank`'s grad buffer at data-parallel degree `dp`, from Megatron-LM's
    `args`: buckets only with overlapped grad reduction, and only on the first stage (megatron-core's DDP);
    `ddp_bucket_size` or max(40M, 1M·dp) elements."""
    if args.get("overlap_grad_reduce") and pp_rank == 0:
        given = args.get("ddp_bucket_size")
        return given if isinstance(given, int) and given > 0 else max(40_000_000, 1_000_000 * dp)
    return None


def _up(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def lay_out(params: Sequence[tuple[str, int]], dp: int, bucket_size: int | None = None,
            own_bucket: frozenset[str] = frozenset(), high_busbw: bool = False) -> list[Bucket]:
    """The buckets of one grad buffer holding `params` ((name, elements) in registration order) with the distributed
    optimizer at data-parallel degree `dp`. `own_bucket`: the names that get a bucket of their own (shared
    embeddings)."""
    divisor = math.lcm(dp, BUCKET_ALIGNMENT, HIGH_BUSBW_ALIGNMENT) if high_busbw else math.lcm(dp, BUCKET_ALIGNMENT)
    buckets: list[Bucket] = []
    bucket_start = position = 0
    held: list[Placed] = []

    def close(end: int) -> int:
        nonlocal bucket_start, held
        padded = _up(end, divisor)
        buckets.append(Bucket(tuple(held), padded - bucket_start, end - bucket_start))
        bucket_start, held = padded, []
        return padded

    for name, numel in reversed(params):
        position = _up(position, PARAM_ALIGNMENT)
        alone = name in own_bucket
        if alone and held:
            position = close(position)
        stop = position + numel
        held.append(Placed(name, position - bucket_start, stop - bucket_start))
        if alone or (bucket_size is not None and stop - bucket_start >= bucket_size):
            position = close(stop)
        else:
            position = stop
    if held:
        close(position)
    return buckets
