"""reshard: convert, export, validate and inspect distributed training checkpoints.

The Python API:

    catalog = reshard.open_checkpoint("ckpt/")            # metadata only, nothing executed
    info = reshard.inspect(catalog, params=True)           # plain data (what `reshard inspect --json` prints)
    report = reshard.validate(catalog, deep=False)         # report.ok, report.problems
    weight = reshard.full_tensor(catalog, "l1.weight", "fp32")   # a torch tensor, bit-exact
    run = reshard.list_checkpoints("out/")                 # every checkpoint of a run, complete or not
    plan = reshard.prune("out/", reshard.Policy(keep_last=3), yes=False)   # the plan; yes=True deletes
    watcher = reshard.Watcher("out/", reshard.Policy(keep_last=3))   # watcher.poll(): one pass; .run(): until .stop()
"""
from __future__ import annotations

import os

from reshard.errors import CheckpointError, ReshardError, UnknownFormatError
from reshard.inspection import inspect
from reshard.pruning import prune
from reshard.retention import Policy
from reshard.listing import RECENT_SECONDS, list_checkpoints
from reshard.source_bytes import full_tensor
from reshard.validate import validate
from reshard.version import __version__
from reshard.watching import Watcher


def open_checkpoint(path, tag: str | None = None, layout_rules: str | None = None):
    """Read a checkpoint's metadata into a Catalog (see reshard.core.catalog). `layout_rules`: a rule file
    saying how tensor parallelism cut the tensors, for checkpoints that do not carry it (a path, or the name
    of one shipped with reshard: "megatron-gpt", "llama-autotp")."""
    from reshard.formats import read
    try:
        return read(str(path), tag, layout_rules)
    except UnknownFormatError as e:
        raise _run_directory_hint(str(path)) or e from None


def _run_directory_hint(path: str) -> ReshardError | None:
    """A run directory given where one checkpoint is expected: the error points at `reshard list`."""
    from reshard.formats.run_layout import scan
    if not os.path.isdir(path):
        return None
    try:
        found = scan(path).entries
    except ReshardError:
        return None
    if not found:
        return None
    names = ", ".join(sorted(e.name for e in found)[:3]) + (", ..." if len(found) > 3 else "")
    return UnknownFormatError.at(path, f"a run directory of {len(found)} checkpoint{'s' * (len(found) != 1)} "
                                       f"({names}), not one checkpoint: `reshard list {path}` shows them")


__all__ = ["open_checkpoint", "inspect", "validate", "full_tensor", "list_checkpoints", "prune", "Policy", "Watcher",
           "RECENT_SECONDS", "ReshardError", "CheckpointError", "__version__"]
