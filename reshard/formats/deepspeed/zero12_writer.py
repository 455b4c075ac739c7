"""ZeRO-1/2 (and BF16_Optimizer) files of one model-parallel rank at the target dp (zero12.py reads them).

Per optimizer param group, DeepSpeed flattens the rank's trainable params (round-robin order if configured,
optional per-param alignment), pads the end to 2*dp and cuts it into dp equal partitions. The params are
those of a RankParams (shards of the full tensors under tensor or expert parallelism), so each partition's
pieces are flat ranges of those shards. A group may be cut over fewer ranks than dp (a mixture-of-experts
group over its expert-data-parallel group): its `count`, and each file's place among them (expert_writer).
"""
from __future__ import annotations

import math
from collections import OrderedDict

from reshard.core.catalog import MASTER, MODULE
from reshard.core.dtypes import itemsize
from reshard.core.geometry import ceil_div, intersect
from reshard.core.write_requests import Piece
from reshard.formats.deepspeed import files as names, notes, standins
from reshard.formats.deepspeed.rank_params import RankParams
from reshard.formats.deepspeed.zero_target import ZeroTarget, buffer_names, module_tree, state_dict_entry, weight_source
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder


class FlatGroup:
    """One param group of a rank flattened as DeepSpeed does for the target dp."""

    def __init__(self, zt: ZeroTarget, params: RankParams, g: int, count: int | None = None):
        self.g = g
        self.params = params
        self.count = count or zt.dp         # the ranks the group is partitioned over
        self.original = list(params.groups[g])
        self.flat = _round_robin(self.original, self.count) if zt.round_robin else list(self.original)
        align = 16 // math.gcd(16, itemsize(zt.lp_dtype)) if zt.param_alignment else 1
        self.offsets, self.paddings, offset = {}, [], 0
        for i, name in enumerate(self.flat):
            self.offsets[name] = offset
            offset += self.numel(name)
            pad = 0 if i == len(self.flat) - 1 else (-offset) % align
            self.paddings.append(pad)
            offset += pad
        self.end = offset
        self.padded = ceil_div(offset, 2 * self.count) * 2 * self.count
        self.part = self.padded // self.count

    def numel(self, name: str) -> int:
        return self.params.by_name[name].numel

    def tail_padding(self, rank: int) -> int:
        lo = rank * self.part
        return max(0, min(lo + self.part, self.padded) - max(lo, self.end))

    def pieces(self, state: str, lo: int, hi: int) -> list:
        """Elements [lo, hi) of the flat group for `state`, as pieces (zeros in the gaps)."""
        out, cursor = [], lo
        for name in self.flat:
            start = self.offsets[name]
            overlap = intersect(start, start + self.numel(name), lo, hi)
            if overlap is None:
                continue
            a, b = overlap
            if a > cursor:
                out.append(Piece.zeros(a - cursor))
            out.append(self.params.by_name[name].piece(state, a - start, b - a))
            cursor = b
        if hi > cursor:
            out.append(Piece.zeros(hi - cursor))
        return out

    def slice_mappings(self, rank: int) -> OrderedDict:
        """param_slice_mappings exactly as DeepSpeed writes them.

        DeepSpeed computes them in the original param order, with offsets of the flat buffer only
        when per-param alignment padding exists, else by summing sizes in the original order; under
        round_robin_gradients that is not where the params are (its defect B1). Nothing loads them,
        but readers take the original order from them, so we write the same.
        """
        lo, hi = rank * self.part, (rank + 1) * self.part
        offsets, running = {}, 0
        for name in self.original:
            offsets[name] = self.offsets[name] if any(self.paddings) else running
            running += self.numel(name)
        mappings = OrderedDict()
        for name in self.original:
            start = offsets[name]
            overlap = intersect(start, start + self.numel(name), lo, hi)
            if overlap:
                mappings[name] = standins.fragment_address(numel=overlap[1] - overlap[0], start=overlap[0] - lo)
        return mappings


def flat_groups(zt: ZeroTarget, params: RankParams) -> list:
    return [FlatGroup(zt, params, g) for g in range(len(params.groups))]


def _round_robin(names_in_order, dp):
    """DeepSpeed's _round_robin_reorder: param i goes to bucket i % dp, buckets concatenated."""
    buckets: OrderedDict[int, list[str]] = OrderedDict()
    for i, name in enumerate(names_in_order):
        buckets.setdefault(i % dp, []).append(name)
    return [name for bucket in buckets.values() for name in bucket]


