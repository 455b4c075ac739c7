"""A DCP directory -> Catalog, from `.metadata` and each chunk archive's zip directory only.

Every tensor chunk is a box (offsets, sizes) of the global tensor stored as a torch.save zip at
[offset, offset + length) of a `.distcp` file; we parse that zip in place (torchsave_read with a span)
to find where its one storage starts, and cut the box into the flat row-major runs the Catalog
holds (a dim-0 shard is a single run). Keys follow `get_state_dict` + `dcp.save`:

  [model.]<fqn>                         -> (fqn, MODULE), and (fqn, MASTER) for an fp32 trainable param
  optim.state.<fqn>.<state>             -> (fqn, state)
  optim.state.<fqn>.step                -> group_scalars[group]["step"], each param's own (PerParamScalar)
  optim.param_groups.<g>.<hyper|params> -> param_groups  (default get_state_dict)
  optim.param_groups.<fqn>.<hyper>      -> param_groups  (flatten_optimizer_state_dict=True)
  reshard.<optimizer|counter>           -> catalog.training (what reshard's DCP writer carries)
  lr_scheduler.*, dataloader.*, train_state.* in a torchtitan folder (torchtitan.py) -> DcpNotes.own, carried by
                                          the torchtitan writer; train_state.step is the global step
  any other key                         -> DcpNotes.other_keys (carried by no writer yet)

DCP does not record which model entries are buffers, frozen params or tied names. An entry the
optimizer does not name is taken for a frozen param when it is floating and either sharded
(FSDP cuts params over the ranks; buffers are replicated, so DCP saves them as one whole chunk)
or saved by a single rank; otherwise for a buffer. One row is one chunk either way: it is taken for a
frozen param and listed in `catalog.maybe_buffers` (ZeRO-3, which stores the two apart, refuses it).
A tied name looks like a frozen param.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from reshard.core.catalog import MASTER, MODULE, Catalog, CatalogBuilder, ParamInfo, TensorDraft, TrainingState
from reshard.core.dtypes import is_floating
from reshard.core.layout import Layout
from reshard.core.placement import Shard, through
from reshard.errors import CheckpointError, UnprovenMappingError
from reshard.formats.dcp import metadata as md, torchtitan
from reshard.formats.dcp.chunks import CARRIED, CARRIED_PREFIX, METADATA, MISSING, RANK_FILE, Chunks
from reshard.formats.framework.files import Framework
from reshard.formats.protocol import ConfigOption
from reshard.formats.unpartitioned import UNPARTITIONED
from reshard.storage import files as fs

MODEL_KEYS = ("model", "state_dict")     # the model's top-level key: get_state_dict's, Lightning's ModelParallel
OPTIM_PREFIXES = ("optim.", "optimizer.", "optimizer_0.")     # get_state_dict, Accelerate, Lightning
FORMAT = "dcp"
OPTIONS = ConfigOption    # one directory is one checkpoint: no tag; a model config for torchtitan's fused q/k/v
IN_FRAMEWORK_FOLDERS = False


@dataclass(frozen=True)
class DcpNotes:
    """What a DCP directory holds beside model and optimizer: the keys no writer carries, and a torchtitan
    folder's own entries (torchtitan.OwnEntry), which its writer carries."""
    other_keys: tuple = ()
    own: tuple = ()
    fused: tuple = ()       # the fused parameters (torchtitan.Part lists) whose optimizer state was read as parts

    def param_details(self, name: str) -> dict:
        return {}

    def scalars(self) -> dict:
        return {e.key: e.value for e in self.own}       # other_keys are names: their values are not read

    def own_entries(self) -> list[dict]:
        return [e.to_dict() for e in self.own]

    def layout_scalar(self, key: str, value) -> bool:
        return False


def sniff(path: str, tag: str | None) -> bool:
    if not fs.isdir(path):
        return False
    if fs.isfile(os.path.join(path, METADATA)):
        return True
    return any(RANK_FILE.search(n) for n in fs.listdir(path))


def read(path: str, options: ConfigOption) -> Catalog:
    root = fs.abspath(path)
    meta_path = os.path.join(root, METADATA)
    if not fs.isfile(meta_path):
        raise CheckpointError(meta_path, "missing: DCP writes .metadata last, so the save did not finish")
    meta = md.read(meta_path)
    catalog = CatalogBuilder(root, "dcp", Layout.of(1), save_dir=root)
    return build(catalog, meta, Chunks(root, meta, catalog), options.config)


