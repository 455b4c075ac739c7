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

from reshard.errors import CheckpointError, ReshardError
from reshard.inspect import inspect
from reshard.pruning import prune
from reshard.retention import Policy
from reshard.runs import RECENT_SECONDS, list_checkpoints
from reshard.tensorio import full_tensor
from reshard.validate import validate
from reshard.version import __version__
from reshard.watching import Watcher


def open_checkpoint(path, tag: str | None = None, layout_rules: str | None = None):
    """Read a checkpoint's metadata into a Catalog (see reshard.catalog). `layout_rules`: a rule file
    saying how tensor parallelism cut the tensors, for checkpoints that do not carry it (a path, or the name
    of one shipped with reshard: "megatron-gpt", "llama-autotp")."""
    from reshard.formats import read
    return read(str(path), tag, layout_rules)


__all__ = ["open_checkpoint", "inspect", "validate", "full_tensor", "list_checkpoints", "prune", "Policy", "Watcher",
           "RECENT_SECONDS", "ReshardError", "CheckpointError", "__version__"]
