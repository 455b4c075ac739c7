"""What a checkpoint holds, as an Inspection (printed as text or JSON by the CLI)."""
from __future__ import annotations

import enum
import os
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any, Protocol, runtime_checkable

from reshard.core.catalog import MASTER, MODULE, Catalog, PerParamScalar, ScalarTensor
from reshard.formats import weights_only
from reshard.formats.framework import framework_of
from reshard.formats.torchsave_read import DType, TensorRef
from reshard.storage import files as fs


@runtime_checkable
class OwnEntries(Protocol):
    """A reader's notes that hold a framework's own state inside the checkpoint (torchtitan's lr_scheduler,
    dataloader and train_state DCP entries)."""

    def own_entries(self) -> list[dict]:
        """[{key, what, value}]"""


@dataclass(frozen=True)
class Inspection:
    """What a checkpoint holds: its topology, dtypes, optimizer, training counters, parameters and files. The
    nested parts are plain data as `reshard inspect --json` prints them; None where the checkpoint does not tell."""
    path: str
    format: str
    framework: dict | None          # the training framework's folder around the save, and its own files
    tag: str | None                 # only formats with tag folders have one
    topology: dict                  # dp, tp, pp, world_size
    experts: dict | None            # a mixture-of-experts save: ep, expert-dp, per MoE layer its experts' placement
    zero_stage: int | None          # None: the format has no ZeRO partitioning (DCP, single files)
    dtype: str | None               # None: unknown (mixed, or no master copy)
    master_dtype: str | None
    optimizer: str | None           # None: the checkpoint does not tell
    optimizer_states: list
    options: dict
    step: int | None
    global_steps: int | None
    global_samples: int | None
    parameters: int
    elements: int
    trainable: int
    frozen: int
    buffers: int
    aliases: dict                   # {tied name: the name it is tied to}
    param_groups: list              # per group: its hyper-parameters and how many params it holds
    split_scalars: list             # optimizer scalars that differ between a group's params
    bytes_per_state: dict
    files: list                     # {path, role, rank, bytes}
    problems: int                   # how many problems the reader found (`validate` says which)
    parameter_table: list | None = None     # with params=True: one row per parameter
    entries: list | None = None     # the framework's own state saved inside the checkpoint: {key, what, value}
    # a weights-only form `reshard thin` wrote: when, from what, what it dropped, bytes before/after; None: not one
    thinned: dict | None = None

    def weights_only_line(self) -> str | None:
        """e.g. "weights-only (thinned from a full deepspeed checkpoint on 2026-05-01; dropped the optimizer ...)"."""
        t = self.thinned
        if t is None:
            return None
        return f"weights-only (thinned from {t.get('from', 'a full checkpoint')} on {t.get('thinned_on', '?')}; " \
               f"dropped {t.get('dropped', '?')})"

    def to_dict(self) -> dict:
        """Plain data: what `reshard inspect --json` prints."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.parameter_table is None:
            del data["parameter_table"]
        if self.entries is None:
            del data["entries"]
        return jsonable(data)


def inspect(catalog: Catalog, params: bool = False) -> Inspection:
    layout, contents = catalog.layout, catalog.contents()
    # what the format adds to the mesh (a DeepSpeed save: its ZeRO stage and partitioning options), in the
    # descriptor's words: none for a format that partitions nothing (DCP, single files)
    own: dict[str, Any] = layout.format_topology.descriptor() if layout.format_topology is not None else {}
    kinds = [p.kind for p in catalog.params.values()]
    frame = framework_of(catalog)
    return Inspection(
        path=catalog.root,
        format=catalog.format,
        framework=frame.to_dict(layout) if frame is not None else None,
        tag=catalog.tag or None,
        topology={"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "world_size": layout.world_size},
        experts=catalog.experts.describe() if catalog.experts is not None else None,
        zero_stage=own.get("zero") or None,      # None: the format has no ZeRO partitioning (DCP, single files)
        dtype=layout.dtype or None,
        master_dtype=(layout.master_dtype or None) if MASTER in catalog.states() else None,
        optimizer=contents.optimizer or None,
        optimizer_states=contents.states,
        options=own.get("options") or {},
        step=contents.step,
        global_steps=catalog.training.global_steps,
        global_samples=catalog.training.global_samples,
        parameters=contents.params,
        elements=contents.elements,
        trainable=kinds.count("trainable"),
        frozen=kinds.count("frozen"),
        buffers=kinds.count("buffer"),
        aliases=dict(catalog.aliases),
        param_groups=[{**{k: jsonable(v) for k, v in g.items() if k != "params"},
                       "params": len(g["params"]), **{k: jsonable(_first(v)) for k, v in scalars.items()}}
                      for g, scalars in zip(catalog.param_groups, catalog.group_scalars, strict=True)],
        # (the first param's value is in param_groups)
        split_scalars=[{"group": g, "key": key, "param": name, "value": jsonable(value)}
                       for g, scalars in enumerate(catalog.group_scalars) for key, per_param in scalars.items()
                       if isinstance(per_param, PerParamScalar) for name, value in per_param.differing()],
        bytes_per_state=catalog.bytes_per_state(),
        files=[{"path": f.path, "role": f.role, "rank": f.rank, "bytes": f.size} for f in catalog.files],
        problems=len(catalog.problems),
        parameter_table=[_param_row(catalog, p) for p in catalog.params.values()] if params else None,
        entries=catalog.notes.own_entries() if isinstance(catalog.notes, OwnEntries) else None,
        thinned=weights_only.provenance(catalog.root if fs.isdir(catalog.root) else os.path.dirname(catalog.root)),
    )


def _first(scalar):
    """A group's scalar as one value: the first param's where each param has its own."""
    return scalar.first()[1] if isinstance(scalar, PerParamScalar) else scalar


def _param_row(catalog, p) -> dict:
    states = [s for s in catalog.states() if (p.name, s) in catalog.tensors]
    dtypes = {s: catalog.tensors[(p.name, s)].dtype for s in states}
    row = {"name": p.name, "shape": list(p.shape), "kind": p.kind, "group": p.group,
           "dtype": dtypes.get(MODULE) or dtypes.get(MASTER), "states": states,
           "tied_to_it": sorted(a for a, src in catalog.aliases.items() if src == p.name)}
    if catalog.notes is not None:      # how the format cut it (tensor-parallel boxes, pipeline stages)
        row.update(catalog.notes.param_details(p.name))
    return row


def jsonable(value):
    """Plain JSON data for anything a checkpoint's non-tensor state can hold."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, ScalarTensor):
        return value.value
    if isinstance(value, TensorRef):
        return f"<tensor {value.dtype} {list(value.shape)}>"
    if isinstance(value, DType):
        return repr(value)
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if is_dataclass(value):
        return jsonable(asdict(value))
    if hasattr(value, "__dict__"):
        return {"class": type(value).__name__, **jsonable(vars(value))}
    return repr(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
