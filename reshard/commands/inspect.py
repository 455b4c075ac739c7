"""What a checkpoint holds, as an Inspection (printed as text or JSON by the CLI)."""
from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Protocol, runtime_checkable

from reshard.core.catalog import MASTER, MODULE, Catalog, ParamInfo, PerParamScalar, ScalarTensor, TensorKey
from reshard.formats import weights_only
from reshard.formats.framework import framework_of
from reshard.formats.torchsave_read import DType, TensorRef
from reshard.storage import files as fs

# Plain data as JSON holds it (jsonable): the free-form parts (a framework's files, a parameter's row, a thinning's
# record) whose keys the JSON output, not a type, fixes
JsonObject = Mapping[str, Any]


@runtime_checkable
class OwnEntries(Protocol):
    """A reader's notes that hold a framework's own state inside the checkpoint (torchtitan's lr_scheduler,
    dataloader and train_state DCP entries)."""

    def own_entries(self) -> list[dict[str, Any]]:
        """[{key, what, value}]"""


@runtime_checkable
class Framed(Protocol):
    """A reader's notes for a save read inside a framework's own framing, of which some folders are not read (verl's
    Megatron backend: its model's torch_dist save read, its optimizer's not)."""

    def framing(self) -> str:
        """The framing, in words."""

    def unread(self) -> list[dict[str, str]]:
        """[{path, what}] of what the save holds that is not read."""


@dataclass(frozen=True)
class Mesh:
    """The checkpoint's parallel degrees."""
    dp: int
    tp: int
    pp: int
    world_size: int


