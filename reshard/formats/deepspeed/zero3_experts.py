"""AutoEP under ZeRO-3 (DeepSpeed 0.19.8): the experts partition-native, inside the ZeRO-3 files, as fragments.

The engine (`_save_moe_checkpoint` with `zero_optimization_partition_weights`) writes no `layer_L_expert_E` file:
every rank d writes `zero_pp_rank_d_mp_rank_00_model_states.pt` (the module's placeholders, `param_shapes` of its
optimizer's sub-groups, and `ds_autoep_layers` entries marked `checkpoint_format: zero3_partitioned`, version 1,
naming that rank's expert-parallel rank, expert-data-parallel rank and global expert range) and its ZeRO-3 optimizer
file. The optimizer splits each param group by the process group its params are partitioned over (stage3
`_get_trainable_parameter_groups`): a dense sub-group cut over dp, and an expert sub-group of the rank's local packed
`experts.w1/w2/w3` (shape (local experts, ...)) cut over the expert-data-parallel group (dp / ep ranks). Each param
of a sub-group is cut on its own, ceil(n / count) elements per rank, the last padded, and the rank's parts are
concatenated; `ds_zero_partition_groups` records each sub-group's partition count, the rank's place and the global
ranks of the group. Module weights are not saved apart from the fp32 masters (the engine restores them from them).
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from reshard.core.catalog import MASTER, Fragment, TensorDraft
from reshard.core.geometry import ceil_div
from reshard.errors import ReshardError
from reshard.formats.deepspeed import experts as expert_placement, files as names, group_scalars
from reshard.formats.torchsave_read import TensorRef

FP32_FLAT_GROUPS = "fp32_flat_groups"
PARTITION_GROUPS = "ds_zero_partition_groups"     # stage3._zero3_partition_group_metadata, per sub-group
FORMAT_KEY, FORMAT = "checkpoint_format", "zero3_partitioned"
FORMAT_VERSION_KEY, FORMAT_VERSION = "checkpoint_format_version", 1
EXPERT_FAMILY, DENSE_FAMILY = "autoep_expert", "replicated"


def is_partitioned(model0: dict) -> bool:
    """An AutoEP save whose experts are in the ZeRO-3 files (its ds_autoep_layers entries say so)."""
    return any(isinstance(e, dict) and e.get(FORMAT_KEY) == FORMAT
               for e in model0.get(expert_placement.AUTOEP_LAYERS) or ())


def read(tag_dir: str, listing: list, model0: dict) -> expert_placement.Experts:
    """The expert placement: the sub-groups of expert params are those holding the params ds_autoep_layers' affine
    maps name (all of a sub-group's params, or none)."""
    layers = model0[expert_placement.AUTOEP_LAYERS]
    for entry in layers:
        version = entry.get(FORMAT_VERSION_KEY)
        if entry.get(FORMAT_KEY) != FORMAT or version != FORMAT_VERSION:
            raise ReshardError.at(tag_dir, f"MoE layer {entry.get('moe_layer_id')}: expert state format "
                                           f"{entry.get(FORMAT_KEY)!r} version {version!r}; only "
                                           f"{FORMAT!r} version {FORMAT_VERSION} (DeepSpeed 0.19.8) is read")
    expert_names = {name for entry in layers for name in ((entry.get("affine_maps") or {}).get("params") or {})}
    param_shapes = model0.get("param_shapes") or []
    groups = set()
    for i, shapes in enumerate(param_shapes):
        held = set(shapes) & expert_names
        if held and held != set(shapes):
            raise ReshardError.at(tag_dir, f"ZeRO-3 sub-group {i} mixes expert params ({sorted(held)[0]}) with "
                                           "others")
        if held:
            groups.add(i)
    if not groups:
        raise ReshardError.at(tag_dir, "ds_autoep_layers names expert params that are in no ZeRO-3 sub-group "
                                       "(param_shapes)")
    return expert_placement.from_autoep(tag_dir, model0, param_shapes, frozenset(groups), layer_files=False)


def check_ranks(catalog, models: dict, experts: expert_placement.Experts) -> None:
    """Each rank's model states name its expert-parallel and expert-data-parallel ranks: they must be those
    DeepSpeed's process groups give data-parallel rank d (experts.expert_ranks)."""
    for rank, sd in sorted(models.items()):
        if sd is None:
            continue
        path = os.path.join(catalog.root, names.model_states_name(0, rank))
        expected = experts.ranks(rank)
        for entry in sd.get(expert_placement.AUTOEP_LAYERS) or ():
            saved = (entry.get("ep_rank"), entry.get("expert_data_parallel_rank"))
            if saved != expected:
                catalog.problem(path, f"MoE layer {entry.get('moe_layer_id')}: ep rank, expert-data-parallel rank "
                                      f"{saved}, expected {expected} for data-parallel rank {rank}")
                break


def read_partitions(catalog, model0: dict, optim: dict, experts: expert_placement.Experts) -> None:
    """The fp32 masters and optimizer states of every sub-group of every rank's optimizer file, as fragments: a
    dense param's part is a flat range of it; an expert param's part a flat range of its rank's box of the
    (num_experts, ...) logical tensor."""
    dp = catalog.layout.dp
    edp = experts.topology.expert_dp
    param_shapes = model0.get("param_shapes") or []
    present = {r: (path, sd) for r, (path, sd) in optim.items() if sd is not None}
    if not present:
        return
    sub_group_of = _assign_groups(catalog, present[min(present)][1], param_shapes, experts)
    votes = group_scalars.Votes(catalog)
    for rank, (path, sd) in sorted(present.items()):
        ep_rank, edp_rank = experts.ranks(rank)
        flat = sd.get(FP32_FLAT_GROUPS) or []
        saved_groups = sd.get(PARTITION_GROUPS) or []
        states = (sd.get("optimizer_state_dict") or {}).get("state", {})
        if sd.get("partition_count") not in (None, dp):
            catalog.problem(path, f"partition_count {sd.get('partition_count')} but the checkpoint's dp is {dp}")
        if len(flat) != len(param_shapes):
            catalog.problem(path, f"{len(flat)} fp32 sub-groups, param_shapes lists {len(param_shapes)}")
        for i, (fp32, shapes) in enumerate(zip(flat, param_shapes, strict=False)):
            expert = i in experts.groups
            count, place = (edp, edp_rank) if expert else (dp, rank)
            _check_saved_group(catalog, path, saved_groups, i, count, place)
            parts = [(name, math.prod(shape), ceil_div(math.prod(shape), count)) for name, shape in shapes.items()]
            length = sum(part for _, _, part in parts)
            sources = {MASTER: fp32}
            for key, value in states.get(i, states.get(str(i), {})).items():
                if isinstance(value, TensorRef) and len(value.shape) >= 1:
                    sources[key] = value
                else:
                    votes.add(path, sub_group_of.get(i, 0), key, value)
            for state, ref in sources.items():
                if ref.numel != length:
                    catalog.problem(path, f"sub-group {i}: {state} has {ref.numel} elements, expected {length} "
                                          f"(sum of ceil(numel/{count}) over its params)")
                    continue
                offset = 0
                for name, n, part in parts:
                    local = experts.logical(ep_rank, name) if expert else None
                    logical, shard = (local.name, local.shard) if local else (name, None)
                    tensor = catalog.add(TensorDraft(logical, state, catalog.params[logical].shape, ref.dtype),
                                         ref.storage.file)
                    held = max(0, min(part, n - place * part))
                    if held:
                        tensor.fragments.append(Fragment(place * part, place * part + held, ref.storage,
                                                         ref.storage_offset + offset, rank, shard))
                    offset += part
    votes.settle()


def _check_saved_group(catalog, path, saved_groups, i, count, place) -> None:
    """The sub-group's partition count and this file's place in it, as ds_zero_partition_groups records them."""
    saved = saved_groups[i] if i < len(saved_groups) and isinstance(saved_groups[i], dict) else None
    if saved is None:
        catalog.problem(path, f"sub-group {i}: no {PARTITION_GROUPS} entry")
    elif (saved.get("partition_count"), saved.get("partition_rank")) != (count, place):
        catalog.problem(path, f"sub-group {i}: partition count and rank ({saved.get('partition_count')}, "
                              f"{saved.get('partition_rank')}), expected ({count}, {place})")


def _assign_groups(catalog, sd, param_shapes, experts) -> dict:
    """Sub-group -> param group (the torch optimizer's param_groups list the sub-groups they hold); each param's
    group and each group's hyper-parameters and members (logical names) into the catalog."""
    groups = (sd.get("optimizer_state_dict") or {}).get("param_groups") or []
    sub_group_of = {i: g for g, group in enumerate(groups) for i in group.get("params", [])}
    members: list[list[str]] = [[] for _ in groups]
    for i, shapes in enumerate(param_shapes):
        g = sub_group_of.get(i, 0)
        names = list(experts.group_params(shapes)) if i in experts.groups else list(shapes)
        for name in names:
            catalog.params[name] = replace(catalog.params[name], group=g)
            if g < len(members) and name not in members[g]:
                members[g].append(name)
    for g, group in enumerate(groups):
        catalog.param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members[g]})
        catalog.group_scalars.append({})
    return sub_group_of
