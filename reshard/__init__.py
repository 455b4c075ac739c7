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

from reshard.api import convert, diff, export, inspect, open_checkpoint, plan, prove_complete, validate
from reshard.commands.inspect import Inspection
from reshard.commands.validate import Complete, ValidationReport
from reshard.core.catalog import Catalog
from reshard.core.problems import Problem
from reshard.errors import CheckpointError, ReshardError, UnknownFormatError, UsageError
from reshard.lifecycle.listing import RECENT_SECONDS, list_checkpoints
from reshard.lifecycle.pruning import prune
from reshard.lifecycle.retention import Policy
from reshard.lifecycle.thinning import ThinResult, thin
from reshard.lifecycle.watching import Watcher
from reshard.reading.source_bytes import full_tensor
from reshard.version import __version__

# the results of writing and comparing, from the modules that do it, loaded when first asked for: `import reshard`
# (and every reader under it) stays light
_LATER = {"PlanSummary": "reshard.commands.plan", "Written": "reshard.execution.executor",
          "DiffReport": "reshard.commands.diff"}


def __getattr__(name: str):
    if name in _LATER:
        import importlib
        return getattr(importlib.import_module(_LATER[name]), name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")


__all__ = ["open_checkpoint", "inspect", "validate", "prove_complete", "plan", "convert", "export", "diff",
           "full_tensor", "list_checkpoints", "prune", "thin", "ThinResult", "Policy", "Watcher", "RECENT_SECONDS",
           "Catalog", "Inspection", "ValidationReport", "Problem", "Complete", "PlanSummary", "Written", "DiffReport",
           "ReshardError", "CheckpointError", "UnknownFormatError", "UsageError", "__version__"]