@dataclass(frozen=True)
class FormatPart:
    """What the checkpoint's format adds to the mesh, in its layout descriptor's words (FormatTopology.descriptor):
    DeepSpeed's ZeRO stage and partitioning options, Megatron-LM's optimizer sharding; empty for a format that
    partitions nothing (DCP, single files)."""
    descriptor: JsonObject

    @property
    def options(self) -> JsonObject:
        """Its settings beside the degrees (DeepSpeed's sub_group_size, Megatron-LM's sharding and iteration)."""
        options = self.descriptor.get("options")
        return options if isinstance(options, dict) else {}

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage; None for every other format (none has ZeRO partitioning)."""
        stage = self.descriptor.get("zero")
        return stage if isinstance(stage, int) and stage else None


@dataclass(frozen=True)
class FileRow:
    """One file the reader read: its path relative to the checkpoint, its role, the rank that wrote it."""
    path: str
    role: str
    rank: int | None
    bytes: int


@dataclass(frozen=True)
class SplitScalar:
    """An optimizer scalar of a param group that differs between its params: its value at `param`."""
    group: int
    key: str
    param: str
    value: Any     # plain data (jsonable)


@dataclass(frozen=True)
class Inspection:
    """What a checkpoint holds: its topology, dtypes, optimizer, training counters, parameters and files. The
    nested parts are typed, or plain data as `reshard inspect --json` prints them; None where the checkpoint does
    not tell. What one format alone has is in `own` (FormatPart)."""
    path: str
    format: str
    framework: JsonObject | None    # the training framework's folder around the save, and its own files
    tag: str | None                 # only formats with tag folders have one
    topology: Mesh
    experts: JsonObject | None      # a mixture-of-experts save: ep, expert-dp, per MoE layer its experts' placement
    own: FormatPart
    dtype: str | None               # None: unknown (mixed, or no master copy)
    master_dtype: str | None
    optimizer: str | None           # None: the checkpoint does not tell
    optimizer_states: tuple[str, ...]
    step: int | None
    global_steps: int | None
    global_samples: int | None
    parameters: int
    elements: int
    # None where the checkpoint does not say: a weights-only form `reshard thin` wrote before its record kept them
    trainable: int | None
    frozen: int | None
    buffers: int
    aliases: Mapping[str, str]      # {tied name: the name it is tied to}
    param_groups: tuple[JsonObject, ...]    # per group: its hyper-parameters and how many params it holds
    split_scalars: tuple[SplitScalar, ...]
    bytes_per_state: Mapping[str, int]
    files: tuple[FileRow, ...]
    problems: int                   # how many problems the reader found (`validate` says which)
    parameter_table: tuple[JsonObject, ...] | None = None     # with params=True: one row per parameter
    entries: tuple[JsonObject, ...] | None = None   # the framework's own state saved inside the checkpoint
    # a weights-only form `reshard thin` wrote: when, from what, what it dropped, bytes before/after; None: not one
    thinned: JsonObject | None = None
    # the other models of the checkpoint (Catalog.companions: a verl step's critic), by folder
    companions: tuple[tuple[str, Inspection], ...] = ()
    framing: str | None = None      # Framed: the framing the save was read in, and what of it is not read
    unread: tuple[JsonObject, ...] | None = None

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage (own.zero_stage), kept at the top for the scripts and the JSON that read it."""
        return self.own.zero_stage

    @property
    def options(self) -> JsonObject:
        return self.own.options

    @property
    def thinned_from_full(self) -> bool:
        """Its record is `reshard thin`'s (a full checkpoint made weights-only), not a model alone's written so
        (weights_only.written_record)."""
        return self.thinned is not None and "thinned_on" in self.thinned

    def weights_only_line(self) -> str | None:
        """e.g. "weights-only (thinned from a full deepspeed checkpoint on 2026-05-01; dropped the optimizer ...)"."""
        t = self.thinned
        if t is None:
            return None
        if not self.thinned_from_full and "load" in t:
            return f"weights-only (written from {t.get('from', '?')}, for {t['load']})"
        return f"weights-only (thinned from {t.get('from', 'a full checkpoint')} on {t.get('thinned_on', '?')}; " \
               f"dropped {t.get('dropped', '?')})"

    def to_dict(self) -> dict[str, Any]:
        """Plain data: what `reshard inspect --json` prints. `zero_stage` is DeepSpeed's alone, and stays a key of
        its own (None for other formats) for the scripts that read it; `options` is the format's own part."""
        data: dict[str, object] = {
            "path": self.path, "format": self.format, "framework": self.framework, "tag": self.tag,
            "topology": self.topology, "experts": self.experts, "zero_stage": self.zero_stage, "dtype": self.dtype,
            "master_dtype": self.master_dtype, "optimizer": self.optimizer, "optimizer_states": self.optimizer_states,
            "options": self.options, "step": self.step, "global_steps": self.global_steps,
            "global_samples": self.global_samples, "parameters": self.parameters, "elements": self.elements,
            "trainable": self.trainable, "frozen": self.frozen, "buffers": self.buffers, "aliases": self.aliases,
            "param_groups": self.param_groups, "split_scalars": self.split_scalars,
            "bytes_per_state": self.bytes_per_state, "files": self.files, "problems": self.problems}
        if self.parameter_table is not None:
            data["parameter_table"] = self.parameter_table
        if self.entries is not None:
            data["entries"] = self.entries
        data["thinned"] = self.thinned
        if self.framing is not None:
            data["framing"], data["unread"] = self.framing, self.unread
        out = {k: jsonable(v) for k, v in data.items()}
        if self.companions:
            out["companions"] = {folder: each.to_dict() for folder, each in self.companions}
        return out


def unread_parts(catalog: Catalog) -> tuple[JsonObject, ...] | None:
    """[{path, what}] of what the save holds that its reader does not read (Framed notes); None: it reads all."""
    return tuple(catalog.notes.unread()) if isinstance(catalog.notes, Framed) else None


