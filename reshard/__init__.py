"""reshard: convert, export, validate and inspect distributed training checkpoints.

The Python API mirrors the CLI, one function per command, each returning a typed result (docs/api.md):

    info = reshard.inspect("ckpt/")                      # Inspection: topology, dtypes, optimizer, files
    report = reshard.validate("ckpt/", deep=True)        # ValidationReport: report.ok, report.problems
    summary = reshard.plan("ckpt/", "dp=4,zero=3")       # PlanSummary: files, bytes, disk_ok
    written = reshard.convert("ckpt/", "new/", "dp=4")   # Written: the files on disk and the manifest
    written = reshard.export("ckpt/", "model.safetensors")
    report = reshard.diff("ckpt/", "new/")               # DiffReport: report.equal, report.differences
    catalog = reshard.open_checkpoint("ckpt/")           # metadata only, nothing executed
    weight = reshard.full_tensor(catalog, "l1.weight", "fp32")   # a torch tensor, bit-exact
    run = reshard.list_checkpoints("out/")               # every checkpoint of a run, complete or not
    plan = reshard.prune("out/", reshard.Policy(keep_last=3), yes=False)   # the plan; yes=True deletes
    result = reshard.thin("out/global_step2", yes=True)   # ThinResult: a full checkpoint replaced by its weights
    watcher = reshard.Watcher("out/", reshard.Policy(keep_last=3))   # watcher.poll(): one pass; .run(): until .stop()
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from reshard.version import __version__

# Every name below is loaded from the module that defines it when first asked for: `import reshard` (and so every
# submodule, the command line's included) costs nothing until a name is used, and the command line can set up its
# process (cli/__init__.py: OpenBLAS's threads) before numpy is imported.
_FROM = {
    "reshard.api": ("convert", "diff", "export", "inspect", "open_checkpoint", "plan", "prove_complete", "validate"),
    "reshard.commands.inspect": ("Inspection",),
    "reshard.commands.validate": ("Complete", "ValidationReport"),
    "reshard.commands.plan": ("PlanSummary",),
    "reshard.commands.diff": ("DiffReport",),
    "reshard.execution.executor": ("Written",),
    "reshard.core.catalog": ("Catalog",),
    "reshard.core.problems": ("Problem",),
    "reshard.errors": ("CheckpointError", "ReshardError", "UnknownFormatError", "UsageError"),
    "reshard.lifecycle.listing": ("RECENT_SECONDS", "list_checkpoints"),
    "reshard.lifecycle.pruning": ("prune",),
    "reshard.lifecycle.retention": ("Policy",),
    "reshard.lifecycle.thinning": ("ThinResult", "thin"),
    "reshard.lifecycle.watching": ("Watcher",),
    "reshard.reading.source_bytes": ("full_tensor",),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

if TYPE_CHECKING:     # what a type checker and an editor see: the same names, imported eagerly
    from reshard.api import convert, diff, export, inspect, open_checkpoint, plan, prove_complete, validate
    from reshard.commands.diff import DiffReport
    from reshard.commands.inspect import Inspection
    from reshard.commands.plan import PlanSummary
    from reshard.commands.validate import Complete, ValidationReport
    from reshard.core.catalog import Catalog
    from reshard.core.problems import Problem
    from reshard.errors import CheckpointError, ReshardError, UnknownFormatError, UsageError
    from reshard.execution.executor import Written
    from reshard.lifecycle.listing import RECENT_SECONDS, list_checkpoints
    from reshard.lifecycle.pruning import prune
    from reshard.lifecycle.retention import Policy
    from reshard.lifecycle.thinning import ThinResult, thin
    from reshard.lifecycle.watching import Watcher
    from reshard.reading.source_bytes import full_tensor


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value         # asked once
    return value


def __dir__():
    return sorted([*globals(), *_MODULE_OF])


__all__ = ["open_checkpoint", "inspect", "validate", "prove_complete", "plan", "convert", "export", "diff",
           "full_tensor", "list_checkpoints", "prune", "thin", "ThinResult", "Policy", "Watcher", "RECENT_SECONDS",
           "Catalog", "Inspection", "ValidationReport", "Problem", "Complete", "PlanSummary", "Written", "DiffReport",
           "ReshardError", "CheckpointError", "UnknownFormatError", "UsageError", "__version__"]
