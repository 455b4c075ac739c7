"""ZeRO-3 optimizer partitions and frozen fragments as fragments.

Every parameter is cut on its own: part = ceil(n/dp), rank r holds elements [r*part, (r+1)*part)
(the last rank(s) padded). A rank's flat fp32 vector is its parts concatenated in `param_shapes`
order, split into sub-groups (`sub_group_size`); a part may straddle two sub-groups. Optimizer
states follow the same sub-group tensors. Frozen params are cut the same way, one fragment per
rank's model-states file.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from reshard.core.catalog import MASTER, MODULE, Fragment, TensorDraft
from reshard.core.geometry import ceil_div, intersect
from reshard.formats.deepspeed import files as names, group_scalars
from reshard.formats.torchsave_read import TensorRef

FP32_FLAT_GROUPS = "fp32_flat_groups"


def read_partitions(catalog, model0, models, optim) -> None:
    dp = catalog.layout.dp
    entries = [(name, tuple(shape)) for group in (model0.get("param_shapes") or []) for name, shape in group.items()]
    parts, offset = [], 0
    for name, shape in entries:
        n = math.prod(shape)
        part = ceil_div(n, dp)
        parts.append((name, n, part, offset))
        offset += part
    rank_total = offset

    present = {r: (path, sd) for r, (path, sd) in optim.items() if sd is not None}
    if not present:
        return
    first_path, first = present[min(present)]
    sub_group_of = _assign_groups(catalog, first, parts)
    reference_lengths = [ref.numel for ref in first.get(FP32_FLAT_GROUPS) or []]
    votes = group_scalars.Votes(catalog)

    for rank, (path, sd) in sorted(present.items()):
        if sd.get("partition_count") not in (None, dp):
            catalog.problem(path, f"partition_count {sd.get('partition_count')} but the checkpoint's dp is {dp}")
        flat = sd.get(FP32_FLAT_GROUPS) or []
        lengths = [ref.numel for ref in flat]
        if sum(lengths) != rank_total:
            catalog.problem(path, f"fp32 partition has {sum(lengths)} elements, expected {rank_total} "
                            f"(sum of ceil(numel/{dp}) over the params)")
        elif lengths != reference_lengths:
            catalog.problem(path, f"sub-group sizes {lengths} differ from {os.path.basename(first_path)}'s "
                            f"{reference_lengths}")
        inner = sd.get("optimizer_state_dict") or {}
        states = inner.get("state", {})
        sub_start = 0
        for i, fp32 in enumerate(flat):
            sources = {MASTER: fp32}
            for key, value in states.get(i, states.get(str(i), {})).items():
                if isinstance(value, TensorRef) and len(value.shape) >= 1:
                    sources[key] = value
                    if value.numel != fp32.numel:
                        catalog.problem(path, f"sub-group {i}: {key} has {value.numel} elements, "
                                        f"expected {fp32.numel}")
                else:
                    votes.add(path, sub_group_of.get(i, 0), key, value)
            _add_fragments(catalog, sources, parts, rank, sub_start, fp32.numel)
            sub_start += fp32.numel
    votes.settle()


def _add_fragments(catalog, sources, parts, rank, sub_start, sub_len):
    for name, n, part, offset in parts:
        held = max(0, min(part, n - rank * part))      # real (unpadded) elements of this rank's part
        overlap = intersect(offset, offset + held, sub_start, sub_start + sub_len)
        for state, ref in sources.items():
            tensor = catalog.add(TensorDraft(name, state, catalog.params[name].shape, ref.dtype), ref.storage.file)
            if overlap and ref.numel >= overlap[1] - sub_start:
                a, b = overlap
                first = rank * part + a - offset
                tensor.fragments.append(Fragment(first, first + b - a, ref.storage,
                                                 ref.storage_offset + a - sub_start, rank))


def _assign_groups(catalog, sd, parts) -> dict:
    """Sub-group index -> param group, from the torch optimizer's param_groups; sets each param's group."""
    inner = sd.get("optimizer_state_dict") or {}
    groups = inner.get("param_groups") or []
    sub_group_of = {}
    for g, group in enumerate(groups):
        for i in group.get("params", []):
            sub_group_of[i] = g
    lengths = [ref.numel for ref in sd.get(FP32_FLAT_GROUPS) or []]
    members: list[list[str]] = [[] for _ in groups]
    sub, sub_end = 0, lengths[0] if lengths else 0
    for name, _n, _part, offset in parts:
        while sub + 1 < len(lengths) and offset >= sub_end:
            sub += 1
            sub_end += lengths[sub]
        g = sub_group_of.get(sub, 0)
        catalog.params[name] = replace(catalog.params[name], group=g)
        if g < len(members):
            members[g].append(name)
    for g, group in enumerate(groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        catalog.param_groups.append({**hyper, "params": members[g]})
        catalog.group_scalars.append({})
    return sub_group_of


def read_frozen(catalog, models) -> None:
    """Frozen params: each rank's model-states file holds its padded ceil(n/dp) slice."""
    dp = catalog.layout.dp
    frozen = [p for p in catalog.params.values() if p.kind == "frozen"]
    for rank, sd in sorted(models.items()):
        if sd is None:
            continue
        path = os.path.join(catalog.root, names.model_states_name(0, rank))
        fragments = sd.get("frozen_param_fragments") or {}
        for p in frozen:
            n = math.prod(p.shape)
            part = ceil_div(n, dp)
            ref = fragments.get(p.name)
            if not isinstance(ref, TensorRef):
                catalog.problem(path, f"frozen parameter {p.name} has no fragment")
                continue
            tensor = catalog.add(TensorDraft(p.name, MODULE, p.shape, ref.dtype), ref.storage.file)
            start, stop = rank * part, min(n, (rank + 1) * part)
            if ref.numel < stop - start:
                catalog.problem(path, f"frozen parameter {p.name}: fragment has {ref.numel} elements, "
                                f"expected {part}")
                continue
            if stop > start:
                tensor.fragments.append(Fragment(start, stop, ref.storage, ref.storage_offset, rank))


