"""DeepSpeed universal checkpoint -> Catalog, from metadata only (layout: see universal.py).

Each trainable param's `zero/<param>/<state>.pt` holds one full tensor: it becomes one fragment of
(param, state); its `step.pt` (ZeRO-1/2 flavour) is the param's own step. Which params are trainable,
their groups, the frozen params, buffers and tied names come from the model-states file(s) beside
`zero/`, as for a ZeRO save; hyper-parameters, loss scaler and (ZeRO-3 flavour) the step from
`zero/optimizer_state.pt`. Files are opened with the safe unpickler only. Folders that ds_to_universal
writes for buffers, frozen and tied names are not read: no loader reads them either.

A tree of an AutoEP save (ZeRO-1/2): ds_to_universal copies the source's model states (its ds_autoep_layers give
the placement, experts.py, and rank 0's local shapes) and writes each packed expert weight's states whole,
(num_experts, ...), marked is_expert_param; the expert groups keep `moe: True`. It writes no layer_L_expert_E files:
the experts' module weights are their fp32 master, which DeepSpeed's universal load casts to the model's dtype
(engine.load_checkpoint -> optimizer.update_lp_params), and so does the catalog (a cast of the master's fragments).
The tree has no expert-data-parallel degree of its own: ep is the placement's, dp the model states' dp_world_size.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace

from reshard.core.catalog import MASTER, MODULE, Catalog, CatalogBuilder, FileInfo, Fragment, TensorDraft
from reshard.core.layout import Layout
from reshard.errors import CheckpointError, ReshardError, UnsafeCheckpointError
from reshard.formats.deepspeed import (
    experts as expert_placement,
    files as names,
    group_scalars,
    pickles,
    rank_reader,
    universal as uc,
)
from reshard.formats.deepspeed.topology import DeepSpeedTopology
from reshard.formats.protocol import TagOption
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import file_size
from reshard.storage import files as fs

FORMAT = "universal"
OPTIONS = TagOption
IN_FRAMEWORK_FOLDERS = False
AUTOEP_LAYERS, UC_INFO = expert_placement.AUTOEP_LAYERS, expert_placement.UC_INFO
# What engine._save_moe_checkpoint writes there for AutoEP (engine.py:5323); ds_to_universal writes a pattern of
# its own and lightens the layer entries (ds_to_universal.py:1269).
ENGINE_EXPERT_PATTERNS = [r".*\.experts\.w[123]$"]


def sniff(path: str, tag: str | None) -> bool:
    if not fs.isdir(path):
        return False
    if tag is not None:
        return uc.is_universal_tag_dir(os.path.join(path, tag))
    if uc.is_universal_tag_dir(path):
        return True
    # A save dir holding both `latest` and `latest_universal` is read as the ordinary save it also is.
    return fs.isfile(os.path.join(path, uc.LATEST_UNIVERSAL)) and not fs.isfile(
        os.path.join(path, names.LATEST))


def read(path: str, options: TagOption) -> Catalog:
    tag_dir, tag = _resolve_tag_dir(path, options.tag)
    try:
        return _read(tag_dir, tag).freeze()
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise ReshardError.at(tag_dir, "not the structure of a DeepSpeed universal checkpoint "
                                       f"({type(e).__name__}: {e})") from None


def _resolve_tag_dir(path, tag) -> tuple:
    path = fs.abspath(path)
    pointer = None
    if tag is None and not uc.is_universal_tag_dir(path):
        pointer = os.path.join(path, uc.LATEST_UNIVERSAL)
        with fs.open(pointer) as f:
            tag = f.read().strip()
        if not tag:
            raise ReshardError.at(pointer, "file is empty; name the tag with --tag")
    if tag is None:
        return path, os.path.basename(path)
    tag_dir = names.tag_folder(path, tag, pointer)
    if not uc.is_universal_tag_dir(tag_dir):
        raise ReshardError.at(tag_dir, f"no '{uc.ZERO_DIR}' folder; not a universal checkpoint tag folder")
    return tag_dir, tag


def _load_dict(path):
    if not fs.isfile(path):
        raise CheckpointError(path, "missing")
    obj = pickles.load(path)
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"expected a dict at the top level, found {type(obj).__name__}")
    return obj


def _read(tag_dir, tag) -> CatalogBuilder:
    listing = sorted(fs.listdir(tag_dir))
    optim_path = os.path.join(tag_dir, uc.ZERO_DIR, uc.OPTIMIZER_STATE)
    optim = _load_dict(optim_path)
    zero3_files = [n for n in listing if names.ZERO3_MODEL_STATES.match(n)]
    model0_name = rank_reader.first_model_states(tag_dir, listing)
    model0 = _load_dict(os.path.join(tag_dir, model0_name))
    dp = int(model0.get("dp_world_size") or 1)
    dims = model0.get("checkpoint_parallel_dimensions") or {}
    if int(model0.get("mp_world_size") or 1) > 1 or dims.get("tp_degree", 1) > 1 or dims.get("pp_degree", 1) > 1:
        raise ReshardError.at(tag_dir, f"a tensor/pipeline-parallel universal checkpoint ({dims}); "
                                       "only data-parallel ones are supported so far")
    stage = 3 if zero3_files else int(optim.get("zero_stage") or 1)
    experts = _experts(tag_dir, listing, model0, optim, stage)
    if experts is not None:
        model0 = _as_the_engine_saved(model0)

    catalog = CatalogBuilder(root=tag_dir, format="universal", tag=tag,
                             layout=Layout.of(dp, format_topology=DeepSpeedTopology(zero=stage)))
    catalog.files.append(FileInfo(os.path.join(uc.ZERO_DIR, uc.OPTIMIZER_STATE), "optimizer_state", None,
                                  file_size(optim_path)))
    if stage == 3:
        models = rank_reader.load_zero3_model_files(catalog, tag_dir, dp, model0_name, model0)
    else:
        models = {0: model0}
        catalog.files.append(FileInfo(model0_name, "model_states", None, file_size(os.path.join(tag_dir, model0_name))))
    rank_reader.read_model(catalog, model0, models, stage, experts)   # ZeRO-3: frozen params from every rank's file
    groups = _groups(catalog, model0, optim, stage, experts)
    num_experts = {name: layer.num_experts for layer in (experts.topology.layers if experts else ())
                   for name in layer.params}
    found = {}
    for g, members in enumerate(groups):
        for name in members:
            catalog.params[name] = replace(catalog.params[name], group=g)
            found[name] = _read_param(catalog, name, g, num_experts.get(name))
    _missing_states(catalog, found)
    if stage == 3:
        _zero3_steps(catalog, optim_path, optim)
    _fill_state(catalog, model0, optim, stage, experts)
    if experts is not None:
        _expert_modules(catalog, experts)
    return catalog


def _experts(tag_dir, listing, model0, optim, stage):
    """The expert placement of an AutoEP save's tree (None without experts)."""
    groups = optim.get("param_groups") or []
    if not model0.get(AUTOEP_LAYERS):
        if any(isinstance(g, dict) and g.get("moe") for g in groups):
            raise ReshardError.at(tag_dir, "expert param groups (moe: True) without ds_autoep_layers: a deepspeed.moe "
                                           "universal checkpoint records no expert placement (not supported)")
        return None
    if stage == 3:
        raise ReshardError.at(tag_dir, "a mixture-of-experts universal checkpoint of ZeRO-3 is not supported")
    return expert_placement.from_groups(tag_dir, listing, model0, groups, [])