def inspect(catalog: Catalog, params: bool = False) -> Inspection:
    layout, contents = catalog.layout, catalog.contents()
    own = layout.format_topology.descriptor() if layout.format_topology is not None else {}
    kinds = [p.kind for p in catalog.params.values()]
    frame = framework_of(catalog)
    thinned = weights_only.provenance(catalog.root if fs.isdir(catalog.root) else os.path.dirname(catalog.root))
    if thinned is None and frame is not None:      # a framework's folder thinned whole (Accelerate's around DeepSpeed)
        thinned = weights_only.provenance(frame.folder)
    trained: weights_only.Trained | None = weights_only.Trained.of(catalog)
    if thinned is not None and not catalog.param_groups:
        # the optimizer's groups, which said what was trained, were dropped: what the record kept of the source
        trained = weights_only.trained(thinned)
    return Inspection(
        path=catalog.root,
        format=catalog.format,
        framework=frame.to_dict(layout) if frame is not None else None,
        tag=catalog.tag or None,
        topology=Mesh(layout.dp, layout.tp, layout.pp, layout.world_size),
        experts=catalog.experts.describe() if catalog.experts is not None else None,
        own=FormatPart({k: jsonable(v) for k, v in own.items()}),
        dtype=layout.dtype or None,
        master_dtype=(layout.master_dtype or None) if MASTER in catalog.states() else None,
        optimizer=contents.optimizer or None,
        optimizer_states=tuple(contents.states),
        step=contents.step,
        global_steps=catalog.training.global_steps,
        global_samples=catalog.training.global_samples,
        parameters=contents.params,
        elements=contents.elements,
        trainable=trained.trainable if trained is not None else None,
        frozen=trained.frozen if trained is not None else None,
        buffers=kinds.count("buffer"),
        aliases=dict(catalog.aliases),
        param_groups=tuple({**{k: jsonable(v) for k, v in g.items() if k != "params"},
                            "params": len(g["params"]), **{k: jsonable(_first(v)) for k, v in scalars.items()}}
                           for g, scalars in zip(catalog.param_groups, catalog.group_scalars, strict=True)),
        # (the first param's value is in param_groups)
        split_scalars=tuple(SplitScalar(g, key, name, jsonable(value))
                            for g, scalars in enumerate(catalog.group_scalars) for key, per_param in scalars.items()
                            if isinstance(per_param, PerParamScalar) for name, value in per_param.differing()),
        bytes_per_state=catalog.bytes_per_state(),
        files=tuple(FileRow(f.path, f.role, f.rank, f.size) for f in catalog.files),
        problems=len(catalog.problems),
        parameter_table=tuple(_param_row(catalog, p) for p in catalog.params.values()) if params else None,
        entries=tuple(catalog.notes.own_entries()) if isinstance(catalog.notes, OwnEntries) else None,
        thinned=thinned,
        companions=tuple((folder, inspect(each, params)) for folder, each in catalog.companion_folders()),
        framing=catalog.notes.framing() if isinstance(catalog.notes, Framed) else None,
        unread=unread_parts(catalog),
    )


def _first(scalar: object) -> object:
    """A group's scalar as one value: the first param's where each param has its own."""
    return scalar.first()[1] if isinstance(scalar, PerParamScalar) else scalar


def _param_row(catalog: Catalog, p: ParamInfo) -> dict[str, Any]:
    states = [s for s in catalog.states() if (p.name, s) in catalog.tensors]
    dtypes = {s: catalog.tensors[TensorKey(p.name, s)].dtype for s in states}
    row = {"name": p.name, "shape": list(p.shape), "kind": p.kind, "group": p.group,
           "dtype": dtypes.get(MODULE) or dtypes.get(MASTER), "states": states,
           "tied_to_it": sorted(a for a, src in catalog.aliases.items() if src == p.name)}
    if catalog.notes is not None:      # how the format cut it (tensor-parallel boxes, pipeline stages)
        row.update(catalog.notes.param_details(p.name))
    return row


def jsonable(value: object) -> Any:
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
    if is_dataclass(value) and not isinstance(value, type):
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
