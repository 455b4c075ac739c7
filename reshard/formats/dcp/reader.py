"""A DCP directory -> Catalog, from `.metadata` and each chunk archive's zip directory only.

Every tensor chunk is a box (offsets, sizes) of the global tensor stored as a torch.save zip at
[offset, offset + length) of a `.distcp` file; we parse that zip in place (torchzip with a span)
to find where its one storage starts, and cut the box into the flat row-major runs the Catalog
holds (a dim-0 shard is a single run). Keys follow `get_state_dict` + `dcp.save`:

  [model.]<fqn>                         -> (fqn, MODULE), and (fqn, MASTER) for an fp32 trainable param
  optim.state.<fqn>.<state>             -> (fqn, state)
  optim.state.<fqn>.step                -> group_scalars[group]["step"] (equal within the group)
  optim.param_groups.<g>.<hyper|params> -> param_groups  (default get_state_dict)
  optim.param_groups.<fqn>.<hyper>      -> param_groups  (flatten_optimizer_state_dict=True)

DCP does not record which model entries are buffers, frozen params or tied names. An entry the
optimizer does not name is taken for a frozen param when it is floating and either sharded
(FSDP cuts params over the ranks; buffers are replicated, so DCP saves them as one whole chunk)
or saved by a single rank; otherwise for a buffer. A tied name looks like a frozen param.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np

from reshard.catalog import MASTER, MODULE, Catalog, FileInfo, Fragment, LogicalTensor, ParamInfo, ScalarTensor
from reshard.dtypes import is_floating, itemsize, numpy_carrier
from reshard.errors import CheckpointError
from reshard.formats import torchzip
from reshard.formats.dcp import metadata as md
from reshard.formats.dcp.geometry import flat_runs
from reshard.formats.torchzip import DType, TensorRef
from reshard.layout import Layout

METADATA = ".metadata"
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")
OPTIM_PREFIXES = ("optim.", "optimizer.")
_ADAM_STATES = {"exp_avg", "exp_avg_sq"}
MISSING = object()      # a value whose bytes could not be read (the reason is a catalog problem)


def sniff(path: str, tag: str | None) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, METADATA)):
        return True
    return any(_RANK_FILE.search(n) for n in os.listdir(path))


def read(path: str, tag: str | None = None) -> Catalog:
    root = os.path.abspath(path)
    meta_path = os.path.join(root, METADATA)
    if not os.path.isfile(meta_path):
        raise CheckpointError(meta_path, "missing: DCP writes .metadata last, so the save did not finish")
    meta = md.read(meta_path)
    catalog = Catalog(root, "dcp", Layout(dp=1), save_dir=root)
    chunks = _Chunks(root, meta, catalog)
    values, model, optim = {}, {}, {}
    for key, entry in meta.state_dict_metadata.items():     # types checked by md.read
        if isinstance(entry, md.BytesStorageMetadata):
            values[key] = entry
        elif key.startswith(tuple(p + "state." for p in OPTIM_PREFIXES)):
            optim[key] = entry
        else:
            model[key] = entry
    model_names = _model_names(model)
    other = [k for k in meta.state_dict_metadata if k not in model_names and k not in optim
             and not k.startswith(tuple(p + "param_groups." for p in OPTIM_PREFIXES))]
    model = {k: v for k, v in model.items() if k in model_names}
    groups = _param_groups(meta, values, chunks, meta_path)
    group_of = {name: g for g, group in enumerate(groups) for name in group["params"]}
    catalog.param_groups = groups
    world = chunks.world()
    for key, entry in model.items():
        name = model_names[key]
        tensor = chunks.tensor(key, entry, name, MODULE)
        trainable = name in group_of
        sharded = len(entry.chunks) > 1 or world == 1
        kind = "trainable" if trainable else ("frozen" if is_floating(tensor.dtype) and sharded else "buffer")
        catalog.params[name] = ParamInfo(name, tensor.shape, kind, group_of.get(name))
        catalog.order.append(name)
        if trainable and tensor.dtype == "float32":
            catalog.add(LogicalTensor(name, MASTER, tensor.shape, tensor.dtype, list(tensor.fragments)))
    for name in group_of:
        if name not in catalog.params:
            catalog.problem(meta_path, f"the optimizer names {name}, which the model state dict lacks")
    steps = [dict() for _ in groups]
    for key, entry in optim.items():
        fqn, _, state = key.split(".", 2)[2].rpartition(".")
        if fqn not in group_of:
            catalog.problem(meta_path, f"{key}: optimizer state of a parameter no param group holds")
            continue
        if state == "step" and not entry.size:
            step = chunks.scalar(key, entry)
            if step is not None:
                steps[group_of[fqn]][fqn] = step
        else:
            chunks.tensor(key, entry, fqn, state)
    catalog.group_scalars = [_group_step(meta_path, g, s, catalog) for g, s in enumerate(steps)]
    catalog.files = chunks.files()
    _finish(catalog, world)
    catalog.state["dcp_other_keys"] = other     # not model, not optimizer: carried by no writer yet
    return catalog


def _model_names(model: dict) -> dict:
    """Flat key -> FQN of the model's tensors: those under "model." ({"model": get_state_dict(...)[0]},
    other top-level entries being someone else's), else every tensor outside the optimizer."""
    if any(k.startswith("model.") for k in model):
        return {k: k[len("model."):] for k in model if k.startswith("model.")}
    return {k: k for k in model}


