"""The Catalog: every logical tensor of a checkpoint and where its elements live on disk.

A logical tensor is a (name, state) pair: ("l1.weight", "exp_avg"). Its elements are spread
over fragments; a fragment says which flat range [start, stop) of which shard of the full tensor
(reshard.core.placement: the full tensor itself, a tensor-parallel slice, a DCP chunk) sits contiguously
in which storage, starting at which element of that storage. One fragment per shard and flat range,
however many rows it has. Readers fill a CatalogBuilder from metadata alone and freeze it into a Catalog, which
no one changes after; nothing here reads tensor bytes.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

from reshard.core import optimizers
from reshard.core.placement import Shard
from reshard.core.problems import READER, Problem
from reshard.core.storage_ref import StorageRef
from reshard.errors import CheckpointError, ReshardError

if TYPE_CHECKING:
    from reshard.core.layout import Layout

# State names with a fixed meaning; optimizer states keep the optimizer's own names.
MASTER = "fp32"        # the fp32 master copy of a trainable parameter
MODULE = "module"      # the model's state_dict value as saved (16-bit copy, frozen params, buffers)


class TensorKey(NamedTuple):
    """A logical tensor's key in the catalog: a tuple, so (name, state) tuples find it too."""
    name: str
    state: str


@dataclass(frozen=True, slots=True)
class Fragment:
    start: int           # first element of the shard held here (flat, row-major)
    stop: int            # one past the last
    storage: StorageRef
    elem_offset: int     # element of `storage` holding element `start`
    rank: int | None = None   # the rank whose file this is, for messages
    shard: Shard | None = None  # which shard of the logical tensor; None: the logical tensor itself

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ScalarTensor:
    """A one-element tensor of the optimizer state (a `step` counter): value and dtype, no storage."""
    value: float
    dtype: str


# One optimizer scalar as saved: a one-element tensor, or a plain number
ScalarValue = ScalarTensor | float | int


@dataclass(frozen=True)
class PerParamScalar:
    """An optimizer scalar a source keeps for each param of a group: torch.optim's Adam counts each param's
    own `step` (a param without a gradient is not stepped), and torch.save, DCP and a universal checkpoint's
    `zero/<param>/step.pt` save that count per param, where a DeepSpeed save keeps one per group. A builder's
    maps grow as params are read (CatalogBuilder.record_param_scalar); a Catalog's are read-only."""
    values: Mapping[str, ScalarValue] = field(default_factory=dict)   # param name -> value, in the order read
    files: Mapping[str, str] = field(default_factory=dict)    # param name -> the file its value was read from

    def first(self) -> tuple[str, ScalarValue]:
        """(name, value) of the first param read: the group's one value when all agree."""
        return next(iter(self.values.items()))

    def differing(self) -> list[tuple[str, ScalarValue]]:
        """[(name, value)] of the params whose value is not the first param's (empty: one value for all)."""
        first = self.first()[1]
        return [(name, value) for name, value in self.values.items() if value != first]

    def frozen(self) -> PerParamScalar:
        return PerParamScalar(MappingProxyType(dict(self.values)), MappingProxyType(dict(self.files)))


# Per param group, each optimizer scalar ("step"): its one value where the format keeps one per group
# (DeepSpeed), a PerParamScalar where it keeps each param's own
GroupScalar = ScalarValue | PerParamScalar


class TensorFacts:
    """What a logical tensor's name, shape and dtypes say, the same for one being read (TensorDraft) and one frozen
    (LogicalTensor)."""
    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    cast_from: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_dtype(self) -> str:
        """The dtype of the bytes its fragments point at."""
        return self.cast_from or self.dtype

    @property
    def key(self) -> TensorKey:
        return TensorKey(self.name, self.state)


@dataclass(frozen=True)
class LogicalTensor(TensorFacts):
    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[Fragment, ...] = ()
    # The dtype the fragments' storages hold when it is not `dtype`: the tensor is those values cast to `dtype`
    # (rounded to nearest even, as torch's .to()); a format's loader that derives one copy from another (a
    # universal checkpoint's expert weights are their fp32 master cast to the model's dtype). "": none.
    cast_from: str = ""


