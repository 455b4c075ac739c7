"""Catalog -> a DeepSpeed universal checkpoint, written straight from the source's fragments.

DeepSpeed's ds_to_universal extracts every rank's slices into a temporary tree, then merges them;
here each `zero/<param>/<state>.pt` is a TorchFile whose one tensor is filled from the catalog's
fragments, so bytes move once, in the executor. The catalog places params by their real flat
offsets, so a round_robin_gradients source comes out right (ds_to_universal's is wrong there).

`--to zero=N` chooses the flavour the engine of stage N loads (see universal.py): the model-states
files and optimizer_state.pt are those of a ZeRO-N save at the target dp, which is what the engine
reads its training state from; the dp of a universal checkpoint only sets `dp_world_size` there.

Tensor parallelism (AutoTP, ZeRO-1/2): the zero/ files hold full tensors whatever the tp, and the
engine cuts its own slice by the live model's AutoTP metadata (universal_checkpoint.py
_resolve_autotp_partition), so only the model-states files depend on tp: at the target tp they are
those tp_writer writes (each rank's 16-bit shard and universal_checkpoint_info), as ds_to_universal
copies the source's. A param AutoTP described by an affine map gets `{'param': full}` without
`cat_dim`, as ds_to_universal writes it (its affine-map branch adds no category keys).

Mixture of experts (AutoEP, ZeRO-1/2): each packed expert weight's zero/ files hold its whole
(num_experts, ...) logical tensor, marked `is_expert_param` with `ep_num_experts`, as ds_to_universal
writes them; the loader takes each expert-parallel rank's experts out of it by the live model's placement
(universal_checkpoint.py _resolve_autoep_partition), so one tree serves every ep. The model states and
optimizer_state.pt are those of the engine at the target's ep and dp (expert_writer). No layer_L_expert_E
file is written: with load_universal on, the engine reads none (engine.py _load_checkpoint).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from typing import Any

from reshard.core.catalog import MASTER, MODULE, Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import Output, Piece, TextFile
from reshard.errors import ReshardError, UsageError
from reshard.formats.deepspeed import (
    expert_writer,
    files as names,
    notes,
    rank_params,
    standins,
    topology,
    tp_writer,
    universal as uc,
    writer as zero_writer,
    zero3_writer,
    zero12_writer,
)
from reshard.formats.deepspeed.zero_target import ZeroTarget, scalar_slot
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder

# Keys of a ZeRO-1/2 optimizer file that hold rank slices; ds_to_universal drops them from optimizer_state.pt.
_SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


# every --to key has a place in a universal tree (ep: in its model states; the zero/ tree serves every ep)
PLACES_EXPERTS = True      # AutoEP; deepspeed.moe is refused (_check_target)
RESUMED_BY_FRAMEWORKS = False
SAVES_OWN_NAMES = False
OWN_RANK_STATE = False

def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    _check_target(catalog, target)
    # A universal checkpoint is never elastic: its optimizer_state.pt needs the param groups.
    target = replace(target, format_topology=replace(topology.of(target), elastic=False))
    if catalog.experts is not None:
        out = _expert_flavour(catalog, target, tag)
    elif target.tp > 1 or catalog.layout.tp > 1:
        out = _tensor_parallel_flavour(catalog, target, tag)
    elif topology.of(target).zero == 3:
        out = _zero3_flavour(ZeroTarget(catalog, target), rank_params.whole(catalog), tag)
    else:
        out = _zero12_flavour(ZeroTarget(catalog, target), rank_params.whole(catalog), tag)
    out.append(TextFile(uc.LATEST_UNIVERSAL, tag))   # ds_to_universal writes the bare tag
    return out


def output_tag(catalog, tag: str) -> str:
    return tag


def describe(target: Layout, tag: str) -> Output:
    """Its model-states files are those of a ZeRO-N engine at the target's degrees (see above), in a tag folder."""
    return Output("universal", target.topology(), tag)


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    return zero_writer.batch_size_advice(catalog, target)


