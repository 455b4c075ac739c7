"""Per-param-group optimizer scalars (`step`), which every rank and sub-group repeats."""
from __future__ import annotations

from reshard.catalog import ScalarTensor
from reshard.formats.torchzip import TensorRef
from reshard.tensorio import read_scalar


def record(catalog, path: str, g: int, key: str, value) -> None:
    """Keep the first value seen for group g; any later one that differs is a problem of `path`."""
    if isinstance(value, TensorRef):
        value = ScalarTensor(read_scalar(value), value.dtype)
    scalars = catalog.group_scalars[g] if g < len(catalog.group_scalars) else {}
    if key not in scalars:
        scalars[key] = value
    elif scalars[key] != value:
        catalog.problem(path, f"param group {g}: optimizer {key} is {_plain(value)} but another rank or sub-group "
                        f"has {_plain(scalars[key])} (a file from another save?)")


def _plain(value):
    return value.value if isinstance(value, ScalarTensor) else value
