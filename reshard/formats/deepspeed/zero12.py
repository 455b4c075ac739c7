"""ZeRO-1/2 (and BF16_Optimizer) optimizer partitions as fragments.

Per optimizer param group, DeepSpeed flattens the trainable params in `param_shapes` order
(round-robin order when `round_robin_gradients` is on; `param_shapes` records it), with optional
per-param alignment padding, pads the end to a multiple of 2*dp, and gives rank r the slice
[r*P, (r+1)*P) of that flat vector. The fp32 master partition is saved with its share of the tail
padding stripped (BF16_Optimizer keeps it); optimizer moments keep it (elastic files strip it).
A param's elements in rank r's file are the overlap of the param's range with the rank's range.
An expert param group (experts.py) is flattened per expert-parallel rank from that rank's local experts and cut
over the expert-data-parallel group instead: rank r's file holds its slice of its expert-parallel rank's flat
vector, and each local param is a shard (a box) of its logical tensor.
"""
from __future__ import annotations

import math

from reshard.core.catalog import MASTER, Fragment, TensorDraft
from reshard.core.geometry import intersect
from reshard.formats.deepspeed import group_scalars, topology
from reshard.formats.torchsave_read import TensorRef

FP32_PARTITIONS = "single_partition_of_fp32_groups"


def read_partitions(catalog, model0, optim, experts=None) -> None:
    dp = catalog.layout.dp
    present = {r: (path, sd) for r, (path, sd) in optim.items() if sd is not None}
    if not present:
        return
    first_path, first = present[min(present)]
    bf16_optimizer = "zero_stage" not in first
    elastic = isinstance(first.get("base_optimizer_state"), list)
    alignment = first.get("param_alignment_paddings")
    votes = group_scalars.Votes(catalog)
    for g, shapes in enumerate(model0.get("param_shapes") or []):
        expert_group = experts is not None and g in experts.groups
        count = experts.topology.expert_dp if expert_group else dp     # the ranks the group is partitioned over
        ranges, end = _param_ranges(shapes, alignment[g] if alignment else None)
        padded = _padded_length(end, count)
        part = padded // count
        order = list(experts.group_params(shapes)) if expert_group else \
            _optimizer_order(present, g, list(shapes), catalog.layout)
        catalog.param_groups.append(_hyper_params(first, g, elastic, order))
        catalog.group_scalars.append({})
        for rank, (path, sd) in sorted(present.items()):
            if expert_group:
                ep_rank, index = experts.ranks(rank)
                local = {name: experts.logical(ep_rank, name) for name in ranges}
            else:
                index, local = rank, {}
            _read_rank_group(catalog, path, sd, (rank, index), g, ranges, end, part, count, bf16_optimizer, elastic,
                             local, votes)
    votes.settle()


def _param_ranges(shapes, alignment):
    """name -> (start, numel) in the flat group; and the end of the last param."""
    ranges, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        ranges[name] = (offset, n)
        offset += n + (alignment[i] if alignment else 0)
    return ranges, offset


def _padded_length(n: int, dp: int) -> int:
    align = 2 * dp          # DeepSpeed's nccl_start_alignment_factor (2) times dp
    return -(-n // align) * align


def _optimizer_order(present, g, flat_order, layout):
    """The group's params in the optimizer's order.

    It is the flat order unless round_robin_gradients permuted the flat buffer; then
    param_slice_mappings, built in the original order, give it back: each rank lists the params
    of a contiguous run of that order, so the ranks' lists chained together and deduplicated are
    the whole order.
    """
    if not topology.of(layout).round_robin_gradients:
        return flat_order
    order: list[str] = []
    for _rank, (_path, sd) in sorted(present.items()):
        mappings = sd.get("param_slice_mappings") or []
        if g < len(mappings):
            order.extend(name for name in mappings[g] if name not in order)
    return order if sorted(order) == sorted(flat_order) else flat_order


def _group_state(sd, g, elastic) -> dict:
    base = sd.get("base_optimizer_state")
    if elastic:
        return base[g] if g < len(base) else {}
    state = (base or {}).get("state", {})
    return state.get(g, state.get(str(g), {}))


def _hyper_params(sd, g, elastic, names) -> dict:
    groups = [] if elastic else (sd.get("base_optimizer_state") or {}).get("param_groups", [])
    hyper = {k: v for k, v in groups[g].items() if k != "params"} if g < len(groups) else {}
    return {**hyper, "params": names}


def _read_rank_group(catalog, path, sd, ranks, g, ranges, end, part, dp, bf16_optimizer, elastic, local, votes):
    """`ranks`: (the file's data-parallel rank, its place among the `dp` ranks the group is cut over); `local`:
    name -> experts.LocalExpert for an expert group's params (shards of the logical tensors), else empty;
    `votes`: group_scalars.Votes, where the file's group scalars go."""
    rank, index = ranks
    rank_start = index * part
    tail_padding = max(0, min(rank_start + part, part * dp) - max(rank_start, end))
    paddings = sd.get("group_paddings") or []
    if g < len(paddings) and paddings[g] != tail_padding:
        catalog.problem(path, f"group {g}: group_paddings says {paddings[g]} padding elements, "
                        f"the param shapes imply {tail_padding}")
    counts = sd.get("partition_count") or []
    if g < len(counts) and counts[g] != dp:
        catalog.problem(path, f"group {g}: partition_count {counts[g]} but the group is cut over {dp} ranks")

    fp32_parts = sd.get(FP32_PARTITIONS) or []
    if g >= len(fp32_parts):
        catalog.problem(path, f"group {g}: no fp32 master partition")
        return
    lean = part - tail_padding
    sources = {MASTER: (fp32_parts[g], part if bf16_optimizer else lean)}
    for key, value in _group_state(sd, g, elastic).items():
        if isinstance(value, TensorRef) and len(value.shape) >= 1:
            sources[key] = (value, lean if elastic else part)
        else:
            votes.add(path, g, key, value)

    for state, (ref, expected) in sources.items():
        if ref.numel != expected:
            catalog.problem(path, f"group {g}: {state} partition has {ref.numel} elements, expected {expected} "
                            f"(dp={dp}, partition size {part})")
        usable = min(ref.numel, expected)
        for name, (start, numel) in ranges.items():
            overlap = intersect(start, start + numel, rank_start, rank_start + usable)
            logical, shard = (local[name].name, local[name].shard) if name in local else (name, None)
            tensor = catalog.add(TensorDraft(logical, state, catalog.params[logical].shape, ref.dtype),
                                 ref.storage.file)
            if overlap:
                a, b = overlap
                tensor.fragments.append(Fragment(a - start, b - start, ref.storage,
                                                 ref.storage_offset + a - rank_start, rank, shard))