def _check_target(catalog, target):
    # Each param has its step.pt, yet DeepSpeed's loader asserts a group's are equal and keeps one per group
    # (base_optimizer.py load_hp_checkpoint_state_from_checkpoint_dir; stage3.py reads one for all)
    scalars = catalog.scalars_of_groups("a universal checkpoint")
    if target.pp != 1 or catalog.layout.pp != 1 or notes.of(catalog).pipe_layer_files:
        raise ReshardError(f"target {target.topology()}: universal checkpoints are written for pp=1 only")
    zero = topology.of(target).zero
    if (target.tp > 1 or catalog.layout.tp > 1) and zero not in (1, 2):
        raise ReshardError(f"target {target.topology()}: a tensor-parallel universal checkpoint is written for "
                           "ZeRO-1/2 only (what AutoTP trains with); use --to zero=1 or 2")
    if zero not in topology.STAGES:
        raise UsageError(f"target ZeRO stage {zero}: DeepSpeed loads a universal checkpoint only into a "
                           "ZeRO-1, ZeRO-2 (incl. BF16_Optimizer) or ZeRO-3 engine; use --to zero=1, 2 or 3")
    if catalog.experts is not None and not expert_writer.packs_experts(catalog):
        raise ReshardError.at(catalog.root, "a universal checkpoint of deepspeed.moe experts cannot be loaded: "
                                            "DeepSpeed's universal loader finds a param's folder by its local name, "
                                            "which expert-parallel ranks share (convert to --format deepspeed)")
    expert_writer.refuse_ep_without_experts(catalog, target)
    for name in catalog.params:
        if os.sep in name or name in (".", "..") or name == uc.OPTIMIZER_STATE:
            raise ReshardError(f"parameter name {name!r} cannot be a folder of a universal checkpoint")
    if zero == 3:
        unloadable = [s for s in catalog.optimizer_states() if s not in uc.ZERO3_LOADED_STATES]
        if unloadable:
            raise ReshardError(f"optimizer states {', '.join(unloadable)}: DeepSpeed's ZeRO-3 universal loader reads "
                               "only fp32, exp_avg and exp_avg_sq (stage3.py); write --to zero=1 or 2 instead")
        if any("step" not in s for s in scalars) or not scalars:
            raise ReshardError("DeepSpeed's ZeRO-3 universal loader needs an optimizer step count, "
                               "and this checkpoint has none")


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 and BF16_Optimizer: {'cat_dim': 0, 'param': full shape} per state, step.pt per param


def _zero12_flavour(zt, params, tag, keys=None) -> list:
    groups = zero12_writer.flat_groups(zt, params)
    return ([zero12_writer.model_states(zt, params, groups, tag, {})] + _zero_folder(zt, params, tag, keys)
            + [_optimizer_state(zero12_writer.optim_states(zt, params, 0, groups, tag), tag)])


def _zero_folder(zt, params, tag, keys=None) -> list:
    """zero/<param>/<state>.pt of every trainable param (its full fp32 tensor), its step.pt, and the module-only
    files. `keys`: per param, the keys ds_to_universal writes beside 'param' (see _shaped_file)."""
    out = []
    for p in params.of_kind("trainable"):
        for state in (MASTER, *zt.states):
            out.append(_shaped_file(uc.state_file(tag, p.name, state), p.shape,
                                    [p.piece(state, 0, p.numel)], (keys or {}).get(p.name)))
        step = zt.scalars(p.group).get(uc.STEP)
        if step is not None:
            file = TorchFileBuilder(uc.state_file(tag, p.name, uc.STEP), archive=uc.STEP)
            out.append(file.build(scalar_slot(file, step)))
    return out + _module_only_files(zt.catalog, tag)


def _shaped_file(path, shape, pieces, keys=None) -> TorchFile:
    """`keys`: the dict's other keys in ds_to_universal's order ({'cat_dim': 0} without TP); 'param' goes last
    unless `keys` names its place."""
    file = TorchFileBuilder(path, archive=os.path.splitext(os.path.basename(path))[0])
    tree = dict({uc.CAT_DIM: 0} if keys is None else keys)
    tree[uc.PARAM] = file.slot("float32", shape, pieces)
    return file.build(tree)


# ---------------------------------------------------------------------------------------------
# Mixture of experts (AutoEP, ZeRO-1/2): see the module docstring


def _expert_flavour(catalog, target, tag) -> list:
    model_states, optim0 = expert_writer.rank0_files(catalog, target, tag)
    keys = {name: {uc.PARAM: None, uc.CAT_DIM: 0, uc.IS_EXPERT_PARAM: True, uc.EP_NUM_EXPERTS: layer.num_experts}
            for layer in catalog.experts.layers for name in layer.params}
    zero = _zero_folder(ZeroTarget(catalog, target), rank_params.whole(catalog), tag, keys)
    return [model_states, *zero, _optimizer_state(optim0, tag)]


# ---------------------------------------------------------------------------------------------
# AutoTP (source or target tp > 1): the ZeRO-1/2 zero/ tree of full tensors, model states at target tp


def _tensor_parallel_flavour(catalog, target, tag) -> list:
    whole, tp_keys = target.with_degrees({"tp": 1}), _tp_keys(catalog)
    if catalog.layout.tp > 1:
        unmapped = [n for n, p in catalog.params.items() if p.kind == "trainable" and n not in tp_keys]
        if unmapped:      # a Megatron-style cut: ds_to_universal's cat_dim / sub-param keys, which we do not write
            raise ReshardError.at(catalog.root, f"{unmapped[0]}: no AutoTP affine map in its "
                                                "universal_checkpoint_info; universal checkpoints of tensor-parallel "
                                                "sources are written for AutoTP only")
    zt, params = ZeroTarget(catalog, whole), rank_params.whole(catalog)
    out = [f for f in _zero12_flavour(zt, params, tag, tp_keys) if not f.path.startswith(f"{tag}/mp_rank_")]
    if target.tp == 1:
        out.append(zero12_writer.model_states(zt, params, zero12_writer.flat_groups(zt, params), tag, {}))
    else:
        model_states = {f"{tag}/{names.model_states_name(r)}" for r in range(target.tp)}
        out += [f for f in tp_writer.target_files(catalog, target, tag) if f.path in model_states]
    return out


