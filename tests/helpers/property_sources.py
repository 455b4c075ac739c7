"""Random-model sources for the property tests (tests/test_properties*.py): a model described as plain data,
every element of every tensor given a distinct value, the truth kept as numpy bit patterns, and the model
written as real checkpoint files by reshard's own writers.

The truth is made without reshard: fp32 values are picked so that the 16-bit copy of each is a known bit
pattern (the fp32 value is that pattern plus a fraction of its last place, which round-to-nearest drops), and
torch's own cast is checked to give it. Every value of an example is distinct across tensors and states, so
an element taken from the wrong place, state or tensor never matches by chance.

`source_catalog` is the one place a Catalog is built by hand (raw files, one fragment per tensor); everything
else goes through public entry points (make_plan, execute, open_checkpoint).
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch

import reshard
from reshard.commands.convert import make_plan
from reshard.execution.executor import execute

LP = ("float32", "bfloat16", "float16")
BITS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16, "int64": np.int64}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}
TORCH_BITS = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16, "int64": torch.int64}
MASTER, MODULE = "fp32", "module"
# The examples' scratch: memory (tmpfs) where there is one. These tests prove where elements land, not how bytes
# reach a disk (tests/storage/test_storage.py, test_sink.py and every other conversion do, on the disk under pytest's
# tmp_path): there, each example's fsyncs and unlinks cost more than the example (500 examples of
# test_properties: 87 s on this machine's disk, 58 s in memory).
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def scratch() -> tempfile.TemporaryDirectory:
    """A folder for one example, removed after it."""
    return tempfile.TemporaryDirectory(dir=SCRATCH)


# 16-bit patterns of normal finite numbers: bf16 exponent 1..254, fp16 exponent 1..30
PATTERNS = {"bfloat16": (0x0080, 0x7F00), "float16": (0x0400, 0x7B00), "float32": (0x0080, 0x7F00)}


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple
    kind: str = "trainable"        # "trainable", "frozen" or "buffer"


@dataclass(frozen=True)
class Model:
    params: tuple                   # Param, model order
    groups: tuple                   # per optimizer param group, the names of its trainable params
    lp: str = "float32"             # the 16-bit (or fp32) module dtype
    states: tuple = ("exp_avg", "exp_avg_sq")
    options: dict = field(default_factory=dict)       # DeepSpeed zero_optimization options
    tensor_parallel: dict | None = None               # ds_config "tensor_parallel" (AutoTP) section
    rules: str | None = None                          # layout rule file: how tensor parallelism cuts
    layers: tuple | None = None     # PipelineModule: per layer, ((key in its file, param name), ...)

    def param(self, name) -> Param:
        return next(p for p in self.params if p.name == name)

    def trainable(self) -> list:
        return [p for p in self.params if p.kind == "trainable"]


def bits(tensor: torch.Tensor) -> np.ndarray:
    """A torch tensor's elements as unsigned bit patterns (bf16 has no numpy dtype; NaNs compare as bits)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    raw = tensor.detach().contiguous().view(TORCH_BITS[dtype]).numpy()
    return raw.view(BITS[dtype])


def truth(model: Model) -> dict:
    """(name, state) -> numpy bit patterns of the full tensor, dtype: every value distinct."""
    lo, hi = PATTERNS[model.lp]
    counter = iter(range(lo, hi))
    out = {}

    def patterns(shape):
        n = math.prod(shape)
        p = np.fromiter(counter, np.uint32, n)
        assert len(p) == n, "the model has more elements than distinct 16-bit patterns"
        return p.reshape(shape)

    def fp32_above(p):   # the fp32 number a 16-bit pattern p names, plus a fraction of its last place
        if model.lp == "float16":
            base = torch.from_numpy(p.astype(np.uint16).view(np.int16)).view(torch.float16).float()
            return bits(base) | np.uint32(0x10)
        return (p << 16) | np.uint32(0x100)

    for p in model.params:
        if p.kind == "buffer":
            out[(p.name, MODULE)] = np.arange(1, math.prod(p.shape) + 1, dtype=np.int64).reshape(p.shape) * 7
            continue
        lp_bits = patterns(p.shape)
        if p.kind == "frozen":
            out[(p.name, MODULE)] = _lp(model.lp, lp_bits)
            continue
        master = fp32_above(lp_bits)
        out[(p.name, MASTER)] = master
        cast = bits(torch.from_numpy(master.view(np.float32)).to(TORCH[model.lp]))
        assert (cast == _lp(model.lp, lp_bits)).all() if model.lp != "float32" else (cast == master).all()
        out[(p.name, MODULE)] = cast
        for state in model.states:
            out[(p.name, state)] = fp32_above(patterns(p.shape))
    return out


