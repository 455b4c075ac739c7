"""One model-parallel rank of a DeepSpeed ZeRO-1/2/3 save -> Catalog of its local tensors, from metadata only.

The rank files are opened with the safe unpickler; tensors stay on disk. The geometry of the
optimizer partitions (ZeRO-1/2: slices of one flat vector per param group; ZeRO-3: per-parameter
ceil(n/dp) slices) is turned into fragments by `zero12` and `zero3`. Whatever is missing or
inconsistent is recorded in `catalog.problems`, one line per problem naming the file, so
`validate` can report it all; only a checkpoint that cannot be understood at all raises. Used by
the format's reader (reader.py) for a save without model parallelism, by parallel.py for each rank
of one with it, and by universal_reader.py for the model states of a universal tree.
"""
from __future__ import annotations

import os
from dataclasses import replace

from reshard.core.catalog import MODULE, CatalogBuilder, FileInfo, Fragment, ParamInfo, TensorDraft, TrainingState
from reshard.core.dtypes import is_floating
from reshard.core.layout import Layout
from reshard.errors import CheckpointError, ReshardError, UnsafeCheckpointError
from reshard.formats import weights_only
from reshard.formats.deepspeed import (
    experts as expert_placement,
    files as names,
    group_scalars,
    pickles,
    topology,
    zero3,
    zero3_experts,
    zero12,
)
from reshard.formats.deepspeed.notes import DeepSpeedNotes
from reshard.formats.deepspeed.topology import DeepSpeedTopology
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import file_size
from reshard.storage import files as fs

# What a mixture-of-experts save's model states add (engine._save_moe_checkpoint), kept for its writer
EXPERT_KEYS = ("num_experts", "ds_autoep_layers", "universal_checkpoint_info")
# Keys of a model-states file that DeepSpeed itself writes; everything else is client state.
ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "shared_params", "checkpoint_parallel_dimensions", "universal_checkpoint_info", "compiled_autograd",
    "ds_autotp_universal_checkpoint_meta", *EXPERT_KEYS,
}
TRAINING_STATE_KEYS = ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")
NOTES_KEYS = ("ds_config", "ds_version", "data_sampler", "random_ltd")     # DeepSpeedNotes fields
OPTIMIZER_SCALAR_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")


def read_mp_rank(tag_dir: str, tag: str, listing: list, mp: int, model0_name: str, model0: dict) -> CatalogBuilder:
    """The catalog of one model-parallel rank's files (all of them when there is no model parallelism):
    its tensors are that rank's local tensors (a tensor-parallel shard, a pipeline stage's params)."""
    dp = int(model0.get("dp_world_size") or 1)
    catalog = CatalogBuilder(root=tag_dir, format="deepspeed", layout=Layout.of(dp), tag=tag)
    bf16_prefix = any(n.startswith("bf16_") and names.OPTIM_STATES.match(n) for n in listing)
    # thin's record in the tag folder, or in the save dir around it where a framework's folder is the save dir
    # (Accelerate's save_state: the record is the whole folder's)
    thinned = weights_only.is_thinned(tag_dir) or weights_only.is_thinned(os.path.dirname(tag_dir))
    if not any(names.OPTIM_STATES.match(n) for n in listing) and thinned:
        return _read_weights_only(catalog, tag_dir, model0_name, model0)
    optim = _load_rank_files(catalog, tag_dir, listing, dp, bf16_prefix, mp)
    if not any(names.OPTIM_STATES.match(n) for n in listing):
        raise ReshardError.at(tag_dir, "no *_optim_states.pt files; ZeRO stage 0 checkpoints are not supported")
    first_optim = next((sd for _, sd in optim.values() if sd is not None), None)
    if first_optim is None:
        expected = ", ".join(os.path.basename(path) for path, _ in optim.values())
        raise ReshardError.at(tag_dir, f"no optimizer state file of model-parallel rank {mp} could be read "
                                       f"(expected {expected})")

    stage = _zero_stage(first_optim)
    # a ZeRO-3 weights-only form (`reshard thin`): the fp32 partitions without the torch optimizer's state dict
    moments_dropped = stage == 3 and "optimizer_state_dict" not in first_optim
    catalog.layout = replace(catalog.layout, format_topology=format_topology(model0, first_optim, bf16_prefix, stage,
                                                                             moments_dropped))
    partitioned = stage == 3 and zero3_experts.is_partitioned(model0)      # AutoEP under ZeRO-3
    experts = zero3_experts.read(tag_dir, listing, model0) if partitioned else \
        expert_placement.read(tag_dir, listing, model0, first_optim)
    if experts is not None and mp:
        raise ReshardError.at(tag_dir, "mixture-of-experts checkpoints with tensor/pipeline parallelism are not "
                                       "supported")
    if experts is not None and stage == 3 and not partitioned:
        raise ReshardError.at(tag_dir, "a ZeRO-3 mixture-of-experts save whose ds_autoep_layers are not marked "
                                       "zero3_partitioned (deepspeed.moe or an older AutoEP) is not supported")
    if experts is not None:      # the target keeps it unless --to names another (ep=E)
        catalog.layout = replace(catalog.layout, format_topology=replace(topology.of(catalog.layout),
                                                                         ep=experts.topology.ep))
    if stage == 3:
        if mp:
            raise ReshardError.at(tag_dir, "ZeRO-3 with tensor or pipeline parallelism is not supported")
        models = load_zero3_model_files(catalog, tag_dir, dp, model0_name, model0)
    else:
        models = {0: model0}
        catalog.files.append(FileInfo(model0_name, "model_states", None, file_size(os.path.join(tag_dir, model0_name))))

    read_model(catalog, model0, models, stage, experts)
    if stage == 3 and experts is not None:
        zero3_experts.read_partitions(catalog, model0, optim, experts)
        zero3_experts.check_ranks(catalog, models, experts)
    elif stage == 3:
        zero3.read_partitions(catalog, model0, models, optim)
    else:
        zero12.read_partitions(catalog, model0, optim, experts)
    if experts is not None:
        expert_placement.read_module(catalog, tag_dir, experts, load_or_raise)
    _check_steps_agree(catalog, models)
    fill_state(catalog, model0, first_optim, experts)
    if moments_dropped:
        catalog.training = replace(catalog.training, optimizer="")     # (its config names one; none is saved)
    fill_layout(catalog, model0)
    return catalog


