"""Per-param-group optimizer scalars (`step`), which every rank and sub-group of a DeepSpeed save repeats."""
from __future__ import annotations

from reshard.catalog import PerParamScalar, ScalarTensor
from reshard.formats.torchzip import TensorRef
from reshard.tensorio import read_scalar


def record(catalog, path: str, g: int, key: str, value) -> None:
    """Keep the first value seen for group g; any later one that differs is a problem of `path`."""
    value = scalar(value)
    scalars = catalog.group_scalars[g] if g < len(catalog.group_scalars) else {}
    if isinstance(scalars.get(key), PerParamScalar):
        catalog.problem(path, f"param group {g}: optimizer {key} is saved here per group, and per parameter in "
                        f"{next(iter(scalars[key].files.values()))}")
    elif key not in scalars:
        scalars[key] = value
    elif scalars[key] != value:
        catalog.problem(path, f"param group {g}: optimizer {key} is {_plain(value)} but another rank or sub-group "
                        f"has {_plain(scalars[key])} (a file from another save?)")


def scalar(value):
    """A one-element tensor as its value and dtype (no storage kept); any other value as it is."""
    if isinstance(value, TensorRef):
        return ScalarTensor(read_scalar(value), value.dtype)
    return value


def _plain(value):
    return value.value if isinstance(value, ScalarTensor) else value
