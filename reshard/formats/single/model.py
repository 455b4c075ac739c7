"""A model state dict (+ a torch.optim state dict) -> Catalog, shared by every single-process reader.

The state dict gives names, shapes, dtypes and byte locations; the optimizer gives, per integer
index, its per-element states and step. `optim_map.assign` says which name each index is. Then:
- a tied alias is a later key whose tensor is the very same view of the same storage as an earlier
  one (torch.save keeps the sharing), or one the reader names;
- trainable = taken by an optimizer group; fp32 trainable params register MASTER and MODULE over
  the same bytes (there is no separate master copy);
- a buffer: what the model class says is one (HF, from config.json), or not taken and not floating
  point; not taken and floating point = frozen (a floating buffer such as BatchNorm's running mean
  looks the same: `catalog.maybe_buffers` lists them; ZeRO-1/2 keep both whole in the module
  copy, ZeRO-3 partitions frozen params only, so the DeepSpeed writer refuses ZeRO-3 then);
- weights only (no optimizer): nothing is known to be trained; every floating tensor is listed as
  frozen and conversion to a training format is refused;
- scalars of the optimizer state (Adam's `step`) are each param's own (PerParamScalar): torch.optim
  counts them per param, and a param that had no gradient for some steps has a smaller count.
"""
from __future__ import annotations

import os
from dataclasses import replace

from reshard.core.catalog import (
    MASTER,
    MODULE,
    CatalogBuilder,
    FileInfo,
    Fragment,
    ParamInfo,
    ScalarTensor,
    TensorDraft,
)
from reshard.core.dtypes import is_floating
from reshard.errors import CheckpointError
from reshard.execution.source_bytes import file_size, read_scalar
from reshard.formats.single import optim_map
from reshard.formats.torchsave_read import TensorRef
from reshard.storage import files as fs

STEP = "step"
NAMES = "param_names"     # saved by torch.optim when built from named_parameters()


def add_file(catalog: CatalogBuilder, path: str, role: str) -> None:
    folder = catalog.root if fs.isdir(catalog.root) else os.path.dirname(catalog.root)
    catalog.files.append(FileInfo(os.path.relpath(path, folder), role, None, file_size(path)))


def build(catalog: CatalogBuilder, module: dict, where: str, optimizer=None, optim_where: str = "", aliases=None,
          order=None, buffers=None, order_known: bool = True) -> None:
    """Fill `catalog` from `module` ({key: TensorRef}, model order) and a torch.optim state dict;
    `aliases` and `order` (all state-dict keys, aliases too) when the reader knows ties the files omit;
    `buffers` when it knows which keys are buffers (else: see the module docstring); `order_known` False where
    `module` is not in the model's order (safetensors lose it): the optimizer's entries are then mapped by shape."""
    aliases = dict(aliases or {})
    tensors: dict[str, TensorRef] = {}
    views: dict[tuple, str] = {}        # (file, offset, storage offset, shape, stride) -> the first key
    for key, ref in module.items():
        if not isinstance(ref, TensorRef):
            catalog.problem(where, f"state dict entry {key!r} is not a tensor ({type(ref).__name__}); left out")
            continue
        view = (ref.storage.file, ref.storage.offset, ref.storage_offset, tuple(ref.shape), tuple(ref.stride))
        if view in views:       # torch.save kept the sharing: the same view of the same storage
            aliases[key] = views[view]
        elif key not in aliases:
            views[view] = key
            tensors[key] = ref
    catalog.aliases = aliases
    catalog.order = [k for k in (order or module) if k in tensors or k in aliases]
    known = buffers is not None
    buffers = set(buffers or ())
    params = {k: r for k, r in tensors.items() if k not in buffers}
    taken = _map_optimizer(catalog, params, optimizer, optim_where, order_known) if optimizer is not None else {}
    guessed = []
    for key, ref in tensors.items():
        if key in taken:
            kind, group = "trainable", taken[key][0]
        elif key in buffers or not is_floating(ref.dtype):
            kind, group = "buffer", None
        else:
            kind, group = "frozen", None
            if not known:
                guessed.append(key)
        catalog.params[key] = ParamInfo(key, tuple(ref.shape), kind, group)
        _add(catalog, key, MODULE, ref)
        if kind == "trainable":
            _add(catalog, key, MASTER, ref)
    if optimizer is not None and guessed:
        # A floating-point entry the optimizer does not train: a frozen param or a float buffer (BatchNorm's
        # running mean); the state dict does not say which. Writers that store the two differently refuse.
        catalog.maybe_buffers = guessed
    if optimizer is not None:
        _fill_optimizer(catalog, optimizer, optim_where, taken)
    _fill_layout(catalog)