def _as_the_engine_saved(model0) -> dict:
    """The model states of an AutoEP save as its engine wrote them, for a writer of the engine's files: ds_to_universal
    rewrote their universal_checkpoint_info; the engine's holds its own pattern and the full ds_autoep_layers, which
    the model states keep beside it."""
    info = {**(model0.get(UC_INFO) or {}), "expert_parameter_patterns": ENGINE_EXPERT_PATTERNS,
            AUTOEP_LAYERS: model0[AUTOEP_LAYERS]}
    return {**model0, UC_INFO: info}


def _groups(catalog, model0, optim, stage, experts) -> list:
    """Trainable param names per optimizer param group, in the optimizer's order; fills param_groups. An expert
    group's are its logical tensors (param_shapes name rank 0's local experts)."""
    shapes = [list(experts.group_params(group) if experts is not None and g in experts.groups else group)
              for g, group in enumerate(model0.get("param_shapes") or [])]
    if stage == 3:
        loaded = (optim.get("optimizer_state_dict") or {}).get("param_groups") or optim.get("param_groups") or []
        groups = [[name for i in group.get("params", []) for name in shapes[i]] for group in loaded]
    else:
        loaded = optim.get("param_groups") or []
        groups = shapes
        config = (model0.get("ds_config") or {}).get("zero_optimization") or {}
        if config.get("round_robin_gradients"):
            # param_shapes are in the round-robin flat order; the optimizer's is the model's
            position = {name: i for i, name in enumerate(catalog.order)}
            groups = [sorted(group, key=lambda n: position.get(n, len(position))) for group in groups]
    if len(loaded) != len(groups):
        raise ReshardError.at(os.path.join(catalog.root, uc.ZERO_DIR, uc.OPTIMIZER_STATE), f"{len(loaded)} param "
                           f"groups, the model-states file has {len(groups)}")
    for hyper, members in zip(loaded, groups, strict=True):
        catalog.param_groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": members})
        catalog.group_scalars.append({})
    return groups