@dataclass
class TensorDraft(TensorFacts):
    """A logical tensor while a reader finds its fragments (CatalogBuilder.add); frozen into a LogicalTensor."""
    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    fragments: list[Fragment] = field(default_factory=list)
    cast_from: str = ""      # as LogicalTensor.cast_from

    def freeze(self) -> LogicalTensor:
        return LogicalTensor(self.name, self.state, tuple(self.shape), self.dtype, tuple(self.fragments),
                             self.cast_from)


@dataclass(frozen=True)
class Replica:
    copy: LogicalTensor      # same name/state/shape as the catalog's tensor; fragments from another holder
    holder: str              # who holds the copy, for messages ("tensor-parallel rank 1")
    first: str               # who holds the catalog's own elements there
    checked: bool = False    # compared when read (a small one); `validate --deep` compares the others


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    kind: str                  # "trainable", "frozen" or "buffer"
    group: int | None = None   # optimizer param group of a trainable param


@dataclass(frozen=True)
class FileInfo:
    path: str                  # relative to the catalog's root
    role: str                  # e.g. "model_states", "optim_states"
    rank: int | None = None    # data-parallel rank, when the file belongs to one
    size: int = 0


@dataclass(frozen=True)
class TrainingState:
    """What a training checkpoint records beside its tensors, in every format that keeps it (None: not said)."""
    global_steps: int | None = None
    global_samples: int | None = None
    skipped_steps: int | None = None
    lr_scheduler: Any = None        # the lr scheduler's state_dict, as saved (plain data)
    optimizer: str = ""             # the optimizer class the checkpoint names ("": none; Contents guesses it)


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds, computed from its catalog alone (Catalog.contents) whatever its format."""
    optimizer: str       # "Adam", "AdamW", "SGD", ...: as the checkpoint names it, else told by its states; "": unknown
    states: list[str]    # per-element optimizer state names, in file order
    params: int          # trainable + frozen parameters (aliases not counted)
    elements: int        # elements in those parameters
    step: int | None     # optimizer step count (the largest of the param groups'); None: none saved


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer: how many experts it has and which expert-parallel rank holds which."""
    index: int            # the layer's number among the checkpoint's MoE layers
    num_experts: int
    placement: tuple[tuple[int, ...], ...]   # per expert-parallel rank, the global experts it holds, in its local order
    params: tuple[str, ...]   # the logical tensors holding its experts' weights


@dataclass(frozen=True)
class ExpertParallel:
    """How a mixture-of-experts checkpoint placed its experts: every expert param is one logical tensor (all
    experts of a packed weight, or one expert's own weight); these degrees say how the save had cut them."""
    ep: int               # expert-parallel degree: ranks among which a layer's experts are divided
    expert_dp: int        # data-parallel degree of the expert params (their optimizer state is ZeRO-cut over it)
    layers: tuple[ExpertLayer, ...]   # in layer order

    def describe(self) -> dict[str, Any]:
        return {"ep": self.ep, "expert_dp": self.expert_dp,
                "layers": [{"layer": layer.index, "experts": layer.num_experts,
                            "experts_per_rank": [len(held) for held in layer.placement],
                            "placement": [list(held) for held in layer.placement], "params": list(layer.params)}
                           for layer in self.layers]}


class FormatNotes(Protocol):
    """What one format's reader keeps for that format's writers (DeepSpeed's config, how tensor parallelism cut
    each parameter, ...): a typed object the format owns. The core never looks inside; it only asks for what the
    format knows of one parameter, for `inspect --params`."""

    def param_details(self, name: str) -> dict[str, Any]:
        """Plain data on how parameter `name` is held ({} when nothing beyond the catalog's own facts)."""

    def layout_scalar(self, key: str, value: object) -> bool:
        """Whether param-group hyper-parameter `key` = `value` only names the topology (AutoEP's expert group
        name): a conversion changes it, so `diff` does not compare it."""

    def scalars(self) -> dict[str, Any]:
        """{name: value} of the non-tensor training state only this format keeps (a loss scaler, the client
        state), as saved: `diff` compares its leaves."""