def _read_weights_only(catalog, tag_dir: str, model0_name: str, model0: dict) -> CatalogBuilder:
    """A tag folder `reshard thin` left (weights_only.PROVENANCE, no optimizer files): the module files alone,
    the weights in the training dtype, as DeepSpeed's module-only load takes them (ZeRO-1/2)."""
    stage = int(((model0.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 1))
    if stage not in (1, 2):
        raise ReshardError.at(tag_dir, f"a weights-only tag folder of a ZeRO-{stage} save: only ZeRO-1/2 module "
                                       "files hold the weights")
    catalog.layout = replace(catalog.layout, format_topology=format_topology(model0, {}, False, stage, True))
    catalog.files.append(FileInfo(model0_name, "model_states", None, file_size(os.path.join(tag_dir, model0_name))))
    read_model(catalog, model0, {0: model0}, stage)
    fill_state(catalog, model0, {})
    catalog.training = replace(catalog.training, optimizer="")     # (its config names one; none is saved)
    fill_layout(catalog, model0)
    return catalog


def first_model_states(tag_dir, listing) -> str:
    for pattern in (names.MODEL_STATES, names.ZERO3_MODEL_STATES):
        matched = [(n, m) for n in listing if (m := pattern.match(n)) is not None]
        found = [n for n, _ in sorted(matched, key=lambda nm: [int(x) for x in nm[1].groups()])]
        if found:
            return found[0]
    raise ReshardError.at(tag_dir, "no *_model_states.pt file; not a DeepSpeed checkpoint tag folder")


def load_or_raise(path):
    obj = pickles.load(path)
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"expected a dict at the top level, found {type(obj).__name__}")
    return obj


def _load_rank_files(catalog, tag_dir, listing, dp, bf16_prefix, mp=0) -> dict:
    """Optimizer files of every data-parallel rank (of model-parallel rank `mp`): rank -> (path, state dict
    or None if unusable)."""
    found: dict[int, str] = {}
    for n in listing:
        m = names.OPTIM_STATES.match(n)
        if m and int(m.group(3)) == mp:
            found.setdefault(int(m.group(2)), n)
    optim = {}
    for rank in range(dp):
        name = found.get(rank, names.optim_states_name(rank, mp, bf16_prefix))
        path = os.path.join(tag_dir, name)
        optim[rank] = (path, _load_rank_file(catalog, tag_dir, name, "optim_states", rank, "optimizer_state_dict"))
    for rank in sorted(set(found) - set(range(dp))):
        catalog.problem(os.path.join(tag_dir, found[rank]), f"rank {rank} is outside the saved world size dp={dp}")
    return optim