def model_states(zt: ZeroTarget, params: RankParams, groups: list, tag: str, extra: dict) -> TorchFile:
    name = names.model_states_name(params.mp_rank)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])

    def full(p):    # ZeRO-1/2 save the whole 16-bit module: buffers, frozen and trainable weights
        dtype = p.module_dtype if p.kind == "buffer" else zt.lp_dtype
        state = MODULE if p.kind != "trainable" else weight_source(p)
        return file.slot(dtype, p.shape, [p.piece(state, 0, p.numel)])

    unregistered = set(notes.of(zt.catalog).unregistered)     # not a parameter: in no frozen_param_shapes
    frozen = [p for p in params.of_kind("frozen") if p.name not in unregistered]
    if params.weights_in_layer_files:     # a PipelineModule's weights are in layer files; frozen ones too
        module, slots = None, {p.name: None for p in frozen}
    else:
        module, slots = module_tree(params, full)
    stage2 = zt.stage == 2

    def shape(n):
        return zt.saved_shape(params.by_name[n].shape)
    return file.build({
        "module": module,
        "buffer_names": buffer_names(params),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, shape(n)) for n in group.flat) for group in groups],
        "frozen_param_shapes": OrderedDict((p.name, zt.saved_shape(p.shape)) for p in frozen) if stage2 else None,
        "shared_params": extra.get("shared_params", dict(params.aliases)),
        "frozen_param_fragments": OrderedDict((p.name, slots[p.name]) for p in frozen) if stage2 else None,
        **zt.model_states_tail(extra),
    })


def optim_states(zt: ZeroTarget, params: RankParams, rank: int, groups: list, tag: str,
                 places: list | None = None) -> TorchFile:
    """Data-parallel rank `rank`'s file; `places`: per group, the file's place among the ranks the group is cut
    over (default: `rank`, every group cut over dp)."""
    name = names.optim_states_name(rank, params.mp_rank, zt.bf16_prefix)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])
    fp32_parts, paddings, states, lean_states, param_groups, mappings = [], [], {}, [], [], []
    for group, place in zip(groups, places or [rank] * len(groups), strict=True):
        lo = place * group.part
        pad = group.tail_padding(place)
        lean = group.part - pad
        fp32_len = group.part if zt.bf16_optimizer else lean
        fp32_parts.append(file.slot("float32", (fp32_len,), group.pieces(MASTER, lo, lo + fp32_len)))
        state_len = lean if zt.elastic else group.part
        entry = state_dict_entry(zt, file, group.g, {
            s: (state_len, group.pieces(s, lo, lo + state_len)) for s in zt.states})
        if zt.elastic:
            lean_states.append(entry)
        else:
            states[group.g] = entry
        param_groups.append({**zt.hyper_params(group.g), "params": [group.g]})
        paddings.append(pad)
        mappings.append(group.slice_mappings(place))
    base = lean_states if zt.elastic else {"state": states, "param_groups": param_groups}
    count = [group.count for group in groups]
    if zt.bf16_optimizer:
        inner = {"clip_grad": zt.loss_scaler_state()["clip_grad"], "base_optimizer_state": base,
                 "single_partition_of_fp32_groups": fp32_parts, "group_paddings": paddings,
                 "partition_count": count, "ds_version": zt.ds_version, "param_slice_mappings": mappings}
    else:
        inner = {**zt.loss_scaler_state(), "base_optimizer_state": base}
        if zt.elastic:
            inner.update(_elastic_step(zt))
        inner.update({"single_partition_of_fp32_groups": fp32_parts,
                      "zero_stage": standins.ZeroStageEnum(zt.stage), "group_paddings": paddings,
                      "param_alignment_paddings": [list(group.paddings) for group in groups],
                      "partition_count": count, "ds_version": zt.ds_version, "param_slice_mappings": mappings})
    return file.build({"optimizer_state_dict": inner, "ds_config": zt.config, "ds_version": zt.ds_version})


def _elastic_step(zt: ZeroTarget) -> dict:
    """`base_optimizer_state_step` for elastic files.

    DeepSpeed writes it only when the optimizer keeps `step` in its param groups (its FusedAdam),
    yet its elastic loader asserts it is there, so its own elastic checkpoints of torch.optim.Adam
    cannot be resumed. We always write it (the per-group step counter) so the engine can load ours.
    """
    steps = zt.catalog.scalar_values("step")
    if len(steps) != 1:
        return {}
    step = steps.pop()
    return {"base_optimizer_state_step": int(step) if float(step).is_integer() else step}