def build(catalog: CatalogBuilder, meta, chunks: Chunks, config: str | None = None) -> Catalog:
    """The catalog of the DCP items `meta` names (one folder's `.metadata`, or several joined: chunks.joined),
    located by `chunks`. Where planner_data records an item's path in the nested state dict, the parameter's name
    is taken from it, never split out of the flat key (a name may hold dots). `config`: the model's config.json,
    which places a torchtitan save's fused q/k/v optimizer state on the model's parameters."""
    planner = meta.planner_data if isinstance(getattr(meta, "planner_data", None), dict) else {}
    values, model, optim = {}, {}, {}
    for key, entry in meta.state_dict_metadata.items():     # types checked by md.read
        if isinstance(entry, md.BytesStorageMetadata):
            values[key] = entry
        elif key.startswith(tuple(p + "state." for p in OPTIM_PREFIXES)):
            optim[key] = entry
        else:
            model[key] = entry
    titan = torchtitan.is_torchtitan(meta.state_dict_metadata)
    own = _own(values, planner, chunks) if titan else ()
    model_names = _model_names(model, planner)
    carried = _carried(values, chunks)
    other = [k for k in meta.state_dict_metadata if k not in model_names and k not in optim
             and not k.startswith(tuple(p + "param_groups." for p in OPTIM_PREFIXES))
             and k not in {f"{CARRIED_PREFIX}.{c}" for c in carried} and not (titan and torchtitan.owns(k))]
    model = {k: v for k, v in model.items() if k in model_names}
    groups = _param_groups(planner, values, chunks)
    fused = _fused(groups, model, model_names, config) if titan else {}
    group_of = {name: g for g, group in enumerate(groups) for name in group["params"]}
    catalog.param_groups = groups
    world = chunks.world()
    catalog.aliases = _ties(model, model_names, group_of, chunks)
    for key, entry in model.items():
        name = model_names[key]
        if name in catalog.aliases:
            catalog.order.append(name)
            continue
        tensor = chunks.tensor(key, entry, name, MODULE)
        trainable = name in group_of
        sharded = len(entry.chunks) > 1 or world == 1
        # one row is one chunk however many ranks shard it: a frozen param or a buffer, DCP does not say
        unsure = not sharded and is_floating(tensor.dtype) and (not tensor.shape or tensor.shape[0] == 1)
        kind = "trainable" if trainable else ("frozen" if is_floating(tensor.dtype) and (sharded or unsure)
                                              else "buffer")
        if unsure and not trainable:
            catalog.maybe_buffers.append(name)
        catalog.params[name] = ParamInfo(name, tensor.shape, kind, group_of.get(name))
        catalog.order.append(name)
        if trainable and tensor.dtype == "float32":
            catalog.add(TensorDraft(name, MASTER, tensor.shape, tensor.dtype, list(tensor.fragments)))
    groups_key = next((k for k in values if k.startswith(tuple(p + "param_groups." for p in OPTIM_PREFIXES))), "")
    for name in group_of:
        if name not in catalog.params:
            lacks = f"the optimizer names {name}, which the model state dict lacks"
            if titan and torchtitan.part_names(name) and config is None:
                # nothing is missing: which rows are q, k and v is not known without the config, so the save is
                # not proven whole, nor proven incomplete (`list` keeps it unverifiable, never deleted)
                raise UnprovenMappingError(chunks.meta_of(groups_key), f"{lacks} (torchtitan's fused q, k and v: "
                                           "--config, the model's config.json, gives its key-value head count)")
            catalog.problem(chunks.meta_of(groups_key), lacks)
    catalog.group_scalars = [{} for _ in groups]
    for key, entry in optim.items():
        fqn, state = _state_of(key, planner)
        parts = fused.get(fqn)
        if fqn not in group_of and not parts:
            catalog.problem(chunks.meta_of(key), f"{key}: optimizer state of a parameter no param group holds")
            continue
        if state == "step" and not entry.size:
            step = chunks.scalar(key, entry)
            if step is not None:      # Adam counts steps per param: FSDP's get_state_dict saves each its own
                for name in [p.name for p in parts] if parts else [fqn]:
                    catalog.record_param_scalar(group_of[name], name, state, step, chunks.meta_of(key))
        elif parts:
            _add_parts(catalog, chunks.tensor(key, entry, fqn, state), parts)
        else:
            chunks.tensor(key, entry, fqn, state)
    catalog.files = chunks.files()
    if titan:
        step = next((e.value for e in own if e.key == torchtitan.STEP), None)
        if isinstance(step, int) and not isinstance(step, bool):
            carried = {**carried, "global_steps": step}
        catalog.framework = Framework(torchtitan.NAME, catalog.root, (), (), world=world, backend=torchtitan.BACKEND)
    _finish(catalog, world, carried)
    catalog.notes = DcpNotes(tuple(other), own, tuple(fused.values()))
    return catalog.freeze()


