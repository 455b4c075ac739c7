"""diff: two checkpoints, any formats and topologies, compared logical tensor by logical tensor.

What is compared is what both checkpoints mean, not how they are stored:
- the weights: for every parameter and buffer, its master copy where there is one, else the saved
  value (so an fp32 export compares with the fp32 master of the ZeRO checkpoint it came from);
- the 16-bit module copy of trainable parameters, where both keep one beside a master;
- a tensor stored in another dtype with every value equal (bf16 frozen params exported as fp32)
  is noted, not counted; with values changed, the dtype is a difference too;
- every optimizer state both hold. When only one side holds optimizer state at all (an export
  next to its source), that is said once and is not a difference; when both do, a state present
  on one side only is.
Values are compared as numbers: -0.0 equals 0.0, inf equals inf, and a NaN equals a NaN at the same
element whatever its bits (payload and sign carry no value, and a cast between dtypes changes them:
torch writes every bfloat16 NaN as 0x7FC0); NaNs at the same elements with other bits in two tensors
of one dtype are noted, not counted. A NaN facing a number, and an infinity facing anything but
itself, are counted apart from the largest finite difference (which --atol bounds), with the first
element where each occurs.
Values stream through in blocks of both sides' memory maps; memory does not grow with size.
Every non-tensor value both hold is compared exactly (--atol bounds tensors only): optimizer steps and
hyper-parameters per trainable param, training counters, the lr scheduler's state, the format's own (loss
scaler, client state). What the reader found wrong in one side's files only (a rank's step disagreeing with
the others') is a difference too.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from reshard.core.catalog import MASTER, MODULE, Catalog, ScalarTensor, TensorKey
from reshard.core.dtypes import is_floating, itemsize
from reshard.core.locate import Locator
from reshard.execution.progress import bar as progress_bar
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import MappedFiles, read_range, read_scalar
from reshard.text import counted

BLOCK = 1 << 22     # elements per comparison step


@dataclass(frozen=True)
class Difference:
    name: str
    state: str
    # "missing" (only in A), "extra" (only in B), "shape", "dtype", "values"; "scalar": a non-tensor value;
    # "problem": what the reader found wrong in one side's files only (name: the side)
    kind: str
    detail: str
    max_abs_diff: float | None = None        # over the elements finite on both sides
    nan_mismatches: int = 0                  # elements NaN on one side only
    first_nan_mismatch: int | None = None
    inf_mismatches: int = 0                  # elements infinite on one side, or inf facing -inf
    first_inf_mismatch: int | None = None

    def line(self) -> str:
        if self.kind == "problem":
            return f"{self.name}: {self.detail}"
        return f"{self.name} ({self.state}): {self.detail}"


@dataclass(frozen=True)
class DiffReport:
    """What diff found: `differences` (none: the checkpoints are equal) and `notes` (what is equal only up to
    a representation: a dtype, NaN bits; what one side alone holds and is not counted)."""
    a: str
    b: str
    atol: float
    compared: int                           # logical tensors compared value by value
    elements: int
    differences: tuple[Difference, ...]
    notes: tuple[str, ...]

    @property
    def equal(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        tol = f" (atol {self.atol:g})" if self.atol else ""
        if self.equal:
            return (f"no difference{tol}: {counted(self.compared, 'tensor')}, {counted(self.elements, 'element')} "
                    "compared")
        return (f"DIFFERENT{tol}: {counted(len(self.differences), 'difference')}; {counted(self.compared, 'tensor')}, "
                f"{counted(self.elements, 'element')} compared")

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "atol": self.atol, "equal": self.equal, "compared": self.compared,
                "elements": self.elements, "notes": list(self.notes),
                "differences": [vars(d) for d in self.differences]}


@dataclass
class _Found:
    """What the comparison finds, as it goes; frozen into a DiffReport at the end."""
    atol: float
    compared: int = 0
    elements: int = 0
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    recast: dict = field(default_factory=dict)   # (dtype A, dtype B) -> tensors whose values are all equal
    nan_bits: list = field(default_factory=list)  # tensors with NaNs at the same places but other bits


def diff(a: Catalog, b: Catalog, atol: float = 0.0, progress: bool = False) -> DiffReport:
    """`progress`: a bar of the bytes read on stderr, when it is a terminal."""
    report = _Found(atol)
    pairs = _pairs(a, b, report)
    both = [(a.tensors[key_a], b.tensors[key_b]) for _, key_a, key_b in pairs if key_a and key_b]
    total = sum(ta.numel * (itemsize(ta.dtype) + itemsize(tb.dtype)) for ta, tb in both
                if tuple(ta.shape) == tuple(tb.shape))      # the bytes read: a tensor of another shape is not
    with MappedFiles() as files_a, MappedFiles() as files_b, progress_bar(total, "comparing", progress) as bar:
        for label, key_a, key_b in pairs:
            if key_a is None or key_b is None:
                side, key = ("missing", key_a) if key_b is None else ("extra", key_b)
                where = "A" if side == "missing" else "B"
                report.differences.append(Difference(label[0], label[1], side, f"only in {where}"))
                continue
            _compare(a.tensors[key_a], b.tensors[key_b], label, files_a, files_b, report, bar)
        files_a.verify()        # values from a corrupt member are no answer: an error, not a difference
        files_b.verify()
    for (dtype_a, dtype_b), which in report.recast.items():
        report.notes.append(f"{counted(len(which), 'tensor')} stored as {dtype_a} in A and {dtype_b} in B with "
                            f"every value equal: {_some(which)}")
    if report.nan_bits:
        report.notes.append(f"{counted(len(report.nan_bits), 'tensor')} hold NaNs with other bits (payload or sign) "
                            f"at the same elements in A and B, counted equal: {_some(report.nan_bits)}")
    _compare_scalars(a, b, report)
    _compare_problems(a, b, report)
    _compare_companions(a, b, atol, progress, report)
    return DiffReport(a.root, b.root, atol, report.compared, report.elements, tuple(report.differences),
                      tuple(report.notes))


def _compare_companions(a: Catalog, b: Catalog, atol: float, progress: bool, report: _Found) -> None:
    """The other models of each checkpoint (a verl step's critic), paired by their folder: each compared as its own
    checkpoint, its differences named under its folder; one only one side holds, a difference."""
    others = dict(b.companion_folders())
    for folder, each in a.companion_folders():
        if folder not in others:
            report.differences.append(Difference(f"{folder}/", "model", "missing", "only in A"))
            continue
        inner = diff(each, others.pop(folder), atol, progress)
        report.compared += inner.compared
        report.elements += inner.elements
        report.differences += [replace(d, name=f"{folder}/{d.name}") for d in inner.differences]
        report.notes += [f"{folder}/: {note}" for note in inner.notes]
    report.differences += [Difference(f"{folder}/", "model", "extra", "only in B") for folder in others]


def _compare_scalars(a: Catalog, b: Catalog, report: _Found) -> None:
    """Every non-tensor value both hold, exactly (--atol is for tensors): each trainable param's optimizer
    scalars (its own step, or its group's) and its group's hyper-parameters, one difference per scalar and pair
    of values with the params that have it; the training counters, the lr scheduler's state and what the format
    keeps (loss scaler, client state), each leaf by its path, one only one side holds noted."""
    params_a, params_b = _param_scalars(a), _param_scalars(b)
    differing: dict[tuple, list[str]] = {}      # (scalar, value A, value B) -> [params], in A's order
    for (name, key), va in params_a.items():
        vb = params_b.get((name, key), va)
        if not _same_scalar(va, vb):
            differing.setdefault((key, repr(va), repr(vb)), []).append(name)
    for (key, va, vb), names in differing.items():
        report.differences.append(Difference(_some(names), key, "scalar", f"{key} {va} in A, {vb} in B "
                                             f"({counted(len(names), 'param')})"))
    globals_a, globals_b = _global_scalars(a), _global_scalars(b)
    for label in [k for k in globals_a if k in globals_b]:
        va, vb = globals_a[label], globals_b[label]
        if not _same_scalar(va, vb):
            report.differences.append(Difference(label, "scalar", "scalar", f"{va!r} in A, {vb!r} in B"))
    for side, mine, theirs in (("A", globals_a, globals_b), ("B", globals_b, globals_a)):
        only = [k for k in mine if k not in theirs]
        if only and theirs:     # a side with none (an export) holds no training state at all
            report.notes.append(f"{counted(len(only), 'scalar')} only in {side}, not compared: {_some(only)}")


def _param_scalars(catalog: Catalog) -> dict:
    """{(trainable param, scalar): value}: its optimizer scalars and its group's hyper-parameters (leaves)."""
    out: dict[tuple[str, str], Any] = {}
    for p in catalog.params.values():
        if p.kind != "trainable" or p.name in catalog.aliases:
            continue
        for key, value in catalog.scalars_of_param(p.name).items():
            _leaves(value, key, out, p.name)
        if p.group is not None and p.group < len(catalog.param_groups):
            for key, value in catalog.param_groups[p.group].items():
                if key != "params" and not (catalog.notes is not None and catalog.notes.layout_scalar(key, value)):
                    _leaves(value, key, out, p.name)
    return out


def _global_scalars(catalog: Catalog) -> dict:
    """{path: value} of the training state's leaves and the format's own (catalog.FormatNotes.scalars)."""
    out: dict[str, Any] = {}
    training = catalog.training
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler"):
        if getattr(training, key) is not None:
            _leaves(getattr(training, key), key, out)
    for key, value in (catalog.notes.scalars() if catalog.notes is not None else {}).items():
        _leaves(value, key, out)
    return out


def _leaves(value, path: str, out: dict, param: str | None = None) -> None:
    """Plain values of `value` by path (`lr_scheduler.base_lrs[0]`) into `out` (keyed (param, path) for a
    param's): a one-element tensor as its value, a bigger one as its dtype and shape."""
    if isinstance(value, dict):
        for k, v in value.items():
            _leaves(v, f"{path}.{k}", out, param)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _leaves(v, f"{path}[{i}]", out, param)
    else:
        if isinstance(value, ScalarTensor):
            value = value.value
        elif isinstance(value, TensorRef):
            value = read_scalar(value) if value.numel == 1 else f"tensor {value.dtype}{list(value.shape)}"
        elif isinstance(value, Enum):
            value = value.value
        elif hasattr(value, "__dict__"):      # a stand-in for a framework object (DeepSpeed's LossScaler)
            _leaves(vars(value), path, out, param)
            return
        out[(param, path) if param is not None else path] = value


def _same_scalar(a, b) -> bool:
    """Exactly equal: as numbers whatever they are saved as (3, 3.0, a one-element tensor); a NaN equals a NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _compare_problems(a: Catalog, b: Catalog, report: _Found) -> None:
    """What the reader found wrong in one side's files and not in the other's (one rank's step from another
    save among the others) is a difference: such a checkpoint holds two values where the other holds one."""
    seen = [{str(p).replace(c.root + os.sep, "") for p in c.problems} for c in (a, b)]
    for side, catalog, other in (("A", a, seen[1]), ("B", b, seen[0])):
        for problem in map(str, catalog.problems):
            if problem.replace(catalog.root + os.sep, "") not in other:
                report.differences.append(Difference(f"{side} only", "files", "problem", problem))


def _not_the_master(module, master) -> bool:
    """A module copy that is not its master's own elements: bytes of its own, or the master cast (a universal
    checkpoint's expert weights)."""
    return module.fragments != master.fragments or module.dtype != master.dtype


def _some(names: list) -> str:
    return f"{', '.join(names[:3])}{' …' if len(names) > 3 else ''}"


def _pairs(a: Catalog, b: Catalog, report: _Found) -> list:
    """[(label (name, state), key in A or None, key in B or None)] in A's model order, then B's extras."""
    pairs = []
    names = [n for n in a.params if n not in a.aliases] + \
        [n for n in b.params if n not in b.aliases and n not in a.params]
    masters_one_side = ""
    for name in names:
        key_a, key_b = _weight_key(a, name), _weight_key(b, name)
        if key_a and key_b and {key_a[1], key_b[1]} == {MASTER, MODULE} and a.format == b.format:
            # one side the format's weights-only form (thinned): its weights are the 16-bit copy the other keeps
            # beside its master (an export in another format is compared with the master, as it was made from it)
            full, thin = (a, b) if key_a[1] == MASTER else (b, a)
            full_name, thin_name = (key_a[0], key_b[0]) if full is a else (key_b[0], key_a[0])
            module = full.tensors.get(TensorKey(full_name, MODULE))
            if module is not None and module.dtype == thin.tensors[TensorKey(thin_name, MODULE)].dtype != \
                    full.tensors[TensorKey(full_name, MASTER)].dtype:
                key_a, key_b = (key_a[0], MODULE), (key_b[0], MODULE)
                masters_one_side = "A" if full is a else "B"
        pairs.append(((name, "weight"), key_a, key_b))
    if masters_one_side:
        report.notes.append(f"only {masters_one_side} holds fp32 masters beside its 16-bit weights (optimizer "
                            "state); the 16-bit weights compared")
    for name in names:       # the 16-bit copy, where both sides keep it beside a master (its bytes or a cast)
        if all((name, MASTER) in c.tensors and (name, MODULE) in c.tensors and
               _not_the_master(c.tensors[TensorKey(name, MODULE)], c.tensors[TensorKey(name, MASTER)]) for c in (a, b)):
            pairs.append(((name, MODULE), (name, MODULE), (name, MODULE)))
    states_a, states_b = a.optimizer_states(), b.optimizer_states()
    if states_a and states_b:
        for state in states_a + [s for s in states_b if s not in states_a]:
            for name in names:
                in_a, in_b = (name, state) in a.tensors, (name, state) in b.tensors
                if in_a or in_b:
                    pairs.append(((name, state), (name, state) if in_a else None, (name, state) if in_b else None))
    elif states_a or states_b:
        side = "A" if states_a else "B"
        report.notes.append(f"only {side} holds optimizer state ({', '.join(states_a or states_b)}); "
                            "weights compared")
    return pairs


def _weight_key(catalog: Catalog, name: str):
    name = catalog.aliases.get(name, name)
    for state in (MASTER, MODULE):
        if (name, state) in catalog.tensors:
            return (name, state)
    return None


def _compare(ta, tb, label, files_a, files_b, report, bar) -> None:
    name, state = label
    if tuple(ta.shape) != tuple(tb.shape):
        report.differences.append(Difference(name, state, "shape", f"shape {list(ta.shape)} != {list(tb.shape)}"))
        return
    tally = _Tally()
    frags_a, frags_b = Locator(ta), Locator(tb)
    for start in range(0, ta.numel, BLOCK):
        stop = min(start + BLOCK, ta.numel)
        tally.add(start, read_range(files_a, ta, start, stop, frags_a), ta.dtype,
                  read_range(files_b, tb, start, stop, frags_b), tb.dtype)
        bar.update((stop - start) * (itemsize(ta.dtype) + itemsize(tb.dtype)))
    report.compared += 1
    report.elements += ta.numel
    if tally.nan_bits:
        report.nan_bits.append(f"{name} ({state})")
    if ta.dtype != tb.dtype:
        if tally.equal():     # every value survived the change of dtype (an fp32 export of bf16 frozen params)
            report.recast.setdefault((ta.dtype, tb.dtype), []).append(f"{name} ({state})")
        else:
            report.differences.append(Difference(name, state, "dtype", f"dtype {ta.dtype} != {tb.dtype}"))
    if tally.worst > report.atol or tally.nan or tally.inf:
        report.differences.append(tally.difference(name, state, report.atol))


class _Tally:
    """What one tensor pair's blocks showed: the largest finite gap, NaN and infinity mismatches."""

    def __init__(self):
        self.worst, self.worst_at = 0.0, None
        self.nan, self.nan_at = 0, None
        self.inf, self.inf_at = 0, None
        self.nan_bits = 0           # NaN on both sides, other bits (same dtype only)

    def equal(self) -> bool:
        return self.worst == 0 and not self.nan and not self.inf

    def add(self, start: int, raw_a: np.ndarray, dtype_a: str, raw_b: np.ndarray, dtype_b: str) -> None:
        va, vb = _values(raw_a, dtype_a), _values(raw_b, dtype_b)
        nan_a, nan_b = np.isnan(va), np.isnan(vb)       # all False for integers
        nan = nan_a != nan_b
        if nan.any():
            self.nan += int(np.count_nonzero(nan))
            self.nan_at = start + int(np.argmax(nan)) if self.nan_at is None else self.nan_at
        both = np.flatnonzero(nan_a & nan_b)
        if dtype_a == dtype_b and both.size:
            bits_a, bits_b = (r.view(np.uint8).reshape(r.size, -1)[both] for r in (raw_a, raw_b))
            self.nan_bits += int(np.count_nonzero((bits_a != bits_b).any(axis=1)))
        number = ~(nan_a | nan_b)
        same = va == vb                                 # inf == inf, -0.0 == 0.0
        inf = (np.isinf(va) | np.isinf(vb)) & number & ~same
        if inf.any():
            self.inf += int(np.count_nonzero(inf))
            self.inf_at = start + int(np.argmax(inf)) if self.inf_at is None else self.inf_at
        finite = number & ~same & ~inf
        if finite.any():
            kind = np.result_type(va.dtype, vb.dtype, np.float64)
            with np.errstate(over="ignore"):           # two huge float64 values of opposite signs
                gap = np.abs(va[finite].astype(kind) - vb[finite].astype(kind))
            i = int(np.argmax(gap))
            if gap[i] > self.worst:
                self.worst, self.worst_at = float(gap[i]), start + int(np.flatnonzero(finite)[i])

    def difference(self, name: str, state: str, atol: float) -> Difference:
        parts = []
        if self.worst > atol:
            parts.append(f"max abs diff {self.worst:.6g} at element {self.worst_at}")
        if self.nan:
            parts.append(f"NaN on one side only at {self.nan:,} element(s), first at element {self.nan_at}")
        if self.inf:
            parts.append(f"infinity facing another value at {self.inf:,} element(s), first at element {self.inf_at}")
        return Difference(name, state, "values", "; ".join(parts), self.worst, self.nan, self.nan_at, self.inf,
                          self.inf_at)


def _values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Values to compare: float64 for floating types, complex128 for complex, int64 for the rest."""
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if is_floating(dtype):
        return raw.astype(np.float64)
    if dtype.startswith("complex"):
        return raw.astype(np.complex128)
    return raw.astype(np.int64)
