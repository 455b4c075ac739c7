"""Per-param-group optimizer scalars (`step`), which every rank and sub-group of a DeepSpeed save repeats.

The files must agree; when one does not, the one at fault is the odd one out: the value most files hold is
taken, and each file holding another is named (a rank file from another save among the others). With no value
most files hold (two ranks, two values) nothing tells which is right, and every file is named with its value.
"""
from __future__ import annotations

from typing import Any

from reshard.core.catalog import PerParamScalar, ScalarTensor
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import read_scalar
from reshard.text import counted


class Votes:
    """Each file's values of the group scalars of one catalog, settled (`settle`) once every file is read."""

    def __init__(self, catalog):
        self.catalog = catalog
        self.held = {}      # (group, key) -> [(file, value)], in the order read

    def add(self, path: str, g: int, key: str, value) -> None:
        self.held.setdefault((g, key), []).append((path, scalar(value)))

    def settle(self) -> None:
        """Into the catalog: each group scalar's agreed value, and a problem for each file that disagrees."""
        catalog = self.catalog
        for (g, key), held in self.held.items():
            scalars = catalog.group_scalars[g] if g < len(catalog.group_scalars) else {}
            if isinstance(scalars.get(key), PerParamScalar):
                catalog.problem(held[0][0], f"param group {g}: optimizer {key} is saved here per group, and per "
                                f"parameter in {next(iter(scalars[key].files.values()))}")
                continue
            scalars[key], problems = agreed(held, f"param group {g}: optimizer {key}")
            for path, text in problems:
                catalog.problem(path, text)


def agreed(held: list, what: str) -> tuple:
    """(the value most files hold, [(file, problem)]) for `held` [(file, its value of `what`)], values the files
    must agree on: each file holding another value than most is named; with no value held by most, every file
    is, with its value and the others'. (The value: the first one read when no value is held by most.)"""
    values: list[tuple[Any, list[str]]] = []     # [(value, [files])], in the order first read
    for path, value in held:
        for seen, paths in values:
            if seen == value:
                paths.append(path)
                break
        else:
            values.append((value, [path]))
    if len(values) == 1:
        return values[0][0], []
    by_count = sorted(values, key=lambda v: -len(set(v[1])))    # stable: between equal counts, the first read
    top, top_files = by_count[0][0], set(by_count[0][1])
    if len(top_files) > len(set(by_count[1][1])):
        return top, [(path, f"{what} is {_plain(value)} here, {_plain(top)} in the other "
                            f"{counted(len(top_files), 'file')} (a file from another save?)")
                     for value, paths in by_count[1:] for path in dict.fromkeys(paths)]
    problems = []
    for value, paths in values:
        others = "; ".join(f"{_plain(v)} in {', '.join(dict.fromkeys(p))}" for v, p in values if v != value)
        problems += [(path, f"{what} is {_plain(value)} here, {others}, and no value is held by most files: "
                            "which is right is not known (a file from another save?)")
                     for path in dict.fromkeys(paths)]
    return values[0][0], problems


def scalar(value):
    """A one-element tensor as its value and dtype (no storage kept); any other value as it is."""
    if isinstance(value, TensorRef):
        return ScalarTensor(read_scalar(value), value.dtype)
    return value


def _plain(value):
    return value.value if isinstance(value, ScalarTensor) else value