def _add(catalog, name, state, ref, dtype=None) -> None:
    if not ref.is_contiguous():
        catalog.problem(ref.storage.file, f"{name} ({state}): non-contiguous tensor; cannot be addressed as one range")
        return
    tensor = catalog.add(TensorDraft(name, state, tuple(ref.shape), dtype or ref.dtype), ref.storage.file)
    if ref.numel:
        tensor.fragments.append(Fragment(0, ref.numel, ref.storage, ref.storage_offset))


def _groups(optimizer, where) -> list:
    try:
        groups = optimizer["param_groups"]
        state = optimizer.get("state") or {}
        ids = [list(g["params"]) for g in groups]
    except (TypeError, KeyError, AttributeError):
        raise CheckpointError(where, "optimizer state is not a torch.optim state_dict (state, param_groups)") from None
    flat = [i for g in ids for i in g]
    if len(set(flat)) != len(flat):
        raise CheckpointError(where, "optimizer param_groups list a parameter index twice")
    if set(state) - set(flat):
        raise CheckpointError(where, f"optimizer state has entries for indices {sorted(set(state) - set(flat))[:5]} "
                              "that no param group lists")
    return ids


def _element_states(entry) -> dict:
    """The per-element states of one optimizer entry (tensors with more than a scalar's shape)."""
    return {k: v for k, v in (entry or {}).items() if isinstance(v, TensorRef) and v.shape != ()}


def _map_optimizer(catalog, tensors, optimizer, where, order_known: bool = True) -> dict:
    ids = _groups(optimizer, where)
    state = optimizer.get("state") or {}
    shapes = []
    for group in ids:
        row = []
        for i in group:
            per_element = [tuple(v.shape) for v in _element_states(state.get(i)).values()]
            if len(set(per_element)) > 1:
                raise CheckpointError(where, f"optimizer entry {i}: its states have different shapes {per_element}")
            row.append(per_element[0] if per_element else optim_map.WILDCARD)
        shapes.append(row)
    named = [g.get(NAMES) for g in optimizer["param_groups"]]
    if all(isinstance(i, str) for group in ids for i in group):
        named = ids     # FSDP's optim_state_dict names each param by its FQN
    if all(isinstance(n, list) and len(n) == len(i) for n, i in zip(named, ids, strict=True)):
        return _by_saved_names(where, tensors, catalog.aliases, named, shapes)
    candidates = [(k, tuple(r.shape)) for k, r in tensors.items() if is_floating(r.dtype)]
    if not order_known:
        return optim_map.by_shapes(where, candidates, shapes)
    return optim_map.assign(where, candidates, shapes)


def _by_saved_names(where, tensors, aliases, named, shapes) -> dict:
    """torch.optim built from named_parameters() saves the names (`param_names`): no inference needed."""
    out = {}
    for g, names in enumerate(named):
        for pos, name in enumerate(names):
            key = aliases.get(name, name)
            if key not in tensors:
                raise CheckpointError(where, f"the optimizer names parameter {name!r}, which the model state dict "
                                      "lacks")
            if shapes[g][pos] not in (optim_map.WILDCARD, tuple(tensors[key].shape)):
                raise CheckpointError(where, f"the optimizer state of {name!r} has shape {list(shapes[g][pos])}, "
                                      f"the parameter {list(tensors[key].shape)}")
            if key in out:
                raise CheckpointError(where, f"the optimizer names parameter {name!r} twice")
            out[key] = (g, pos)
    return out


def _fill_optimizer(catalog, optimizer, where, taken) -> None:
    ids = _groups(optimizer, where)
    state = optimizer.get("state") or {}
    by_index = {ids[g][pos]: name for name, (g, pos) in taken.items()}
    catalog.param_groups, catalog.group_scalars = [], [{} for _ in ids]
    for g, group in enumerate(optimizer["param_groups"]):
        names = [by_index[i] for i in ids[g]]
        hyper = {k: v for k, v in group.items() if k not in ("params", NAMES)}
        catalog.param_groups.append({**hyper, "params": names})
        for i in ids[g]:
            entry = state.get(i) or {}
            name = by_index[i]
            for key, value in entry.items():
                if isinstance(value, TensorRef) and value.shape != ():
                    _add(catalog, name, key, value)     # optim_map checked it has the param's shape
                    continue
                if isinstance(value, TensorRef):
                    value = ScalarTensor(read_scalar(value), value.dtype)
                catalog.record_param_scalar(g, name, key, value, where)


def _fill_layout(catalog) -> None:
    layout = catalog.layout
    # no separate master: the optimizer updated the params as saved (pure bf16 training: bf16); a
    # DeepSpeed target widens them to its fp32 master, the same values
    dtype, master_dtype = catalog.freeze().weight_dtypes()
    catalog.layout = replace(layout, dtype=dtype, master_dtype=master_dtype)