def _own(values: dict, planner: dict, chunks) -> tuple:
    """A torchtitan folder's own entries (torchtitan.OwnEntry), in the order saved."""
    out = []
    for key in values:
        if not torchtitan.owns(key):
            continue
        blob, value = chunks.blob(key), chunks.value(key)
        if blob is MISSING or value is MISSING:
            continue
        path = planner.get(key)
        out.append(torchtitan.OwnEntry(key, tuple(path) if isinstance(path, (tuple, list)) else tuple(key.split(".")),
                                       blob, value))
    return tuple(out)


def _fused(groups: list, model: dict, names: dict, config: str | None) -> dict:
    """{fused parameter: its torchtitan.Part list} for each parameter the optimizer names whose parts the model
    saved (torchtitan's wqkv as wq, wk, wv), each group naming the parts in its place; {} without a `config`
    (the parameter is then reported as one the model lacks), and a one-line refusal where the config's head count
    does not cut the shapes."""
    shapes = {names[k]: tuple(int(d) for d in entry.size) for k, entry in model.items() if k in names}
    fused = {}
    for group in groups:
        for name in group["params"]:
            parts = torchtitan.part_names(name)
            if name in shapes or not parts or not all(p in shapes for p in parts) or config is None:
                continue
            found = torchtitan.fused_parts(_fused_shape(name, model, names), {p: shapes[p] for p in parts},
                                           torchtitan.heads_of(config))
            if isinstance(found, str):
                raise CheckpointError(config, f"{name}: {found}")
            fused[name] = found
        group["params"] = [p for name in group["params"]
                           for p in ([part.name for part in fused[name]] if name in fused else [name])]
    return fused


def _fused_shape(name: str, model: dict, names: dict) -> tuple:
    """The fused parameter's shape: its parts' rows summed (the optimizer's state has it too, but a parameter
    without a state yet must still be placed)."""
    shapes = [tuple(int(d) for d in model[k].size) for k in names if names[k] in torchtitan.part_names(name)]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _add_parts(catalog: CatalogBuilder, whole: TensorDraft, parts: tuple) -> None:
    """The fused state `whole` (just read) replaced by each part's: the same fragments, each shard's blocks seen
    through the part's rows (placement.through); a fragment holding none of a part's rows is not the part's."""
    del catalog.tensors[whole.key]
    if whole.shape[0] != sum(p.shape[0] for p in parts):
        raise CheckpointError(catalog.root, f"{whole.name} ({whole.state}): {list(whole.shape)}, not its "
                                            "parameter's shape")
    for part in parts:
        fragments = []
        for fragment in whole.fragments:
            shard = through(fragment.shard or Shard.whole(whole.shape), part.view)
            if shard.blocks:
                fragments.append(replace(fragment, shard=shard))
        catalog.add(TensorDraft(part.name, whole.state, part.shape, whole.dtype, fragments))


def _ties(model: dict, names: dict, group_of: dict, chunks) -> dict:
    """{tied name: holder}: model entries whose chunks are the very same bytes (as reshard writes a
    tied weight). The holder is the one the optimizer names, else the first in model order."""
    by_bytes: dict[Any, list[str]] = {}
    for key, entry in model.items():
        where = chunks.signature(key, entry)
        if where:
            by_bytes.setdefault(where, []).append(names[key])
    ties = {}
    for tied in by_bytes.values():
        holder = next((n for n in tied if n in group_of), tied[0])
        ties.update({n: holder for n in tied if n != holder})
    return ties


