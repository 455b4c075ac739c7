"""Resume a live DeepSpeed engine from a checkpoint saved at any other topology, with no conversion step:

    reshard.deepspeed_engine.load_checkpoint(engine, "ckpt/")      # instead of engine.load_checkpoint("ckpt/")

Every rank reads the source's metadata and plans the files DeepSpeed itself would have written for this
engine (its dp, tp, pp, ZeRO stage and config). Then DeepSpeed's own `engine.load_checkpoint` runs on a
folder that names those files, with the engine's checkpoint engine (DeepSpeed's hook for how checkpoint
files are read) answering each file it asks for from memory: the object `torch.load` of the written file
would give, its tensors read from the source straight into their memory (a mixture of experts' layer files
too: DeepSpeed reads them through the engine's checkpoint engine, engine._load_checkpoint -> load_moe_state_dict).
Nothing is written beside the checkpoint, and no tensor byte is written anywhere. A checkpoint any rank cannot read
raises the same one-line ReshardError on every rank before DeepSpeed's first collective.
"""
from __future__ import annotations

import contextlib
import os

from reshard import formats
from reshard.commands.convert import plan_for
from reshard.commands.validate import prove_complete
from reshard.core.planner import Plan
from reshard.errors import ReshardError
from reshard.execution.distributed import TorchGroup
from reshard.execution.staging import output_path
from reshard.execution.target_bytes import SourceFiles
from reshard.formats.deepspeed.live import LIVE_FORMAT, engine_layout
from reshard.live.materialize import materialize
from reshard.reading import checksums
from reshard.reading.checksums import Tally
from reshard.storage import files as fs
from reshard.storage.routing import output_for

STAGING = "/dev/shm"        # where there is one; every rank of a node sees the same folder


def load_checkpoint(engine, src, tag: str | None = None, layout_rules: str | None = None,
                    staging: str | None = None, **kwargs):
    """`engine.load_checkpoint` of the checkpoint at `src` (any format reshard reads, any topology); `kwargs`
    go to DeepSpeed's load_checkpoint, whose result is returned. `staging`: where the folder DeepSpeed is
    pointed at is made for the time of the load (default /dev/shm; with ranks on several nodes, a folder all
    of them see). It holds empty files by the planned names, for DeepSpeed's globs and existence checks."""
    group = TorchGroup()            # the engine's process group: left as it is
    problem, plan = None, None
    try:
        complete = prove_complete(formats.read(os.fspath(src), tag, layout_rules))
        plan = plan_for(complete, engine_layout(engine), tag, fmt=LIVE_FORMAT)     # whatever the source's format
    except ReshardError as e:
        problem = e
    if not group.all_ok(problem is None):
        raise problem or ReshardError("another rank could not plan this load (its error says why)")
    assert plan is not None         # (planned on every rank, or raised above)
    where = group.broadcast(_staging_folder(staging) if group.rank == 0 else None)
    if isinstance(where, ReshardError):
        raise where
    out = os.path.join(where, "checkpoint")
    try:
        problem = _name_files(plan, out) if group.rank == 0 else None
        if not group.all_ok(problem is None):
            raise problem or ReshardError.at(where, "rank 0 could not name the planned files there")
        served = ServedFiles(engine.checkpoint_engine, out, plan)
        engine.checkpoint_engine = served
        try:
            loaded = engine.load_checkpoint(out, tag=plan.tag, **kwargs)
        finally:
            engine.checkpoint_engine = served.inner
            served.close()
        # The CRC-32 of every member any rank read from, whole, from the blocks all ranks read (rank 0 reads what
        # none did): a corrupt one fails the load on every rank, in the same line.
        read = group.gather_dicts({group.rank: served.read()})
        problem = None
        if group.rank == 0:
            problem = next(checksums.problems_of(read.values()), None)
        problem = group.broadcast(None if problem is None else (str(problem), problem.file))
        if problem is not None:
            raise ReshardError(*problem)
        return loaded
    finally:
        group.all_ok(True)          # every rank has loaded what it needs
        if group.rank == 0:
            with contextlib.suppress(OSError):      # (a scratch folder: what cannot be removed is left)
                output_for(where).delete(where)


class ServedFiles:
    """A DeepSpeed checkpoint engine serving the planned files from memory (materialized when DeepSpeed asks
    for one, so each rank reads only the files it loads), every other call going to the engine it wraps."""

    def __init__(self, inner, root: str, plan: Plan):
        self.inner = inner
        self._files = {os.path.join(root, f.path): f for f in plan.files}
        self._sources = SourceFiles(plan.reread(), Tally(plan.checked))

    def load(self, path, map_location=None):
        file = self._files.get(os.path.normpath(path))
        if file is None:
            return self.inner.load(path, map_location=map_location)
        return materialize(file, self._sources, _placer(map_location))

    def read(self) -> dict:
        """The CRC-32s of the blocks read from source members so far (checksums.Tally.pieces)."""
        return self._sources.tally.pieces()

    def close(self) -> None:
        self._sources.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _placer(map_location):
    """What torch.load's `map_location` does to each (CPU) storage, or None to leave it where it is."""
    import torch
    if callable(map_location):
        return lambda storage: map_location(storage, "cpu")
    if isinstance(map_location, dict):     # torch.load's {saved location: new one}; every storage here is "cpu"
        map_location = map_location.get("cpu", "cpu")
    device = torch.device(map_location) if isinstance(map_location, (str, torch.device)) else None
    if device is None or device.type == "cpu":
        return None
    return lambda storage: storage.to(device=device)


def _name_files(plan: Plan, out: str) -> ReshardError | None:
    """The planned tree, each tensor file empty and each small text whole; the error saying why not."""
    local = output_for(out)     # (a scratch folder on local disk: fs.scratch_parent)
    try:
        for f in plan.files:        # placed as the executor places them: inside `out`, or refused
            local.make_folder(os.path.dirname(output_path(out, f.path)))
            local.put(output_path(out, f.path), b"")
        for text in plan.texts:
            local.put(output_path(out, text.path), text.text.encode() if isinstance(text.text, str) else text.text)
    except OSError as e:
        return ReshardError.at(e.filename or out, f"cannot make the staging folder: {e.strerror or e}")
    except ReshardError as e:
        return e
    return None


def _staging_folder(given: str | None):
    """A new private folder for the files DeepSpeed reads, or the ReshardError saying why there is none."""
    parent = given or fs.scratch_parent(STAGING)
    try:
        return fs.make_scratch("reshard-load-", parent)
    except OSError as e:
        return ReshardError.at(parent, f"cannot make a staging folder: {e.strerror or e}")
