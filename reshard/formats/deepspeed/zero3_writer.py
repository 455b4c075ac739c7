"""ZeRO-3 files of one model-parallel rank at the target dp (zero3.py reads them).

ZeRO-3 cuts every param into ceil(n/dp) parts and groups a rank's parts into sub-groups of
`sub_group_size` elements; the module holds empty placeholders, frozen params their own parts.
"""
from __future__ import annotations

from collections import OrderedDict

from reshard.core.catalog import MASTER, MODULE
from reshard.core.geometry import ceil_div
from reshard.core.write_requests import Piece
from reshard.formats.deepspeed import files as names, standins
from reshard.formats.deepspeed.rank_params import RankParam, RankParams
from reshard.formats.deepspeed.zero_target import ZeroTarget, buffer_names, module_tree, state_dict_entry
from reshard.formats.torchsave_read import Size
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder


def sub_groups(zt: ZeroTarget, params: RankParams) -> list:
    """[(param group, [names])] as DeepSpeed's _create_fp16_sub_groups forms them for the target dp."""
    out = []
    for g, group in enumerate(params.groups):
        members = list(group)
        parts = [ceil_div(params.by_name[n].numel, zt.dp) for n in members]
        if zt.sub_group_size >= sum(parts):
            out.append((g, members))
            continue
        current, size = [], 0
        for name, part in zip(members, parts, strict=True):
            current.append(name)
            size += part
            if size >= zt.sub_group_size or name == members[-1]:
                out.append((g, current))
                current, size = [], 0
    return out


def part_pieces(param: RankParam, state: str, count: int, place: int) -> list:
    """Part `place` of one param cut into `count` parts of ceil(n/count) elements (a rank's of dp, or of its ZeRO-3
    sub-group): its real elements, then padding zeros."""
    n = param.numel
    part = ceil_div(n, count)
    held = max(0, min(part, n - place * part))
    pieces = [param.piece(state, place * part, held)] if held else []
    if part > held:
        pieces.append(Piece.zeros(part - held))
    return pieces


def model_states(zt: ZeroTarget, params: RankParams, rank: int, groups: list, tag: str, extra: dict) -> TorchFile:
    name = names.model_states_name(params.mp_rank, rank)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])

    def partitioned(p):     # ZeRO-3 params are partitioned: the module holds empty placeholders
        if p.kind != "buffer":
            return file.slot(zt.lp_dtype, (0,), [])
        return file.slot(p.module_dtype, p.shape, [p.piece(MODULE, 0, p.numel)])

    module, _ = module_tree(params, partitioned)
    frozen = params.of_kind("frozen")
    frozen_fragments = OrderedDict()
    for p in frozen:
        frozen_fragments[p.name] = file.slot(p.module_dtype, (ceil_div(p.numel, zt.dp),),
                                             part_pieces(p, MODULE, zt.dp, rank))

    def shape(n):
        return Size(params.by_name[n].shape)
    return file.build({
        "module": module,
        "buffer_names": buffer_names(params),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, shape(n)) for n in members) for _, members in groups],
        "frozen_param_shapes": OrderedDict((p.name, Size(p.shape)) for p in frozen),
        "shared_params": dict(params.aliases) if rank == 0 else {},
        "frozen_param_fragments": frozen_fragments,
        **zt.model_states_tail(extra),
    })


def optim_states(zt: ZeroTarget, params: RankParams, rank: int, groups: list, tag: str) -> TorchFile:
    """A rank's fp32 partitions and its optimizer's state; a weights-only target's without the torch optimizer's
    state dict (the moments, the param groups), as zero_to_fp32, which DeepSpeed's ZeRO-3 module-only load calls,
    drops it before reading the partitions."""
    name = names.optim_states_name(rank, params.mp_rank, zt.bf16_prefix)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])
    states, flat_groups = {}, []
    group_members: list[list[int]] = [[] for _ in params.groups]
    for i, (g, members) in enumerate(groups):
        length = sum(ceil_div(params.by_name[n].numel, zt.dp) for n in members)
        pieces = {s: [p for n in members for p in part_pieces(params.by_name[n], s, zt.dp, rank)]
                  for s in [MASTER, *zt.states]}
        if not zt.weights_only:
            states[i] = state_dict_entry(zt, file, g, {s: (length, pieces[s]) for s in zt.states})
        flat_groups.append(file.slot("float32", (length,), pieces[MASTER]))
        group_members[g].append(i)
    scaler = zt.loss_scaler_state()
    inner = {"zero_stage": standins.ZeroStageEnum.weights, "loss_scaler": scaler["loss_scaler"],
             "dynamic_loss_scale": scaler["dynamic_loss_scale"], "overflow": scaler["overflow"],
             "partition_count": zt.dp}
    if not zt.weights_only:
        param_groups = [{**zt.hyper_params(g), "params": members} for g, members in enumerate(group_members)]
        inner["optimizer_state_dict"] = {"state": states, "param_groups": param_groups}
    inner["fp32_flat_groups"] = flat_groups
    return file.build({"optimizer_state_dict": inner, "ds_config": zt.config, "ds_version": zt.ds_version})