def _param_groups(meta, values: dict, chunks, meta_path) -> list:
    """Optimizer param groups from the value entries, in either of get_state_dict's spellings."""
    planner = meta.planner_data if isinstance(getattr(meta, "planner_data", None), dict) else {}
    indexed, by_fqn = {}, {}
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
            chunks.catalog.problem(meta_path, f"param group {g} has no readable list of parameter names")
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


def _group_step(meta_path, g: int, steps: dict, catalog) -> dict:
    values = {(s.value, s.dtype) for s in steps.values()}
    if not values:
        return {}
    if len(values) > 1:
        catalog.problem(meta_path, f"param group {g} has unequal per-parameter step counters "
                        f"{sorted(v for v, _ in values)}; reshard keeps one step per group")
    value, dtype = min(values)
    return {"step": ScalarTensor(value, dtype)}


class _Chunks:
    """Locates every item of `.metadata` in its `.distcp` file, checking paths and ranges."""

    def __init__(self, root: str, meta, catalog: Catalog):
        self.root, self.catalog = root, catalog
        self.meta_path = os.path.join(root, METADATA)
        self.by_fqn = {}
        self.sizes = {}
        for index, info in meta.storage_data.items():
            self.by_fqn.setdefault(index.fqn, []).append((getattr(index, "offset", None), info))
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(self.meta_path, f"{index.fqn}: transformed (e.g. compressed) chunks "
                                      f"({info.transform_descriptors}) are not supported")
            self.sizes.setdefault(self._path(info), None)
        for path in self.sizes:
            try:
                self.sizes[path] = os.path.getsize(path)
            except OSError:
                catalog.problem(path, "missing (named in .metadata)")

    def world(self) -> int:
        """How many ranks saved the checkpoint, from the `__<rank>_<n>.distcp` names."""
        ranks = [_rank(path) for path in self.sizes]
        return max((r for r in ranks if r is not None), default=0) + 1

    def _path(self, info) -> str:
        rel = info.relative_path
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/") \
                or not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise CheckpointError(self.meta_path, f"chunk location {rel!r:.80} escapes the checkpoint directory "
                                  "or is malformed")
        return os.path.join(self.root, rel)

    def _located(self, key: str, offset=None):
        for saved_offset, info in self.by_fqn.get(key, ()):
            if offset is None or tuple(saved_offset or ()) == tuple(offset):
                return self._path(info), info
        return None, None

    def _span_problem(self, key, path, info) -> str | None:
        """What is wrong with the byte range of an item, if anything."""
        size = self.sizes.get(path)
        if size is None:
            return "missing (named in .metadata)"
        if info.offset < 0 or info.length <= 0 or info.offset + info.length > size:
            return (f"truncated or wrong offsets: {key} lies at bytes [{info.offset}, "
                    f"{info.offset + info.length}) of a {size}-byte file")
        return None

    def _span(self, key, path, info) -> bool:
        problem = self._span_problem(key, path, info)
        if problem and self.sizes.get(path) is not None:    # a missing file is already a problem
            self.catalog.problem(path, problem)
        return problem is None

    def _item(self, key):
        """(path, info) of a one-chunk item (a value, a step); None (a problem noted) if unreadable."""
        path, info = self._located(key)
        if path is None:
            self.catalog.problem(self.meta_path, f"{key}: no storage location")
            return None, None
        return (path, info) if self._span(key, path, info) else (None, None)

    def tensor(self, key: str, entry, name: str, state: str) -> LogicalTensor:
        dtype = _dtype(entry, self.meta_path, key)
        shape = tuple(int(d) for d in entry.size)
        tensor = self.catalog.add(LogicalTensor(name, state, shape, dtype))
        for chunk in entry.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            sizes = tuple(int(s) for s in chunk.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                    any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
                self.catalog.problem(self.meta_path, f"{key}: chunk at {offsets} of size {sizes} lies outside "
                                     f"the tensor's shape {shape}")
                continue
            if not math.prod(sizes):
                continue
            path, info = self._located(key, offsets)
            if path is None:
                self.catalog.problem(self.meta_path, f"{key}: no storage location for the chunk at {offsets}")
                continue
            if not self._span(key, path, info):
                continue
            ref = self._ref(key, path, info)
            if ref is None:
                continue
            if ref.dtype != dtype or ref.shape != sizes or not ref.is_contiguous():
                self.catalog.problem(path, f"{key}: the chunk at byte {info.offset} holds {ref.dtype}{list(ref.shape)}, "
                                     f".metadata says {dtype}{list(sizes)} (contiguous)")
                continue
            rank = _rank(info.relative_path)
            for start, count, elem in flat_runs(shape, offsets, sizes):
                tensor.fragments.append(Fragment(start, start + count, ref.storage,
                                                 ref.storage_offset + elem, rank))
        return tensor

    def _ref(self, key, path, info):
        try:
            ref = torchzip.load(path, span=(info.offset, info.length))
        except CheckpointError as e:
            if isinstance(e, torchzip.UnsafeCheckpointError):
                raise
            self.catalog.problem(path, f"{key}: damaged chunk at byte {info.offset} ({e.problem})")
            return None
        if not isinstance(ref, TensorRef):
            self.catalog.problem(path, f"{key}: the chunk at byte {info.offset} is not a tensor")
            return None
        return ref

    def scalar(self, key: str, entry) -> ScalarTensor | None:
        """A one-element tensor (an optimizer `step`): its value is read, 8 bytes at most."""
        dtype = _dtype(entry, self.meta_path, key)
        path, info = self._item(key)
        if path is None:
            return None
        ref = torchzip.load(path, span=(info.offset, info.length))
        if not isinstance(ref, TensorRef) or ref.numel != 1 or ref.dtype != dtype:
            raise CheckpointError(path, f"{key}: the step counter is not a one-element {dtype} tensor")
        with open(path, "rb") as f:
            f.seek(ref.storage.offset + ref.storage_offset * itemsize(ref.dtype))
            raw = f.read(itemsize(ref.dtype))
        if dtype == "bfloat16":
            raw, dtype = b"\0\0" + raw, "float32"
        return ScalarTensor(float(np.frombuffer(raw, dtype=numpy_carrier(dtype))[0]), ref.dtype)

    def value(self, key: str):
        path, info = self._item(key)
        if path is None:
            return MISSING
        value = torchzip.load(path, span=(info.offset, info.length))
        if isinstance(value, TensorRef):
            raise CheckpointError(path, f"{key}: a tensor-valued hyper-parameter is not supported")
        return value

    def files(self) -> list:
        out = [FileInfo(METADATA, "metadata", None, os.path.getsize(self.meta_path))]
        for path, size in sorted(self.sizes.items()):
            out.append(FileInfo(os.path.relpath(path, self.root), "distcp", _rank(path), size or 0))
        return out


def _rank(path: str):
    found = _RANK_FILE.search(path)
    return int(found.group(1)) if found else None


def _dtype(entry, meta_path, key) -> str:
    props = getattr(entry, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, DType):
        raise CheckpointError(meta_path, f"{key}: no dtype in its tensor properties")
    return dtype.name


def _finish(catalog: Catalog, world: int) -> None:
    trainable = [p for p in catalog.params.values() if p.kind == "trainable"]
    states = catalog.optimizer_states()
    optimizer = ""
    if states and set(states) == _ADAM_STATES:
        decoupled = any(g.get("decoupled_weight_decay") for g in catalog.param_groups)
        optimizer = "AdamW" if decoupled else "Adam"
    elif states == ["momentum_buffer"]:
        optimizer = "SGD"
    steps = {s["step"].value for s in catalog.group_scalars if "step" in s}
    step = steps.pop() if len(steps) == 1 else None
    step = int(step) if step is not None and float(step).is_integer() else None
    weights = {catalog.tensors[(p.name, MODULE)].dtype for p in trainable}
    catalog.layout = Layout(dp=world, zero=0,
                            dtype=weights.pop() if len(weights) == 1 else "float32",
                            optimizer=optimizer, states=states,
                            params=sum(p.kind != "buffer" for p in catalog.params.values()),
                            elements=sum(math.prod(p.shape) for p in catalog.params.values() if p.kind != "buffer"),
                            step=step)
    catalog.state["tag"] = f"global_step{step}" if step is not None else "dcp"
    if step is not None:
        catalog.state["global_steps"] = step