class TrainingFramework(Protocol):
    """The training framework around a save (reshard.formats.framework.Framework): the core only carries it."""

    @property
    def model_files(self) -> tuple[str, ...]:
        """Paths an export copies beside the weights (a frozen dataclass field in the framework's own type)."""

    @property
    def state(self) -> dict[str, Any] | None:
        """Its own non-tensor state where the backend keeps it, for a writer of another backend to carry (None:
        none kept)."""

    def missing(self) -> list[Problem]:
        """Its own files missing, a problem each."""


@dataclass(frozen=True)
class Catalog:
    """A checkpoint's logical tensors, params and training state as its reader found them (CatalogBuilder.freeze):
    read-only, to be planned, validated, inspected and exported from."""
    root: str                              # the directory the files are relative to
    format: str                            # e.g. "deepspeed"
    layout: Layout
    tensors: Mapping[TensorKey, LogicalTensor] = field(default_factory=lambda: MappingProxyType({}))
    params: Mapping[str, ParamInfo] = field(default_factory=lambda: MappingProxyType({}))   # model order
    # tied name -> the name holding the data
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    order: tuple[str, ...] = ()            # the model's state_dict keys, in order (aliases too)
    # [{hyper-params..., "params": [names, optimizer order]}], as saved (plain data written back into pickles)
    param_groups: tuple[dict[str, Any], ...] = ()
    # per param group, each optimizer scalar ("step"); writers ask scalars_of_groups/_param
    group_scalars: tuple[Mapping[str, GroupScalar], ...] = ()
    tag: str = ""                                      # the save's name (a DeepSpeed tag), for output
    training: TrainingState = field(default_factory=TrainingState)
    # taken for frozen params, but maybe floating-point buffers: the source does not say which
    maybe_buffers: tuple[str, ...] = ()
    notes: FormatNotes | None = None                   # the reader's format's own notes (see FormatNotes)
    files: tuple[FileInfo, ...] = ()                   # every file read or expected
    problems: tuple[Problem, ...] = ()                 # what the reader found wrong
    # Second copies of replicated data (a norm weight on every TP rank): each a LogicalTensor whose
    # fragments hold, at the same flat positions, elements the catalog's own tensor holds. They must be
    # equal; readers compare the small ones, `validate --deep` every one not yet compared.
    replicas: tuple[Replica, ...] = ()
    # The folder the whole save lives in, which output must not overlap; None: root's parent
    # (a DeepSpeed tag folder's save dir). A DCP directory is its own save dir.
    save_dir: str | None = None
    # The training framework that drove a DeepSpeed save (reshard.formats.framework.Framework: HF Trainer's
    # checkpoint-N/ with its own files, Lightning's state inside DeepSpeed's client state); None: none.
    framework: TrainingFramework | None = None
    # Files a consumer loads beside the weights (absolute paths: a Hugging Face model's config, tokenizer), which an
    # export into a folder copies so that folder loads as the model
    model_files: tuple[str, ...] = ()
    # A mixture-of-experts save: its expert parallelism (None: no experts)
    experts: ExpertParallel | None = None
    # Other models saved in this checkpoint beside this one (a verl step's critic beside its actor), each its own
    # catalog rooted at a folder inside `root`: validate, inspect, diff and convert take them with this one (a
    # checkpoint is never converted or proven whole in part); an export writes this one alone
    companions: tuple[Catalog, ...] = ()

    def check_dtypes(self) -> None:
        """Every fragment's storage holds its tensor's dtype: the bytes are read as that dtype, so a storage of
        another (a hostile or mixed-up file) would be copied as garbage of the right size."""
        for companion in self.companions:
            companion.check_dtypes()
        for tensor in [*self.tensors.values(), *(r.copy for r in self.replicas)]:
            for fragment in tensor.fragments:
                if fragment.storage.dtype != tensor.stored_dtype:
                    raise CheckpointError(fragment.storage.file, f"{tensor.name} ({tensor.state}): a storage of "
                                          f"{fragment.storage.dtype} holds part of a {tensor.stored_dtype} tensor")

    def companion_folders(self) -> tuple[tuple[str, Catalog], ...]:
        """(its folder relative to `root`, "critic"; catalog) of each companion, in order."""
        return tuple((os.path.relpath(c.root, self.root), c) for c in self.companions)

    def tensor_order(self) -> list[str]:
        """The state_dict keys in order that name a param or an alias of one: `order` less the entries that hold
        no tensor (a module's empty extra state, megatron-core's `_extra_state: None`), which no writer places."""
        return [name for name in self.order if self.aliases.get(name, name) in self.params]

    def tensor(self, name: str, state: str) -> LogicalTensor:
        try:
            return self.tensors[TensorKey(self.aliases.get(name, name), state)]
        except KeyError:
            raise KeyError(f"no tensor {name!r} with state {state!r} in this checkpoint") from None

    def states(self) -> list[str]:
        """State names present, master and module first, then optimizer states in file order."""
        seen = dict.fromkeys(key.state for key in self.tensors)
        first = [s for s in (MASTER, MODULE) if s in seen]
        return first + [s for s in seen if s not in first]

    def optimizer_states(self) -> list[str]:
        return [s for s in self.states() if s not in (MASTER, MODULE)]

    def contents(self) -> Contents:
        states = self.optimizer_states()
        counted = [p for p in self.params.values() if p.kind != "buffer"]
        steps = self.scalar_values("step")
        return Contents(optimizer=self.training.optimizer or optimizers.kind(states, list(self.param_groups)),
                        states=states, params=len(counted), elements=sum(math.prod(p.shape) for p in counted),
                        step=int(max(steps)) if steps else None)

    def bytes_per_state(self) -> dict[str, int]:
        from reshard.core.dtypes import itemsize
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.state] = out.get(t.state, 0) + t.numel * itemsize(t.dtype)
        return out

    def weight_dtypes(self) -> tuple[str, str]:
        """(model dtype, master dtype) where the weights are saved as the optimizer updated them (no separate
        16-bit copy): the trainable params' dtypes, their master's where one is registered, else theirs. Weights
        only: the floating params' dtype and no master (""). "" also when weights-only dtypes are mixed."""
        trainable = [p.name for p in self.params.values() if p.kind == "trainable"]
        if not trainable:
            saved = {self.tensors[TensorKey(p.name, MODULE)].dtype for p in self.params.values()
                     if p.kind == "frozen" and TensorKey(p.name, MODULE) in self.tensors}
            return (saved.pop() if len(saved) == 1 else ""), ""
        saved = {self.tensors[TensorKey(n, MODULE)].dtype for n in trainable}
        masters = {self.tensors[TensorKey(n, MASTER) if TensorKey(n, MASTER) in self.tensors
                                else TensorKey(n, MODULE)].dtype for n in trainable}
        # mixed precisions: a DeepSpeed target keeps a float32 master and 16-bit copy of each
        return (saved.pop() if len(saved) == 1 else "float32"), (masters.pop() if len(masters) == 1 else "float32")

    def scalars_of_groups(self, target: str) -> list[dict[str, ScalarValue]]:
        """Per param group {key: its one value}, for `target`, a format that keeps one per group. A scalar whose
        params differ refuses `target` (which would get one of the values for every param), naming the file
        and the params; the source stays readable, only its optimizer state cannot be carried."""
        out = []
        for g, scalars in enumerate(self.group_scalars):
            one: dict[str, ScalarValue] = {}
            for key, value in scalars.items():
                if isinstance(value, PerParamScalar):
                    first_name, first = value.first()
                    differing = value.differing()
                    if differing:
                        name, other = differing[0]
                        raise ReshardError.at(value.files[name], f"param group {g}: optimizer {key} differs between "
                                              f"parameters ({_number(first)} at {first_name} vs {_number(other)} at "
                                              f"{name}); {target} keeps one per group, so it is not written")
                    value = first
                one[key] = value
            out.append(one)
        return out

    def scalars_of_param(self, name: str) -> dict[str, ScalarValue]:
        """{key: value} of trainable param `name`: its own where the source keeps one per param, else its
        group's. A key the param has no value of (torch.optim keeps no state for a param never stepped) is absent."""
        g = self.params[name].group
        out: dict[str, ScalarValue] = {}
        scalars = self.group_scalars[g] if g is not None and g < len(self.group_scalars) else {}
        for key, value in scalars.items():
            if isinstance(value, PerParamScalar):
                if name not in value.values:
                    continue
                value = value.values[name]
            out[key] = value
        return out

    def scalar_values(self, key: str) -> set[float | int]:
        """Every plain value optimizer scalar `key` has, over all groups and params (the steps a save holds)."""
        out: set[float | int] = set()
        for scalars in self.group_scalars:
            value = scalars.get(key)
            values = value.values.values() if isinstance(value, PerParamScalar) else [value]
            out |= {v.value if isinstance(v, ScalarTensor) else v for v in values if v is not None}
        return out