def _load_rank_file(catalog, tag_dir, name, role, rank, required_key):
    path = os.path.join(tag_dir, name)
    catalog.files.append(FileInfo(name, role, rank, file_size(path)))
    if not fs.exists(path):
        catalog.problem(path, f"missing (expected for data-parallel rank {rank})")
        return None
    try:
        sd = load_or_raise(path)
    except UnsafeCheckpointError:
        raise
    except CheckpointError as e:
        catalog.failed(e)
        return None
    if required_key not in sd:
        catalog.problem(path, f"no '{required_key}' key; not a DeepSpeed {role.replace('_', ' ')} file")
        return None
    return sd[required_key] if role == "optim_states" else sd


def load_zero3_model_files(catalog, tag_dir, dp, model0_name, model0) -> dict:
    models = {}
    for rank in range(dp):
        name = names.model_states_name(0, rank)
        if name == model0_name:
            catalog.files.append(FileInfo(name, "model_states", rank, file_size(os.path.join(tag_dir, name))))
            models[rank] = model0
        else:
            models[rank] = _load_rank_file(catalog, tag_dir, name, "model_states", rank, "param_shapes")
    for rank, sd in models.items():
        if sd is None or sd is model0:
            continue
        path = os.path.join(tag_dir, names.model_states_name(0, rank))
        if _shapes(sd.get("param_shapes")) != _shapes(model0.get("param_shapes")):
            catalog.problem(path, f"param_shapes differ from {model0_name}")
        if sd.get("dp_world_size") != model0.get("dp_world_size"):
            catalog.problem(path, f"dp_world_size {sd.get('dp_world_size')} differs from {model0_name}'s "
                            f"{model0.get('dp_world_size')}")
    return models


def _shapes(param_shapes):
    return [[(k, tuple(v)) for k, v in group.items()] for group in (param_shapes or [])]


def _zero_stage(optim_sd) -> int:
    stage = optim_sd.get("zero_stage")
    if stage is None:
        return 1          # BF16_Optimizer writes no stage; it partitions like ZeRO-1
    return int(stage)


def read_model(catalog, model0, models, stage, experts=None):
    """Parameters, buffers, aliases and the module state_dict copy (16-bit weights, buffers). An expert param
    group's params are its logical tensors (every expert; experts.read_module adds their weights)."""
    module = model0.get("module") or {}
    buffer_names = list(model0.get("buffer_names") or [])
    catalog.aliases = dict(model0.get("shared_params") or {})
    if stage == 3 and experts is not None:      # AutoEP's router alias: a placeholder, a second name of the router
        catalog.aliases.update(expert_placement.router_ties(model0))
    catalog.order = list(module)
    param_shapes = model0.get("param_shapes") or []
    trainable = {}
    for g, group in enumerate(param_shapes):
        if experts is not None and g in experts.groups:
            group = experts.group_params(group)
        for name, shape in group.items():
            trainable[name] = (tuple(shape), g)
    frozen_shapes = dict(model0.get("frozen_param_shapes") or {})

    for key, ref in module.items():
        if key in catalog.aliases:
            continue
        if key in trainable:
            shape, group = trainable.pop(key)
            catalog.params[key] = ParamInfo(key, shape, "trainable", group if stage != 3 else None)
            if stage != 3:
                add_whole(catalog, key, MODULE, ref)
        elif key in buffer_names:
            catalog.params[key] = ParamInfo(key, tuple(ref.shape), "buffer")
            add_whole(catalog, key, MODULE, ref)
        elif isinstance(ref, TensorRef):
            shape = tuple(frozen_shapes.get(key, ref.shape))
            catalog.params[key] = ParamInfo(key, shape, "frozen")
            if stage != 3:
                add_whole(catalog, key, MODULE, ref)
    for name, (shape, group) in trainable.items():   # trainable but absent from `module`
        catalog.params[name] = ParamInfo(name, shape, "trainable", group if stage != 3 else None)
    if stage == 3:
        zero3.read_frozen(catalog, models)


def add_whole(catalog, name, state, ref):
    if not isinstance(ref, TensorRef):
        return
    if not ref.is_contiguous():
        catalog.problem(ref.storage.file, f"{name}: non-contiguous tensor in the module state_dict")
        return
    tensor = catalog.add(TensorDraft(name, state, tuple(ref.shape), ref.dtype), ref.storage.file)
    if ref.numel:
        tensor.fragments.append(Fragment(0, ref.numel, ref.storage, ref.storage_offset))


