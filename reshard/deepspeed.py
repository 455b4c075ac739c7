"""Resume a live DeepSpeed engine from a checkpoint saved at any other topology, with no conversion step:

    reshard.deepspeed.load_checkpoint(engine, "ckpt/")      # instead of engine.load_checkpoint("ckpt/")

Every rank reads the source's metadata, plans the files DeepSpeed itself would have written for this engine
(its dp, tp, pp, ZeRO stage and config), writes its share of them into a private staging folder in RAM
(/dev/shm) with the other ranks, and then DeepSpeed's own `engine.load_checkpoint` reads them; the folder
is removed afterwards. Nothing is written beside the checkpoint. A checkpoint any rank cannot read raises
the same one-line ReshardError on every rank before DeepSpeed's first collective.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from reshard import formats
from reshard.convert import plan_for
from reshard.distributed import TorchGroup
from reshard.errors import ReshardError
from reshard.executor import execute
from reshard.formats.deepspeed.live import engine_layout
from reshard.validate import require_complete

STAGING = "/dev/shm"        # RAM-backed where there is one; every rank of a node sees the same folder


def load_checkpoint(engine, src, tag: str | None = None, layout_rules: str | None = None,
                    staging: str | None = None, **kwargs):
    """`engine.load_checkpoint` of the checkpoint at `src` (any format reshard reads, any topology); `kwargs`
    go to DeepSpeed's load_checkpoint, whose result is returned. `staging`: where the files DeepSpeed reads
    are put for the time of the load (default /dev/shm; with ranks on several nodes, a folder all of them
    see)."""
    group = TorchGroup()            # the engine's process group: left as it is
    problem, plan = None, None
    try:
        catalog = formats.read(os.fspath(src), tag, layout_rules)
        require_complete(catalog)
        plan = plan_for(catalog, engine_layout(engine), tag)
    except ReshardError as e:
        problem = e
    if not group.all_ok(problem is None):
        raise problem or ReshardError("another rank could not plan this load (its error says why)")
    where = group.broadcast(_staging_folder(staging) if group.rank == 0 else None)
    if isinstance(where, ReshardError):
        raise where
    out = os.path.join(where, "checkpoint")
    try:
        execute(plan, out, progress=False, group=group)
        group.all_ok(True)          # rank 0 has committed the files
        return engine.load_checkpoint(out, tag=plan.tag, **kwargs)
    finally:
        group.all_ok(True)          # every rank has read what it needs
        if group.rank == 0:
            shutil.rmtree(where, ignore_errors=True)


def _staging_folder(given: str | None):
    """A new private folder for the files DeepSpeed reads, or the ReshardError saying why there is none."""
    parent = given or (STAGING if os.path.isdir(STAGING) and os.access(STAGING, os.W_OK) else tempfile.gettempdir())
    try:
        return tempfile.mkdtemp(prefix="reshard-load-", dir=parent)
    except OSError as e:
        return ReshardError.at(parent, f"cannot make a staging folder: {e.strerror or e}")