@dataclass
class CatalogBuilder:
    """What a reader fills as it reads a checkpoint's metadata (the same fields as Catalog, open to change);
    `freeze()` makes the Catalog everyone else reads."""
    root: str
    format: str
    layout: Layout
    tensors: dict[TensorKey, TensorDraft] = field(default_factory=dict)
    params: dict[str, ParamInfo] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    group_scalars: list[dict[str, GroupScalar]] = field(default_factory=list)
    tag: str = ""
    training: TrainingState = field(default_factory=TrainingState)
    maybe_buffers: list[str] = field(default_factory=list)
    notes: FormatNotes | None = None
    files: list[FileInfo] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    save_dir: str | None = None
    framework: TrainingFramework | None = None
    model_files: tuple[str, ...] = ()
    experts: ExpertParallel | None = None
    companions: tuple[Catalog, ...] = ()

    def add(self, tensor: TensorDraft, file: str | None = None) -> TensorDraft:
        """The catalog's (name, state) tensor: `tensor`, or the one added before, which must agree on shape
        and dtype (each rank's file of a tensor adds it). `file`: where `tensor` comes from, for the message."""
        first = self.tensors.setdefault(tensor.key, tensor)
        if (first.shape, first.dtype) != (tensor.shape, tensor.dtype):
            where = file or _file_of(tensor) or self.root
            raise CheckpointError(where, f"{tensor.name} ({tensor.state}): {tensor.dtype}{list(tensor.shape)} here, "
                                  f"{first.dtype}{list(first.shape)} in {_file_of(first) or 'the files read before'}")
        return first

    def record_param_scalar(self, g: int, name: str, key: str, value: ScalarValue, path: str) -> None:
        """A reader's: `name` (of group g, in group_scalars already) has its own `value` of optimizer scalar
        `key`, read from `path`."""
        entry = cast(PerParamScalar, self.group_scalars[g].setdefault(key, PerParamScalar({}, {})))
        # the builder's own dicts, made here; freeze() makes them read-only
        cast(dict[str, ScalarValue], entry.values)[name] = value
        cast(dict[str, str], entry.files)[name] = path

    def problem(self, path: str, text: str) -> None:
        """What is wrong in the file at `path` but readable (`text` does not repeat the path)."""
        self.problems.append(Problem(str(path), None, READER, text))

    def failed(self, error: ReshardError) -> None:
        """A file that could not be read (the others still are): `error`, as a problem."""
        self.problems.append(Problem.of_error(error))

    def freeze(self) -> Catalog:
        """The Catalog of what was read: tuples and read-only maps, each tensor's fragments fixed."""
        return Catalog(
            root=self.root, format=self.format, layout=self.layout,
            tensors=MappingProxyType({TensorKey(*key): t.freeze() for key, t in self.tensors.items()}),
            params=MappingProxyType(dict(self.params)), aliases=MappingProxyType(dict(self.aliases)),
            order=tuple(self.order), param_groups=tuple(self.param_groups),
            group_scalars=tuple(MappingProxyType({key: value.frozen() if isinstance(value, PerParamScalar) else value
                                                  for key, value in scalars.items()})
                                for scalars in self.group_scalars),
            tag=self.tag, training=self.training, maybe_buffers=tuple(self.maybe_buffers), notes=self.notes,
            files=tuple(self.files), problems=tuple(self.problems), replicas=tuple(self.replicas),
            save_dir=self.save_dir, framework=self.framework, model_files=tuple(self.model_files),
            experts=self.experts, companions=tuple(self.companions))


def _file_of(tensor: TensorDraft) -> str | None:
    return tensor.fragments[0].storage.file if tensor.fragments else None


def _number(value: ScalarValue) -> str:
    value = value.value if isinstance(value, ScalarTensor) else value
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
