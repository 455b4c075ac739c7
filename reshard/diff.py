"""diff: two checkpoints, any formats and topologies, compared logical tensor by logical tensor.

What is compared is what both checkpoints mean, not how they are stored:
- the weights: for every parameter and buffer, its master copy where there is one, else the saved
  value (so an fp32 export compares with the fp32 master of the ZeRO checkpoint it came from);
- the 16-bit module copy of trainable parameters, where both keep one beside a master;
- every optimizer state both hold. When only one side holds optimizer state at all (an export
  next to its source), that is said once and is not a difference; when both do, a state present
  on one side only is.
Values stream through in blocks of both sides' memory maps; memory does not grow with size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reshard.catalog import MASTER, MODULE, Catalog
from reshard.dtypes import is_floating
from reshard.tensorio import MappedFiles, read_range, sorted_fragments

BLOCK = 1 << 22     # elements per comparison step


@dataclass
class Difference:
    name: str
    state: str
    kind: str                  # "missing" (only in A), "extra" (only in B), "shape", "dtype", "values"
    detail: str
    max_abs_diff: float | None = None

    def line(self) -> str:
        return f"{self.name} ({self.state}): {self.detail}"


@dataclass
class DiffReport:
    a: str
    b: str
    atol: float
    compared: int = 0           # logical tensors compared value by value
    elements: int = 0
    differences: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        tol = f" (atol {self.atol:g})" if self.atol else ""
        if self.equal:
            return f"no difference{tol}: {self.compared} tensors, {self.elements:,} elements compared"
        return (f"DIFFERENT{tol}: {len(self.differences)} difference(s); {self.compared} tensors, "
                f"{self.elements:,} elements compared")

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "atol": self.atol, "equal": self.equal, "compared": self.compared,
                "elements": self.elements, "notes": self.notes,
                "differences": [vars(d) for d in self.differences]}


def diff(a: Catalog, b: Catalog, atol: float = 0.0) -> DiffReport:
    report = DiffReport(a.root, b.root, atol)
    pairs = _pairs(a, b, report)
    with MappedFiles() as files_a, MappedFiles() as files_b:
        for label, key_a, key_b in pairs:
            if key_a is None or key_b is None:
                side, key = ("missing", key_a) if key_b is None else ("extra", key_b)
                where = "A" if side == "missing" else "B"
                report.differences.append(Difference(label[0], label[1], side, f"only in {where}"))
                continue
            _compare(a.tensors[key_a], b.tensors[key_b], label, files_a, files_b, report)
    if a.layout.step is not None and b.layout.step is not None and a.layout.step != b.layout.step:
        report.differences.append(Difference("-", "step", "values", f"optimizer step {a.layout.step} != "
                                             f"{b.layout.step}"))
    return report


def _pairs(a: Catalog, b: Catalog, report: DiffReport) -> list:
    """[(label (name, state), key in A or None, key in B or None)] in A's model order, then B's extras."""
    pairs = []
    names = [n for n in a.params if n not in a.aliases] + \
        [n for n in b.params if n not in b.aliases and n not in a.params]
    for name in names:
        pairs.append(((name, "weight"), _weight_key(a, name), _weight_key(b, name)))
    for name in names:       # the 16-bit copy, where both sides keep it beside a master
        if all((name, MASTER) in c.tensors and (name, MODULE) in c.tensors and
               c.tensors[(name, MODULE)].fragments != c.tensors[(name, MASTER)].fragments for c in (a, b)):
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


def _compare(ta, tb, label, files_a, files_b, report) -> None:
    name, state = label
    if tuple(ta.shape) != tuple(tb.shape):
        report.differences.append(Difference(name, state, "shape", f"shape {list(ta.shape)} != {list(tb.shape)}"))
        return
    if ta.dtype != tb.dtype:
        report.differences.append(Difference(name, state, "dtype", f"dtype {ta.dtype} != {tb.dtype}"))
    worst, where = 0.0, None
    frags_a, frags_b = sorted_fragments(ta), sorted_fragments(tb)
    for start in range(0, ta.numel, BLOCK):
        stop = min(start + BLOCK, ta.numel)
        va = _values(read_range(files_a, ta, start, stop, frags_a), ta.dtype)
        vb = _values(read_range(files_b, tb, start, stop, frags_b), tb.dtype)
        gap = _abs_diff(va, vb)
        i = int(np.argmax(gap)) if gap.size else 0
        if gap.size and gap[i] > worst:
            worst, where = float(gap[i]), start + i
    report.compared += 1
    report.elements += ta.numel
    if worst > report.atol:
        report.differences.append(Difference(name, state, "values",
                                             f"max abs diff {worst:.6g} at element {where}", worst))


def _values(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if is_floating(dtype):
        return raw.astype(np.float64)
    return raw.astype(np.int64)


def _abs_diff(va: np.ndarray, vb: np.ndarray) -> np.ndarray:
    """|a - b| per element; equal values (NaN with NaN, inf with inf) give 0, one NaN gives inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        gap = np.abs(va.astype(np.float64) - vb.astype(np.float64))
    same = (va == vb)
    if np.issubdtype(va.dtype, np.floating) or np.issubdtype(vb.dtype, np.floating):
        same |= np.isnan(va) & np.isnan(vb)
    gap[same] = 0.0
    gap[np.isnan(gap)] = np.inf
    return gap
