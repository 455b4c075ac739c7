"""Tensor- and pipeline-parallel DeepSpeed checkpoints -> one Catalog of FULL logical tensors.

Each model-parallel rank (`mp_rank_XX`) is read like a data-parallel ZeRO-1/2 checkpoint of its own
(rank_reader.read_mp_rank): its tensors are local ones. Then
* tensor parallel (mp = tp ranks): each local tensor is a shard of the full tensor, a set of boxes
  (tp_geometry.Split.shard); its fragments keep their flat ranges, now of that shard. Replicated blocks
  are read from their first holder; the other holders' copies are kept as catalog.replicas and compared
  (now when small, such as norms; by `validate --deep` when big) and a difference is a catalog problem.
* pipeline parallel (mp = stages): the stages' params are already named as the PipelineModule names
  them; a tied module trained in several stages appears once, its copies compared. The module weights
  come from the `layer_XX-model_states.pt` files, whose local keys are mapped to those names.
* both (tp > 1 and pp > 1, layer files `layer_XX-model_TT-model_states.pt`): each TP rank's stages are merged
  as a pipeline, then the TP ranks as above (_merge_3d); tied copies are found per TP rank and re-addressed.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from reshard.core.catalog import (
    MODULE,
    CatalogBuilder,
    FileInfo,
    Fragment,
    LogicalTensor,
    ParamInfo,
    Replica,
    TensorDraft,
    TensorKey,
)
from reshard.core.dtypes import itemsize
from reshard.core.problems import READER, Problem
from reshard.errors import CheckpointError, ReshardError, UnsafeCheckpointError
from reshard.formats.deepspeed import files as names, group_scalars, notes, pickles, rank_reader
from reshard.formats.deepspeed.tp_geometry import Geometry, replicated
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import MappedFiles, file_size, replica_problem
from reshard.rules import files as rule_files
from reshard.storage import files as fs

# Replicated blocks up to this size (per copy) are compared when the checkpoint is read; larger ones
# (a replicated embedding of a big vocabulary) by `validate --deep`, so reading stays metadata-cheap.
REPLICA_CHECK_BYTES = 16 << 20
# Keys of a model-states file that depend on the mp rank (the engine writes them per rank)
MP_RANK_KEYS = ("universal_checkpoint_info", "shared_params")


def read(tag_dir: str, tag: str, listing: list, model0: dict, layout_rules: str | None) -> CatalogBuilder:
    mp = int(model0.get("mp_world_size") or 1)
    dims = model0.get("checkpoint_parallel_dimensions") or {}
    tp, pp = int(dims.get("tp_degree", 1)), int(dims.get("pp_degree", 1))
    pipeline = any(names.LAYER_STATES.match(n) for n in listing)
    if not dims:                    # saves before checkpoint_parallel_dimensions: mp ranks are stages or TP ranks
        tp, pp = (1, mp) if pipeline else (mp, 1)
    if tp > 1 and pp > 1 and not pipeline:
        raise ReshardError.at(tag_dir, f"tensor and pipeline parallel together (tp={tp}, pp={pp}) without "
                                       "PipelineModule layer files are not supported")
    if tp * pp != mp:
        raise ReshardError.at(tag_dir, f"mp_world_size={mp} but the saved degrees are tp={tp}, pp={pp}")
    locals_, models, problems, files = _read_ranks(tag_dir, tag, listing, mp, model0)
    if pipeline and tp > 1:
        catalog = _merge_3d(tag_dir, listing, locals_, models, tp, pp, layout_rules)
    elif pipeline:
        catalog = _merge_stages(tag_dir, listing, locals_, models)
    else:
        geometry = _geometry(tag_dir, _first(models), layout_rules)
        catalog = _merge_tp(tag_dir, locals_, _first(models), geometry, tp)
    catalog.problems[:0] = problems
    catalog.files[:0] = files
    # what each mp rank's model states add to the training state, for writers at the same degree
    catalog.notes = replace(notes.of(catalog), mp_rank_extra={rank: {k: model[k] for k in MP_RANK_KEYS if k in model}
                                                          for rank, model in models.items()})
    catalog.layout = catalog.layout.with_degrees({"tp": tp, "pp": pp})
    return catalog


def _read_ranks(tag_dir, tag, listing, mp, model0):
    """(mp rank -> its local Catalog, None when its model-states file is missing or unreadable; mp rank -> that
    file's state dict, for the ranks read)."""
    locals_: dict[int, CatalogBuilder | None] = {}
    models: dict[int, dict[str, Any]] = {}
    problems: list[Problem] = []
    files: list[FileInfo] = []
    for rank in range(mp):
        name = names.model_states_name(rank)
        path = os.path.join(tag_dir, name)
        if not fs.exists(path):
            problems.append(Problem(path, None, READER, f"missing (expected for model-parallel rank {rank} of {mp})"))
            files.append(FileInfo(name, "model_states", None, 0))
            locals_[rank] = None
            continue
        try:
            model = rank_reader.load_or_raise(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            problems.append(Problem.of_error(e))
            locals_[rank] = None
            continue
        saved = (model.get("mp_world_size"), model.get("global_steps"))
        if saved != (mp, model0.get("global_steps")):
            problems.append(Problem(path, None, READER, f"mp_world_size {saved[0]}, global_steps {saved[1]}: not the "
                                    f"same save as the first model-parallel rank's (mp_world_size {mp}, "
                                    f"global_steps {model0.get('global_steps')})"))
        try:
            locals_[rank] = rank_reader.read_mp_rank(tag_dir, tag, listing, rank, name, model)
        except UnsafeCheckpointError:
            raise
        except ReshardError as e:           # e.g. none of its optimizer files is there
            if rank == 0 and mp == 1:
                raise
            problems.append(Problem.of_error(e))
            locals_[rank] = None
            continue
        models[rank] = model
    if all(c is None for c in locals_.values()):
        raise ReshardError(str(problems[0]) if problems else f"{tag_dir}: no model-parallel rank's files could be read")
    return locals_, models, problems, files


def _first(locals_):
    return next(c for c in locals_.values() if c is not None)


def _new_catalog(tag_dir, base: CatalogBuilder) -> CatalogBuilder:
    return CatalogBuilder(root=tag_dir, format="deepspeed", layout=base.layout, tag=base.tag, training=base.training,
                          notes=base.notes)


def _gather_files_and_problems(catalog, locals_):
    for _rank, local in sorted(locals_.items()):
        if local is None:
            continue
        catalog.files += local.files
        catalog.problems += local.problems


def _check_scalars(catalog, locals_, what):
    """The group scalars the model-parallel ranks agree on; a rank holding another value than most is named by
    its model-states file (group_scalars.agreed: with no value held by most, every rank is)."""
    # (group, key) -> [(the rank's model-states file, its value)]
    held: dict[tuple[int, str], list[tuple[str, object]]] = {}
    for rank, local in sorted(locals_.items()):
        if local is None:
            continue
        for g, scalars in enumerate(local.group_scalars):
            for key, value in scalars.items():
                held.setdefault((g, key), []).append((os.path.join(catalog.root, names.model_states_name(rank)), value))
    for (g, key), values in held.items():
        value, problems = group_scalars.agreed(values, f"param group {g}: optimizer {key} of this {what}")
        if g < len(catalog.group_scalars) and key in catalog.group_scalars[g]:
            catalog.group_scalars[g][key] = value
        for path, text in problems:
            catalog.problem(path, text)


# ------------------------------------------------------------------------------------------ tensor parallel

def _geometry(tag_dir, model, layout_rules) -> Geometry:
    info = model.get("universal_checkpoint_info")
    if isinstance(info, dict) and (info.get("affine_map") or any(k.endswith("_patterns") for k in info)):
        return Geometry.from_checkpoint(info, os.path.join(tag_dir, names.model_states_name(0)))
    if layout_rules:
        return Geometry.from_rule_file(layout_rules)
    raise ReshardError.at(tag_dir, "tensor-parallel checkpoint without universal_checkpoint_info: how each "
                                   "parameter was cut is unknown; give it with --layout-rules (a file, or "
                                   f"one shipped with reshard: {rule_files.names(rule_files.TP_RULES)})")


def _merge_tp(tag_dir, locals_, model0, geometry, tp) -> CatalogBuilder:
    """`model0`: the model states of the first rank in `locals_`."""
    base = _first(locals_)
    catalog = _new_catalog(tag_dir, base)
    _gather_files_and_problems(catalog, locals_)
    catalog.aliases = dict(model0.get("shared_params") or {})
    # every rank but the first saves an empty shared_params: the aliases of the first hold for all
    catalog.order = list(base.order)
    catalog.param_groups = [dict(g) for g in base.param_groups]
    catalog.group_scalars = [dict(s) for s in base.group_scalars]
    _check_scalars(catalog, locals_, "tensor-parallel rank")
    states, splits = base.freeze().states(), {}
    with MappedFiles() as files:
        for name, info in base.params.items():
            if name in catalog.aliases:
                continue
            shard_shapes = {r: c.params[name].shape for r, c in locals_.items()
                            if c is not None and name in c.params}
            if info.kind == "buffer":
                split = _buffer_split(geometry, name, shard_shapes, tp)
            else:
                split = geometry.split(name, shard_shapes, tp)
            catalog.params[name] = ParamInfo(name, split.full_shape, info.kind, info.group)
            splits[name] = split
            shards = {rank: {held: split.shard(rank, shape, held) for held in ("primary", "copies")}
                      for rank, shape in shard_shapes.items()}
            for state in [s for s in states if (name, s) in base.tensors]:
                _merge_tensor(catalog, locals_, name, state, split, shard_shapes, shards, files)
    catalog.notes = replace(notes.of(catalog), tp_splits=splits)
    return catalog


def _buffer_split(geometry, name, shard_shapes, tp):
    """Buffers are never cut by tensor parallelism (it cuts weights): unless a rule names them (the pattern
    lists' catch-all for params does not) they are replicated, and their copies are compared like any replica."""
    try:
        return geometry.split(name, shard_shapes, tp, fallback=False)
    except ReshardError:
        return replicated(name, shard_shapes, tp, "buffers are whole on every tensor-parallel rank")


def _merge_tensor(catalog, locals_, name, state, split, shard_shapes, shards, files):
    """`shards`: per rank, its "primary" and "copies" shards of the full tensor (tp_geometry.Split.shard)."""
    dtype = next(c.tensors[(name, state)].dtype for c in locals_.values()
                 if c is not None and (name, state) in c.tensors)
    full = catalog.add(TensorDraft(name, state, split.full_shape, dtype))
    for rank, local in sorted(locals_.items()):
        if local is None or (name, state) not in local.tensors:
            continue
        tensor = local.tensors[(name, state)]
        if tensor.shape != tuple(shard_shapes[rank]):
            catalog.problem(_file_of(tensor, local), f"{name} ({state}): shard shape {list(tensor.shape)} but the "
                            f"parameter's is {list(shard_shapes[rank])}")
            continue
        full.fragments += _on_shard(tensor.fragments, shards[rank]["primary"])
    _add_replicas(catalog, locals_, full, split, shards, files)


def _on_shard(frags, shard):
    """The rank's local fragments (flat ranges of its shard) as fragments of the full tensor: the same
    ranges, of `shard` (tp_geometry.Split.shard), which says which boxes of the full tensor they are."""
    if shard is not None and not shard.blocks:
        return []
    return [Fragment(f.start, f.stop, f.storage, f.elem_offset, f.rank, shard) for f in frags]


def _add_replicas(catalog, locals_, full, split, shards, files):
    """Blocks held by several TP ranks: each other holder's copy becomes a Replica of `full`; the small
    ones are compared now (a norm weight, a bias), the others by `validate --deep`."""
    name, state = full.name, full.state
    known: dict[Any, Any] = {}          # full's elements read for the first copy, compared with every other
    for rank, local in sorted(locals_.items()):
        tensor = local.tensors.get((name, state)) if local is not None else None
        if tensor is None:
            continue
        pieces = [p for p in split.pieces.get(rank, []) if len(p.holders) > 1 and p.holders[0] != rank]
        if not pieces:
            continue
        copy = LogicalTensor(name, state, full.shape, full.dtype,
                             tuple(_on_shard(tensor.fragments, shards[rank]["copies"])))
        holders = sorted({p.holders[0] for p in pieces})
        _replica(catalog, full, copy, f"tensor-parallel rank {rank}", f"rank {holders[0]}", files, known)


def _replica(catalog, tensor, copy, holder, first, files, known=None) -> None:
    """Record a second copy of (part of) `tensor`; compare it now when it is small."""
    small = sum(f.numel for f in copy.fragments) * itemsize(tensor.dtype) <= REPLICA_CHECK_BYTES
    replica = Replica(copy, holder, first, checked=small)
    catalog.replicas.append(replica)
    if small:
        problem = replica_problem(files, tensor, replica, known)
        if problem:
            catalog.problems.append(problem)


def _file_of(tensor, local):
    files = sorted({f.storage.file for f in tensor.fragments})
    return files[0] if files else local.root


# ------------------------------------------------------------------------------- tensor and pipeline parallel

def _merge_3d(tag_dir, listing, locals_, models, tp, pp, layout_rules) -> CatalogBuilder:
    """tp > 1 and pp > 1: mp rank r is stage r // tp, TP rank r % tp (DeepSpeed's PipelineParallelGrid orders
    the model-parallel group pipe-major). Each TP rank's stages are merged as a pipeline, with the layer files
    `layer_XX-model_{t:02d}-model_states.pt`, into a catalog of that rank's local tensors under the
    PipelineModule names; those are then put together like the TP ranks of a plain tensor-parallel save."""
    geometry = _geometry(tag_dir, _first(models), layout_rules)
    per_rank: dict[int, Any] = {}
    per_rank_model: dict[int, Any] = {}
    for t in range(tp):
        stages = {s: locals_[s * tp + t] for s in range(pp)}
        if all(c is None for c in stages.values()):
            per_rank[t] = None
            continue
        stage_models = {s: models[s * tp + t] for s in range(pp) if s * tp + t in models}
        per_rank[t] = _merge_stages(tag_dir, listing, stages, stage_models, model=t)
        per_rank_model[t] = _first(stage_models)
    # the first TP rank's notes (its stages, layers and layer files: alike on every rank) are the catalog's
    catalog = _merge_tp(tag_dir, per_rank, _first(per_rank_model), geometry, tp)
    splits = notes.of(catalog).tp_splits
    # tied copies (another stage's, a later layer file's) were found per TP rank in shard elements: re-address
    # them to full-tensor elements like the rank's own tensors, so that `validate --deep` compares the big ones
    for t, merged in sorted(per_rank.items()):
        for replica in merged.replicas if merged is not None else []:
            name, state = replica.copy.name, replica.copy.state
            full = catalog.tensors.get(TensorKey(name, state))
            if full is None or name not in splits:
                continue
            copy = LogicalTensor(name, state, full.shape, full.dtype,
                                 tuple(_on_shard(replica.copy.fragments, splits[name].shard(t, replica.copy.shape))))
            catalog.replicas.append(Replica(copy, f"{replica.holder} (tensor-parallel rank {t})",
                                            f"{replica.first}", replica.checked))
    return catalog


# ---------------------------------------------------------------------------------------- pipeline parallel

def _merge_stages(tag_dir, listing, locals_, models, model: int | None = None) -> CatalogBuilder:
    base = _first(locals_)
    catalog = _new_catalog(tag_dir, base)
    _gather_files_and_problems(catalog, locals_)
    catalog.group_scalars = [dict(s) for s in base.group_scalars]
    _check_scalars(catalog, locals_, "pipeline stage")
    holder: dict[str, int] = {}                      # param name -> the stage whose copy is used
    stages: dict[str, list[int]] = {}                # param name -> the stages whose optimizer trains it
    with MappedFiles() as files:
        for stage, local in sorted(locals_.items()):
            if local is None:
                continue
            for g, group in enumerate(local.param_groups):
                while g >= len(catalog.param_groups):
                    catalog.param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": []})
                catalog.param_groups[g]["params"] += [n for n in group["params"] if n not in holder]
            for name, info in local.params.items():
                if info.kind == "trainable":
                    stages.setdefault(name, []).append(stage)
                if name in holder:
                    _check_tied(catalog, locals_, holder[name], stage, name, files)
                    continue
                holder[name] = stage
                catalog.params[name] = info
                for key, tensor in local.tensors.items():
                    if key[0] == name:
                        catalog.tensors[key] = tensor
        layers, layer_files = _read_layers(catalog, tag_dir, listing, models, files, model)
    catalog.notes = replace(notes.of(catalog), stages=stages, layers=layers, pipe_layer_files=layer_files)
    return catalog


def _check_tied(catalog, locals_, first, stage, name, files):
    """A tied module is trained in every stage using it; each stage's copy must be the same."""
    a, b = locals_[first], locals_[stage]
    for state in a.freeze().states():
        ta, tb = a.tensors.get((name, state)), b.tensors.get((name, state))
        if ta is None or tb is None or ta.shape != tb.shape:
            catalog.problem(os.path.join(catalog.root, names.model_states_name(stage)),
                            f"{name} ({state}): tied with stage {first}, but not held alike")
            return
        _replica(catalog, ta, tb.freeze(), f"pipeline stage {stage}", f"stage {first}", files)


def _read_layers(catalog, tag_dir, listing, models, files, model=None) -> tuple:
    """Module weights and buffers from the layer files, under the PipelineModule's names (with tensor
    parallelism, `model` is the TP rank whose files `layer_XX-model_{model:02d}-...` are read). Returns (name ->
    (layer index, key in its file), layer index -> [(key, name or None)] in file order: what writers rewrite)."""
    known: set[str] = set(catalog.params)
    buffers: set[str] = set()
    for sd in models.values():
        buffers.update(sd.get("buffer_names") or [])
    known |= buffers
    layers = {}
    for n in listing:
        m = names.LAYER_STATES.match(n)
        if m:
            if (m.group(1) or None) != (None if model is None else f"-model_{model:02d}"):
                if model is None:
                    raise ReshardError.at(tag_dir, f"{n}: a layer file of a tensor-parallel rank, but the "
                                                   "save's checkpoint_parallel_dimensions say tp=1")
                continue
            layers[int(n.split("_")[1].split("-")[0])] = n
    expected = {int(k.split(".")[0]) for k in known if k.split(".")[0].isdigit()}
    for index in sorted(expected - set(layers)):
        catalog.problem(os.path.join(tag_dir, names.layer_states_name(index)),
                        f"missing (layer {index} has parameters in the pipeline stages)")
    seen, where, layer_files = set(), {}, {}
    for index in sorted(layers):
        path = os.path.join(tag_dir, layers[index])
        catalog.files.append(FileInfo(layers[index], "layer_states", None, file_size(path)))
        try:
            sd = pickles.load(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            catalog.failed(e)
            continue
        if not isinstance(sd, dict):
            catalog.problem(path, f"expected a state dict, found {type(sd).__name__}")
            continue
        prefix = _layer_prefix(index, list(sd), known)
        # what each layer file holds, in its order (tied modules in every file using them), for writers
        layer_files[index] = [(key, prefix + key if isinstance(ref, TensorRef) else None) for key, ref in sd.items()]
        for key, ref in sd.items():
            if not isinstance(ref, TensorRef):
                continue
            name = prefix + key
            if name in seen:                         # a tied module's later occurrence
                _check_same_module(catalog, name, ref, path, files)
                continue
            seen.add(name)
            where[name] = (index, key)
            if name not in catalog.params:
                kind = "buffer" if name in buffers else "frozen"
                catalog.params[name] = ParamInfo(name, tuple(ref.shape), kind)
            catalog.order.append(name)
            rank_reader.add_whole(catalog, name, MODULE, ref)
    return where, layer_files


def _layer_prefix(index, keys, known) -> str:
    """`tied_modules.KEY.` when exactly one tied module of the stages holds all these keys, else `INDEX.`."""
    tied = {k.split(".")[1] for k in known if k.startswith("tied_modules.")}
    matches = [t for t in sorted(tied) if all(f"tied_modules.{t}.{k}" in known for k in keys if k)]
    own = any(f"{index}.{k}" in known for k in keys)
    if len(matches) == 1 and not own:
        return f"tied_modules.{matches[0]}."
    return f"{index}."


def _check_same_module(catalog, name, ref, path, files):
    first = catalog.tensors.get((name, MODULE))
    if first is None or tuple(first.shape) != tuple(ref.shape) or first.dtype != ref.dtype:
        catalog.problem(path, f"{name}: tied module copy has another shape or dtype than its first occurrence")
        return
    other = LogicalTensor(name, MODULE, tuple(ref.shape), ref.dtype,
                          (Fragment(0, ref.numel, ref.storage, ref.storage_offset),) if ref.numel else ())
    _replica(catalog, first, other, os.path.basename(path), "its first occurrence", files)