def _read_param(catalog, name, g, num_experts) -> set:
    """The states of param `name` (of group g; an expert param of `num_experts` experts, else None) its folder
    holds, read into the catalog."""
    folder = os.path.join(catalog.root, uc.ZERO_DIR, name)
    shape = catalog.params[name].shape
    if not fs.isdir(folder):
        catalog.problem(folder, f"missing: no universal state folder for trainable parameter {name}")
        return set()
    states = sorted(f[:-3] for f in fs.listdir(folder) if f.endswith(".pt"))
    if MASTER not in states:
        catalog.problem(os.path.join(folder, MASTER + ".pt"), f"missing: the fp32 master of {name}")
    for state in states:
        path = os.path.join(folder, state + ".pt")
        catalog.files.append(FileInfo(os.path.relpath(path, catalog.root), "universal_state", None, file_size(path)))
        try:
            obj = pickles.load(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            catalog.failed(e)
            continue
        if state == uc.STEP:        # ds_to_universal copies the group's into each; the loader asserts they agree
            catalog.record_param_scalar(g, name, uc.STEP, group_scalars.scalar(obj), path)
            continue
        ref = _state_tensor(catalog, path, obj, shape, num_experts)
        if ref is not None:
            tensor = catalog.add(TensorDraft(name, state, shape, ref.dtype), ref.storage.file)
            tensor.fragments.append(Fragment(0, ref.numel, ref.storage, ref.storage_offset))
    return set(states)


def _missing_states(catalog, found):
    """A state every other param's folder holds and this one's lacks: its file is missing. (The fp32 master's
    absence _read_param reports.)"""
    every = set().union(*found.values()) - {MASTER} if found else set()
    for name, states in found.items():
        for state in sorted(every - states if states else ()):
            catalog.problem(os.path.join(catalog.root, uc.ZERO_DIR, name, state + ".pt"),
                            f"missing: the {state} of {name} (the other parameters' folders hold one)")


def _state_tensor(catalog, path, obj, shape, num_experts):
    """The full tensor of a state file, or None (a problem recorded) when it is not one of `shape` (for an expert
    param: not marked as every one of its `num_experts` experts)."""
    expert_keys = (uc.IS_EXPERT_PARAM, uc.EP_NUM_EXPERTS)
    marked = obj.get(uc.IS_EXPERT_PARAM) and obj.get(uc.EP_NUM_EXPERTS) if isinstance(obj, dict) else None
    if num_experts is not None and marked != num_experts:
        catalog.problem(path, f"an expert param's state, but not marked {uc.IS_EXPERT_PARAM} with "
                              f"{uc.EP_NUM_EXPERTS}={num_experts} (found {marked})")
        return None
    if num_experts is None and marked:
        catalog.problem(path, f"marked {uc.IS_EXPERT_PARAM}, but the param is in no expert param group")
        return None
    if isinstance(obj, dict):
        parallel = [k for k in uc.PARALLEL_KEYS if obj.get(k) and k not in expert_keys]
        if parallel or obj.get(uc.CAT_DIM, 0) != 0:
            what = ", ".join(parallel) or "cat_dim"
            raise ReshardError.at(path, f"tensor-parallel universal metadata ({what}) is not supported yet")
        obj = obj.get(uc.PARAM)
    if not isinstance(obj, TensorRef):
        catalog.problem(path, f"holds {type(obj).__name__}, not a tensor")
        return None
    n = math.prod(shape)
    if obj.numel != n or tuple(obj.shape) not in (tuple(shape), (n,)):
        catalog.problem(path, f"tensor of shape {list(obj.shape)}, the parameter's shape is {list(shape)}")
        return None
    if not obj.is_contiguous():
        catalog.problem(path, "non-contiguous tensor")
        return None
    return obj


def _zero3_steps(catalog, path, optim):
    """The ZeRO-3 flavour keeps one step per sub-group in optimizer_state.pt."""
    inner = optim.get("optimizer_state_dict") or {}
    sub_group_of = {i: g for g, group in enumerate(inner.get("param_groups") or []) for i in group.get("params", [])}
    votes = group_scalars.Votes(catalog)
    for i, entry in (inner.get("state") or {}).items():
        for key, value in entry.items():
            if key == uc.STEP:
                votes.add(path, sub_group_of.get(i, 0), key, value)
    votes.settle()


def _fill_state(catalog, model0, optim, stage, experts):
    rank_reader.fill_state(catalog, model0, optim, experts)
    config = model0.get("ds_config") or {}
    bf16 = bool((config.get("bf16") or config.get("bfloat16") or {}).get("enabled"))
    own = rank_reader.format_topology(model0, optim, bf16 and stage != 3, stage)
    if experts is not None:      # the target keeps it unless --to names another (ep=E)
        own = replace(own, ep=experts.topology.ep)
    catalog.layout = replace(catalog.layout, format_topology=own)
    rank_reader.fill_layout(catalog, model0)


def _expert_modules(catalog, experts):
    """The experts' module weights: their fp32 master, cast to the model's dtype (the dense params' module copies'),
    as DeepSpeed's universal load sets them."""
    dtype = catalog.layout.dtype
    for name in experts.shapes:
        master = catalog.tensors.get((name, MASTER))
        if master is not None:        # else a problem already
            catalog.add(TensorDraft(name, MODULE, master.shape, dtype, list(master.fragments),
                                      "" if dtype == master.dtype else master.dtype))
    catalog.order.extend(name for name in experts.shapes if name not in catalog.order)
    catalog.experts = experts.topology
