"""The Catalog: every logical tensor of a checkpoint and where its elements live on disk.

A logical tensor is a (name, state) pair: ("l1.weight", "exp_avg"). Its elements are spread
over fragments; a fragment says which flat range [start, stop) of which shard of the full tensor
(reshard.placement: the full tensor itself, a tensor-parallel slice, a DCP chunk) sits contiguously
in which storage, starting at which element of that storage. One fragment per shard and flat range,
however many rows it has. Readers fill a Catalog from metadata alone; nothing here reads tensor bytes.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from reshard import optimizers
from reshard.errors import ReshardError
from reshard.formats.torchzip import Storage
from reshard.placement import Shard

if TYPE_CHECKING:
    from reshard.layout import Layout

# State names with a fixed meaning; optimizer states keep the optimizer's own names.
MASTER = "fp32"        # the fp32 master copy of a trainable parameter
MODULE = "module"      # the model's state_dict value as saved (16-bit copy, frozen params, buffers)


@dataclass(frozen=True, slots=True)
class Fragment:
    start: int           # first element of the shard held here (flat, row-major)
    stop: int            # one past the last
    storage: Storage
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


@dataclass(frozen=True)
class SplitScalar:
    """An optimizer scalar (Adam's `step`) that differs between the params of one group. group_scalars keeps
    one value per group (`kept`), so until the catalog carries per-parameter scalars, writers refuse it."""
    path: str          # the file that holds the values
    group: int
    key: str
    kept: float        # the group's value in group_scalars
    other: float       # the value of `param`
    param: str


@dataclass
class LogicalTensor:
    name: str
    state: str
    shape: tuple
    dtype: str
    fragments: list = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def key(self) -> tuple:
        return (self.name, self.state)


@dataclass
class Replica:
    copy: LogicalTensor      # same name/state/shape as the catalog's tensor; fragments from another holder
    holder: str              # who holds the copy, for messages ("tensor-parallel rank 1")
    first: str               # who holds the catalog's own elements there
    checked: bool = False


@dataclass
class ParamInfo:
    name: str
    shape: tuple
    kind: str                  # "trainable", "frozen" or "buffer"
    group: int | None = None   # optimizer param group of a trainable param


@dataclass
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
    lr_scheduler: object = None     # the lr scheduler's state_dict, as saved (plain data)
    optimizer: str = ""             # the optimizer class the checkpoint names ("": none; Contents guesses it)


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds, computed from its catalog alone (Catalog.contents) whatever its format."""
    optimizer: str       # "Adam", "AdamW", "SGD", ...: as the checkpoint names it, else told by its states; "": unknown
    states: list         # per-element optimizer state names, in file order
    params: int          # trainable + frozen parameters (aliases not counted)
    elements: int        # elements in those parameters
    step: int | None     # optimizer step count (the largest of the param groups'); None: none saved


class FormatNotes(Protocol):
    """What one format's reader keeps for that format's writers (DeepSpeed's config, how tensor parallelism cut
    each parameter, ...): a typed object the format owns. The core never looks inside; it only asks for what the
    format knows of one parameter, for `inspect --params`."""

    def param_details(self, name: str) -> dict:
        """Plain data on how parameter `name` is held ({} when nothing beyond the catalog's own facts)."""


@dataclass
class Catalog:
    root: str                              # the directory the files are relative to
    format: str                            # e.g. "deepspeed"
    layout: "Layout"
    tensors: dict = field(default_factory=dict)        # (name, state) -> LogicalTensor
    params: dict = field(default_factory=dict)         # name -> ParamInfo, model order
    aliases: dict = field(default_factory=dict)        # tied name -> the name holding the data
    order: list = field(default_factory=list)          # the model's state_dict keys, in order (aliases too)
    param_groups: list = field(default_factory=list)   # [{hyper-params..., "params": [names, optimizer order]}]
    group_scalars: list = field(default_factory=list)  # per group: {"step": ScalarTensor | value}
    split_scalars: list = field(default_factory=list)  # [SplitScalar]: per-param scalars group_scalars cannot hold
    tag: str = ""                                      # the save's name (a DeepSpeed tag), for output
    training: TrainingState = field(default_factory=TrainingState)
    # taken for frozen params, but maybe floating-point buffers: the source does not say which
    maybe_buffers: list = field(default_factory=list)
    notes: FormatNotes | None = None                   # the reader's format's own notes (see FormatNotes)
    files: list = field(default_factory=list)          # FileInfo of every file read or expected
    problems: list = field(default_factory=list)       # what the reader found wrong, one line each
    # Second copies of replicated data (a norm weight on every TP rank): each a LogicalTensor whose
    # fragments hold, at the same flat positions, elements the catalog's own tensor holds. They must be
    # equal; readers compare the small ones, `validate --deep` every one not yet compared.
    replicas: list = field(default_factory=list)       # [Replica]
    # The folder the whole save lives in, which output must not overlap; None: root's parent
    # (a DeepSpeed tag folder's save dir). A DCP directory is its own save dir.
    save_dir: str | None = None

    def add(self, tensor: LogicalTensor) -> LogicalTensor:
        return self.tensors.setdefault(tensor.key, tensor)

    def tensor(self, name: str, state: str) -> LogicalTensor:
        try:
            return self.tensors[(self.aliases.get(name, name), state)]
        except KeyError:
            raise KeyError(f"no tensor {name!r} with state {state!r} in this checkpoint") from None

    def states(self) -> list:
        """State names present, master and module first, then optimizer states in file order."""
        seen = dict.fromkeys(s for _, s in self.tensors)
        first = [s for s in (MASTER, MODULE) if s in seen]
        return first + [s for s in seen if s not in first]

    def optimizer_states(self) -> list:
        return [s for s in self.states() if s not in (MASTER, MODULE)]

    def contents(self) -> Contents:
        states = self.optimizer_states()
        counted = [p for p in self.params.values() if p.kind != "buffer"]
        steps = {getattr(s["step"], "value", s["step"]) for s in self.group_scalars if s.get("step") is not None}
        return Contents(optimizer=self.training.optimizer or optimizers.kind(states, self.param_groups),
                        states=states, params=len(counted), elements=sum(math.prod(p.shape) for p in counted),
                        step=int(max(steps)) if steps else None)

    def bytes_per_state(self) -> dict:
        from reshard.dtypes import itemsize
        out = {}
        for t in self.tensors.values():
            out[t.state] = out.get(t.state, 0) + t.numel * itemsize(t.dtype)
        return out

    def weight_dtypes(self) -> tuple:
        """(model dtype, master dtype) where the weights are saved as the optimizer updated them (no separate
        16-bit copy): the trainable params' dtypes, their master's where one is registered, else theirs. Weights
        only: the floating params' dtype and no master (""). "" also when weights-only dtypes are mixed."""
        trainable = [p.name for p in self.params.values() if p.kind == "trainable"]
        if not trainable:
            saved = {self.tensors[(p.name, MODULE)].dtype for p in self.params.values()
                     if p.kind == "frozen" and (p.name, MODULE) in self.tensors}
            return (saved.pop() if len(saved) == 1 else ""), ""
        saved = {self.tensors[(n, MODULE)].dtype for n in trainable}
        masters = {self.tensors[(n, MASTER) if (n, MASTER) in self.tensors else (n, MODULE)].dtype for n in trainable}
        # mixed precisions: a DeepSpeed target keeps a float32 master and 16-bit copy of each
        return (saved.pop() if len(saved) == 1 else "float32"), (masters.pop() if len(masters) == 1 else "float32")

    def require_group_scalars(self, target: str) -> None:
        """Refuse to write `target` (which would get the group's one value for every param) when an optimizer
        scalar differs between the params of a group: the source is readable, only its state cannot be carried."""
        if self.split_scalars:
            s = self.split_scalars[0]
            raise ReshardError(f"{s.path}: param group {s.group}: optimizer {s.key} differs between parameters "
                               f"({_number(s.kept)} vs {_number(s.other)} at {s.param}); reshard keeps one per group, "
                               f"so {target} is not written")

    def problem(self, path, text: str) -> None:
        self.problems.append(f"{path}: {text}")


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