def _state_of(key: str, planner: dict) -> tuple[str, str]:
    """(parameter FQN, state name) of an optimizer state's flat key: from its planner_data path
    (optim, "state", fqn, state) where recorded, else split off the key (the FQN between "state." and the last dot)."""
    path = planner.get(key)
    if isinstance(path, tuple) and len(path) == 4 and path[1] == "state" and all(isinstance(p, str) for p in path):
        return path[2], path[3]
    fqn, _, state = key.split(".", 2)[2].rpartition(".")
    return fqn, state


def _model_names(model: dict, planner: dict) -> dict:
    """Flat key -> FQN of the model's tensors: those under "model." ({"model": get_state_dict(...)[0]}; Lightning's
    ModelParallelStrategy: "state_dict."), other top-level entries being someone else's, else every tensor outside
    the optimizer. The FQN is planner_data's (top, fqn) where recorded."""
    top = next((t for t in MODEL_KEYS if any(k.startswith(f"{t}.") for k in model)), None)
    if top is not None:
        out = {}
        for key in model:
            path = planner.get(key)
            if isinstance(path, tuple) and len(path) == 2 and path[0] == top and isinstance(path[1], str):
                out[key] = path[1]
            elif key.startswith(f"{top}."):
                out[key] = key[len(f"{top}."):]
        return out
    return {k: k for k in model}


def _param_groups(planner: dict, values: dict, chunks) -> list:
    """Optimizer param groups from the value entries, in either of get_state_dict's spellings."""
    indexed: dict[int, dict[str, Any]] = {}
    by_fqn: dict[str, Any] = {}
    for key in values:
        prefix = next((p for p in OPTIM_PREFIXES if key.startswith(p + "param_groups.")), None)
        if prefix is None:
            continue
        rest = key[len(prefix + "param_groups."):]
        path = planner.get(key)
        value = chunks.value(key)
        if value is MISSING:
            continue
        head, _, tail = rest.partition(".")
        if isinstance(path, tuple) and len(path) == 4 and isinstance(path[2], int):
            indexed.setdefault(path[2], {})[path[3]] = value
        elif not path and head.isdigit() and f"{prefix}param_groups.{head}.params" in values:
            indexed.setdefault(int(head), {})[tail] = value     # no planner_data: the index spelling
        else:
            fqn, _, hyper = rest.rpartition(".")
            by_fqn.setdefault(fqn, {})[hyper] = value
    groups = [indexed[g] for g in sorted(indexed)]
    for g, group in enumerate(groups):
        if not isinstance(group.get("params"), list):
            chunks.catalog.problem(chunks.meta_of(next(iter(values), "")),
                                   f"param group {g} has no readable list of parameter names")
            group["params"] = []
        group["params"] = [str(p) for p in group["params"]]
    for fqn, hyper in by_fqn.items():     # flattened: one entry per param; equal hyper-params = one group
        for group in groups:
            if {k: v for k, v in group.items() if k != "params"} == hyper:
                group["params"].append(fqn)
                break
        else:
            groups.append({**hyper, "params": [fqn]})
    return groups


def _carried(values: dict, chunks) -> dict:
    """What reshard saved of the source beyond model and optimizer (chunks.CARRIED), type-checked."""
    out = {}
    for key, kind in CARRIED.items():
        if f"{CARRIED_PREFIX}.{key}" not in values:
            continue
        value = chunks.value(f"{CARRIED_PREFIX}.{key}")
        if value is MISSING:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            chunks.catalog.problem(chunks.meta_of(f"{CARRIED_PREFIX}.{key}"),
                                   f"{CARRIED_PREFIX}.{key} is {type(value).__name__}, not {kind.__name__}")
            continue
        out[key] = value
    return out


def _finish(catalog: CatalogBuilder, world: int, carried: dict) -> None:
    dtype, master_dtype = catalog.freeze().weight_dtypes()
    catalog.layout = Layout.of(world, dtype=dtype, master_dtype=master_dtype, format_topology=UNPARTITIONED)
    step = catalog.freeze().contents().step
    # the source's own counters where reshard carried them, else the optimizer's step
    catalog.training = TrainingState(**{"global_steps": step, **carried})