def _tp_keys(catalog) -> dict:
    """Per param the keys ds_to_universal writes beside 'param' for the source's AutoTP info: none when
    an affine map covers it (no `cat_dim`), `vocab_tensor` for a vocabulary param. Patterns are regexes,
    matched with re.match as its get_matched_affine_map / get_matched_pattern do."""
    extra = notes.of(catalog).mp_rank_extra.get(0) or {}
    info = extra.get("universal_checkpoint_info") or {}
    affine = list((info.get("affine_map") or {}).get("params") or {})
    vocab = info.get("vocabulary_parameter_patterns") or []
    out: dict[str, Any] = {}
    for name, p in catalog.params.items():
        if not any(re.match(pattern, name) for pattern in affine):
            continue          # no map: the category branches (cat_dim) apply; AutoTP always writes maps
        out[name] = {}
        if any(re.match(pattern, name) for pattern in vocab):
            if p.shape[0] != info.get("original_vocab_size"):
                raise ReshardError(f"{name}: {p.shape[0]} vocabulary rows, original_vocab_size "
                                   f"{info.get('original_vocab_size')}: stripping vocabulary padding is not supported")
            out[name][uc.VOCAB_TENSOR] = True
    return out


def _module_only_files(catalog, tag) -> list:
    """fp32.pt of every module entry without optimizer state (frozen params, tied names, buffers).

    ds_to_universal writes them (from the 16-bit module copy) and no loader reads them; we write the
    same files so the trees match, a tied name taking its holder's fp32 master rather than the copy.
    """
    out = []
    for key in catalog.order:
        holder = catalog.aliases.get(key, key)
        info = catalog.params.get(holder)
        if info is None or (key == holder and info.kind == "trainable"):
            continue
        source = (holder, MASTER) if (holder, MASTER) in catalog.tensors else (holder, MODULE)
        if source not in catalog.tensors:
            continue
        out.append(_paramless_file(uc.state_file(tag, key, MASTER), info.shape,
                                   [Piece(math.prod(info.shape), source, 0)]))
    return out


def _paramless_file(path, shape, pieces) -> TorchFile:
    file = TorchFileBuilder(path, archive=os.path.splitext(os.path.basename(path))[0])
    return file.build({uc.PARAM: file.slot("float32", shape, pieces)})


def _optimizer_state(optim0: TorchFile, tag) -> TorchFile:
    """Rank 0's optimizer file without its slices, plus the param groups (ds_to_universal's layout)."""
    rank0 = optim0.tree["optimizer_state_dict"]
    file = TorchFileBuilder(uc.optimizer_state_file(tag), archive="optimizer_state")
    tree = {k: v for k, v in rank0.items() if k not in _SHARDED_KEYS}
    tree["param_groups"] = rank0["base_optimizer_state"]["param_groups"]
    return file.build(tree)


# ---------------------------------------------------------------------------------------------
# ZeRO-3: bare flat fp32 tensors, the step and hyper-parameters in optimizer_state.pt


def _zero3_flavour(zt, params, tag) -> list:
    sub_groups = zero3_writer.sub_groups(zt, params)
    out = [zero3_writer.model_states(zt, params, rank, sub_groups, tag, {}) for rank in range(zt.dp)]
    for p in params.of_kind("trainable"):
        for state in (MASTER, *zt.states):
            path = uc.state_file(tag, p.name, state)
            file = TorchFileBuilder(path, archive=state)
            out.append(file.build(file.slot("float32", (p.numel,), [p.piece(state, 0, p.numel)])))
    out.append(_zero3_optimizer_state(zt, sub_groups, tag))
    return out


def _zero3_optimizer_state(zt, sub_groups, tag) -> TorchFile:
    """What the ZeRO-3 loader reads: loss scaler, per-sub-group step, param groups.

    ds_to_universal copies rank 0's whole optimizer file here, its fp32 and moment partitions
    included, which no loader reads; we leave those out.
    """
    file = TorchFileBuilder(uc.optimizer_state_file(tag), archive="optimizer_state")
    state: dict[int, dict] = {}
    members: list[list[int]] = [[] for _ in zt.catalog.param_groups]
    for i, (g, _) in enumerate(sub_groups):
        state[i] = {key: scalar_slot(file, value) for key, value in zt.scalars(g).items()}
        members[g].append(i)
    param_groups = [{**zt.hyper_params(g), "params": m} for g, m in enumerate(members)]
    scaler = zt.loss_scaler_state()
    return file.build({"zero_stage": standins.ZeroStageEnum.weights, "loss_scaler": scaler["loss_scaler"],
                       "dynamic_loss_scale": scaler["dynamic_loss_scale"], "overflow": scaler["overflow"],
                       "partition_count": zt.dp,
                       "optimizer_state_dict": {"state": state, "param_groups": param_groups},
                       "param_groups": param_groups})