def _check_steps_agree(catalog, models):
    """The ZeRO-3 model-states files (one per rank) agree on global_steps: the odd one out is named."""
    held = [(os.path.join(catalog.root, names.model_states_name(0, rank)), sd.get("global_steps"))
            for rank, sd in sorted(models.items()) if sd is not None]
    for path, text in group_scalars.agreed(held, "global_steps")[1]:
        catalog.problem(path, text)


def fill_state(catalog, model0, optim0, experts=None):
    """The training counters (core) and what only DeepSpeed's writers carry (DeepSpeedNotes), as saved."""
    catalog.training = TrainingState(**{k: model0[k] for k in TRAINING_STATE_KEYS if k in model0},
                                     optimizer=_optimizer_name(model0.get("ds_config") or {}))
    expert_keys = {k: v for k, v in model0.items() if k in EXPERT_KEYS} if experts is not None else {}
    catalog.notes = DeepSpeedNotes(**{k: model0[k] for k in NOTES_KEYS if k in model0},
                                   **{k: optim0[k] for k in OPTIMIZER_SCALAR_KEYS if k in optim0},
                                   saved_scalars=tuple(k for k in OPTIMIZER_SCALAR_KEYS if k in optim0),
                                   client_state={k: v for k, v in model0.items() if k not in ENGINE_KEYS},
                                   expert_keys=expert_keys, expert_files=experts.files if experts else (),
                                   unregistered=_unregistered(catalog, model0))


def _unregistered(catalog, model0) -> tuple:
    """Module tensors that are no parameter of their own. A ZeRO-2 save's frozen_param_shapes name every frozen
    parameter (module.parameters()), so a module tensor neither trained, a buffer nor listed there is a second name
    of one; a ZeRO-1 save lists none, and only AutoEP's router alias is known (experts.router_aliases)."""
    frozen = [n for n, p in catalog.params.items() if p.kind == "frozen"]
    listed = model0.get("frozen_param_shapes")
    if isinstance(listed, dict) and catalog.layout.format_topology.zero == 2:
        return tuple(n for n in frozen if n not in listed)
    aliases = set(expert_placement.router_aliases(model0))
    return tuple(n for n in frozen if n in aliases)


def format_topology(model0, optim0, bf16_prefix, stage, weights_only=False) -> DeepSpeedTopology:
    """The ZeRO stage, and how DeepSpeed cut this checkpoint's partitions where it has variants."""
    zero_cfg = (model0.get("ds_config") or {}).get("zero_optimization") or {}
    return DeepSpeedTopology(zero=stage, bf16_optimizer=bool(bf16_prefix and "zero_stage" not in optim0),
                             weights_only=weights_only,
                             elastic=isinstance(optim0.get("base_optimizer_state"), list),
                             round_robin_gradients=bool(zero_cfg.get("round_robin_gradients")),
                             parameter_alignment=bool(zero_cfg.get("parameter_alignment")),
                             sub_group_size=int(zero_cfg.get("sub_group_size", 1_000_000_000)) if stage == 3 else None)


def fill_layout(catalog, model0):
    layout = catalog.layout
    config = model0.get("ds_config") or {}
    saved = {catalog.tensors[(n, MODULE)].dtype for n, p in catalog.params.items()
             if p.kind == "trainable" and (n, MODULE) in catalog.tensors}
    floating = sorted(d for d in saved if is_floating(d))
    # the 16-bit copy says it when there is one (ZeRO-1/2); ZeRO-3 saves none, its config says it
    catalog.layout = replace(layout, dtype=floating[0] if len(floating) == 1 else (_config_dtype(config) or "float32"))


def _optimizer_name(config) -> str:
    """The optimizer the config had DeepSpeed build: its type, where "Adam" builds AdamW unless adam_w_mode is
    false (engine.py _configure_basic_optimizer). "" when the config names none (a client optimizer)."""
    section = config.get("optimizer") or {}
    name = section.get("type") or ""
    if name.lower() == "adamw" or (name.lower() == "adam" and (section.get("params") or {}).get("adam_w_mode", True)):
        return "AdamW"
    return "Adam" if name.lower() == "adam" else name


def _config_dtype(config) -> str | None:
    for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        if (config.get(key) or {}).get("enabled"):
            return dtype
    return "float32" if config else None