def _lp(lp, p):
    if lp == "float32":
        return (p << 16) | np.uint32(0x100)
    return p.astype(np.uint16)


def dtype_of(model: Model, key) -> str:
    name, state = key
    kind = model.param(name).kind
    if kind == "buffer":
        return "int64"
    return model.lp if state == MODULE else "float32"


def source_catalog(model: Model, values: dict, root: str):
    """THE hand-built Catalog: each logical tensor one raw file, one fragment (tp=pp=dp=1). A pipeline model
    also gets what the DeepSpeed reader records of layer files (which layer holds which param)."""
    from reshard.core.catalog import CatalogBuilder, Fragment, ParamInfo, ScalarTensor, TensorDraft, TrainingState
    from reshard.core.layout import Layout
    from reshard.core.storage_ref import StorageRef
    from reshard.formats.deepspeed.notes import DeepSpeedNotes
    from reshard.formats.deepspeed.topology import DeepSpeedTopology

    src = os.path.join(root, "src", "global_step7")
    os.makedirs(src)
    catalog = CatalogBuilder(root=src, format="deepspeed",
                             layout=Layout.of(1, dtype=model.lp,
                                              format_topology=DeepSpeedTopology(zero=1, **model.options)))
    zero_cfg = {"stage": 1, **model.options}
    precision = {"bfloat16": {"bf16": {"enabled": True}}, "float16": {"fp16": {"enabled": True}}}.get(model.lp, {})
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_cfg, **precision}
    if model.tensor_parallel is not None:
        config["tensor_parallel"] = dict(model.tensor_parallel)
    catalog.tag, catalog.training = "global_step7", TrainingState(global_steps=7, global_samples=7, skipped_steps=0)
    layers = {} if model.layers is None else {
        "pipe_layer_files": {i: list(entries) for i, entries in enumerate(model.layers)},
        "layers": {name: (i, key) for i, entries in enumerate(model.layers) for key, name in entries},
        "stages": {p.name: [0] for p in model.trainable()}}
    catalog.notes = DeepSpeedNotes(ds_config=config, ds_version="0.19.8", tp_rules=model.rules or None, **layers)
    for g, members in enumerate(model.groups):
        catalog.param_groups.append({"lr": 0.1 * (g + 1), "weight_decay": 0.0, "params": list(members)})
        catalog.group_scalars.append({"step": ScalarTensor(7.0, "float32")})
    group_of = {n: g for g, members in enumerate(model.groups) for n in members}
    for p in model.params:
        catalog.params[p.name] = ParamInfo(p.name, tuple(p.shape), p.kind, group_of.get(p.name))
        catalog.order.append(p.name)
    for i, (key, value) in enumerate(values.items()):
        dtype = dtype_of(model, key)
        raw = value.tobytes()
        path = os.path.join(src, f"t{i}.bin")
        with open(path, "wb") as f:
            f.write(raw)
        tensor = catalog.add(TensorDraft(key[0], key[1], tuple(value.shape), dtype))
        tensor.fragments.append(Fragment(0, value.size, StorageRef(path, 0, len(raw), dtype), 0))
    return catalog.freeze()


def convert(catalog, spec: str, dst: str, fmt: str | None = None, rules: str | None = None, read: bool = True):
    """Write `catalog` at `spec` (format `fmt`) with the real planner and executor; the written checkpoint
    read back (with the rule file, when the model has one) unless not `read`."""
    execute(make_plan(catalog, spec, fmt=fmt), dst, progress=False)
    return reshard.open_checkpoint(dst, layout_rules=rules) if read else None


def tree_bytes(root: str) -> dict:
    """Every file under root (the manifest aside, which records times) -> its bytes."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f != "reshard-manifest.json":
                with open(os.path.join(d, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out
