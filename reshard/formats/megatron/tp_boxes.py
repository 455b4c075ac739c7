"""The boxes of a parameter each tensor-parallel rank of a Megatron model holds, at any tp: what a torch_dist save
writes as that rank's chunks, and where each element of the rank's local tensor lies in the global one (the
distributed optimizer's buffers hold the local tensors)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from reshard.core.placement import Block, Shard
from reshard.errors import ReshardError
from reshard.formats.megatron.order import TpCut


def rank_boxes(name: str, shape: Sequence[int], cut: TpCut | None, parts: int, tp: int,
               rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """[(at, size)] of the global tensor (`shape`) that tensor-parallel rank `rank` of `tp` holds, in the order its
    local tensor stacks them: piece `rank` of each of the `parts` blocks along the cut axis; the whole tensor
    when `cut` is None (a norm: every rank holds it). A ReshardError where the axis does not divide evenly."""
    dims = tuple(int(d) for d in shape)
    if cut is None:
        return [((0,) * len(dims), dims)]
    length = dims[cut.axis]
    if length % (parts * tp):
        raise ReshardError(f"{name}: {length} along axis {cut.axis} does not split into {parts} part(s) of tp={tp} "
                           "equal pieces")
    block = length // parts
    piece = block // tp
    out = []
    for part in range(parts):
        at = tuple(part * block + rank * piece if d == cut.axis else 0 for d in range(len(dims)))
        size = tuple(piece if d == cut.axis else n for d, n in enumerate(dims))
        out.append((at, size))
    return out


def local_shard(boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], cut: TpCut | None) -> Shard:
    """The rank's local tensor as a Shard of the global one: its boxes stacked along the cut axis."""
    if cut is None or len(boxes) == 1:
        at, size = boxes[0]
        return Shard(tuple(size), (Block(tuple(at), (0,) * len(size), tuple(size)),))
    blocks, local = [], 0
    for at, size in boxes:
        blocks.append(Block(tuple(at), tuple(local if d == cut.axis else 0 for d in range(len(size))), tuple(size)))
        local += size[cut.axis]
    first = boxes[0][1]
    return Shard(tuple(local if d == cut.axis else n for d, n in enumerate(first)), tuple(blocks))


def numel(shard: Shard) -> int:
    return math.prod(shard.shape)
