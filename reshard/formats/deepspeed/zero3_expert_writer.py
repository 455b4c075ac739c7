"""ZeRO-3 files of an AutoEP mixture of experts at the target's ep and dp (zero3_experts.py reads them).

Every data-parallel rank d holds the dense params whole and its expert-parallel rank's local experts (a box of each
packed (num_experts, ...) weight: expert_writer). As DeepSpeed 0.19.8's ZeRO-3 optimizer does, each param group is
split by the process group its params are partitioned over (stage3 `_get_trainable_parameter_groups`: the world for
dense params, the expert-data-parallel group for experts), then into sub-groups of `sub_group_size` elements
(`_create_fp16_sub_groups`); each param is cut on its own over its group's count (ceil(n / count) elements each,
the last padded) and rank d's file holds part `place` of each: its rank for a dense sub-group, its expert-data-parallel
rank for an expert one. `ds_zero_partition_groups` records each sub-group's count, place and global ranks (the loader
compares it with the live engine's and refuses any other). Rank d's model states hold the module's placeholders
(without the packed expert weights: `_get_non_moe_state_dict`), param_shapes of its sub-groups, and ds_autoep_layers
as rank d sees them (its ep rank, expert-data-parallel rank and global expert range), marked zero3_partitioned.
No layer_L_expert_E file is written.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from reshard.core.catalog import MASTER
from reshard.core.geometry import ceil_div
from reshard.formats.deepspeed import experts as expert_files, files as names, notes, standins, zero3_experts
from reshard.formats.deepspeed.rank_params import RankParams
from reshard.formats.deepspeed.zero3_writer import part_pieces
from reshard.formats.deepspeed.zero_target import ZeroTarget, buffer_names, module_tree, state_dict_entry
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder


@dataclass(frozen=True)
class SubGroup:
    """One ZeRO-3 sub-group of a rank: its param group, params, and the ranks it is partitioned over."""
    g: int                  # the optimizer param group
    members: tuple          # its params' names, in order
    expert: bool            # the rank's local experts (cut over the expert-data-parallel group), else dense
    count: int              # the ranks it is partitioned over
    place: int              # this rank's part among them
    ranks: tuple            # their global ranks
    group_name: str         # ds_zero_partition_groups' group name: "replicated" or the expert group's


def sub_groups(zt, params: RankParams, rank: int, is_expert) -> list:
    """Rank's sub-groups, in DeepSpeed's order: per param group, per partition group (first seen first), cut by
    sub_group_size over the params' partition sizes."""
    ep_rank, edp_rank = expert_files.expert_ranks(rank, zt.ep, zt.expert_dp, zt.data_first)
    if zt.data_first:
        edp_ranks = [ep_rank * zt.expert_dp + j for j in range(zt.expert_dp)]
    else:
        edp_ranks = [ep_rank + zt.ep * j for j in range(zt.expert_dp)]
    out = []
    for g, group in enumerate(params.groups):
        split: dict[bool, list] = {}
        for name in group:
            split.setdefault(bool(is_expert(name)), []).append(name)
        for expert, members in split.items():
            count, place = (zt.expert_dp, edp_rank) if expert else (zt.dp, rank)
            ranks = edp_ranks if expert else list(range(zt.dp))
            group_name = f"ep_size_{zt.ep}" if expert else zero3_experts.DENSE_FAMILY
            parts = [ceil_div(params.by_name[n].numel, count) for n in members]
            if zt.sub_group_size >= sum(parts):
                out.append(SubGroup(g, tuple(members), expert, count, place, tuple(ranks), group_name))
                continue
            current: list[str] = []
            size = 0
            for name, part in zip(members, parts, strict=True):
                current.append(name)
                size += part
                if size >= zt.sub_group_size or name == members[-1]:
                    out.append(SubGroup(g, tuple(current), expert, count, place, tuple(ranks), group_name))
                    current, size = [], 0
    return out


def model_states(zt: ZeroTarget, params: RankParams, rank: int, groups: list, tag: str, extra: dict) -> TorchFile:
    name = names.model_states_name(params.mp_rank, rank)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])

    def partitioned(p):     # ZeRO-3 params are partitioned: the module holds empty placeholders
        if p.kind != "buffer":
            return file.slot(zt.lp_dtype, (0,), [])
        return file.slot(p.module_dtype, p.shape, [p.piece("module", 0, p.numel)])

    module, _ = module_tree(params, partitioned)
    # a ZeRO-1/2 source's router alias is a module tensor of no param of its own (unregistered): a placeholder here
    unregistered = set(notes.of(zt.catalog).unregistered)
    frozen = [p for p in params.of_kind("frozen") if p.name not in unregistered]
    frozen_fragments = OrderedDict()
    for p in frozen:
        frozen_fragments[p.name] = file.slot(p.module_dtype, (ceil_div(p.numel, zt.dp),),
                                             part_pieces(p, "module", zt.dp, rank))
    return file.build({
        "module": module,
        "buffer_names": buffer_names(params),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, zt.saved_shape(params.by_name[n].shape)) for n in sg.members)
                         for sg in groups],
        "frozen_param_shapes": OrderedDict((p.name, zt.saved_shape(p.shape)) for p in frozen),
        "shared_params": extra.get("shared_params", dict(params.aliases)) if rank == 0 else {},
        "frozen_param_fragments": frozen_fragments,
        **zt.model_states_tail(extra),
    })


def optim_states(zt: ZeroTarget, params: RankParams, rank: int, groups: list, tag: str) -> TorchFile:
    name = names.optim_states_name(rank, params.mp_rank, zt.bf16_prefix)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])
    states, flat_groups, partition_groups = {}, [], []
    group_members: list[list[int]] = [[] for _ in params.groups]
    for i, sg in enumerate(groups):
        length = sum(ceil_div(params.by_name[n].numel, sg.count) for n in sg.members)
        pieces = {s: [p for n in sg.members for p in part_pieces(params.by_name[n], s, sg.count, sg.place)]
                  for s in [MASTER, *zt.states]}
        states[i] = state_dict_entry(zt, file, sg.g, {s: (length, pieces[s]) for s in zt.states})
        flat_groups.append(file.slot("float32", (length,), pieces[MASTER]))
        group_members[sg.g].append(i)
        family = zero3_experts.EXPERT_FAMILY if sg.expert else zero3_experts.DENSE_FAMILY
        partition_groups.append({"sub_group": i, "partition_count": sg.count, "partition_rank": sg.place,
                                 "partition_ranks": list(sg.ranks), "families": [family],
                                 "group_names": [sg.group_name]})
    param_groups = [{**zt.hyper_params(g), "params": members} for g, members in enumerate(group_members)]
    scaler = zt.loss_scaler_state()
    inner = {"zero_stage": standins.ZeroStageEnum.weights, "loss_scaler": scaler["loss_scaler"],
             "dynamic_loss_scale": scaler["dynamic_loss_scale"], "overflow": scaler["overflow"],
             "partition_count": zt.dp, zero3_experts.PARTITION_GROUPS: partition_groups,
             "optimizer_state_dict": {"state": states, "param_groups": param_groups},
             "fp32_flat_groups": flat_groups}
    return file.build({"optimizer_state_dict": inner, "ds_config": zt.config, "ds_version": zt.ds_version})
