"""What a conversion would do, for people and machines: the files it writes, the bytes it reads and writes, the
memory its copy buffers take, whether the disk has room, and what becomes of the training framework's own files."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from reshard.commands.convert import batch_size_advice, framework_files
from reshard.core.catalog import Catalog
from reshard.core.planner import Plan, PlanOutline
from reshard.execution.distributed import loads
from reshard.execution.executor import DEFAULT_MEMORY_BUDGET, buffer_bytes
from reshard.formats import FRESH, REPRODUCIBILITY, rank_state
from reshard.formats.framework import framework_of
from reshard.storage import files as fs
from reshard.storage.routing import output_for, stream_buffer_bytes


@dataclass(frozen=True)
class FrameworkPlan:
    """The training framework's folder around the source: what becomes of each of its files (Disposition)."""
    name: str
    new_rank_state: str
    policy: str                 # what a process the source did not have gets, in words
    own_files: int              # the framework's files around the source
    files: tuple                # Disposition, one per file written or left

    def to_dict(self) -> dict:
        return {"name": self.name, "new_rank_state": self.new_rank_state, "policy": self.policy,
                "reproducibility": REPRODUCIBILITY, "files": [d.to_dict() for d in self.files]}


@dataclass(frozen=True)
class PlanSummary(PlanOutline):
    """A conversion's plan as `reshard plan` shows it: the plan's own outline (Plan.summary()) and what the machine
    and the training framework add; `plan` is the Plan itself, which `execute` runs."""
    plan: Plan
    target: str                 # the output in its format's words (Output.words)
    framework: FrameworkPlan | None
    memory_budget: int
    workers: int
    worker_bytes: tuple[int, ...]   # the tensor bytes each worker copies (largest file first to the least loaded)
    estimated_peak_buffer_bytes: int
    free_disk_bytes: int | None     # None: the output goes to object storage (no local disk, and none to check)
    free_disk_at: str           # the folder the free space was measured at: DST's, or the nearest that exists (or
                                # the object store's URL)
    advice: str | None          # what happens to the global batch size, and how to keep it

    @property
    def worker_balance(self) -> float:
        """The most loaded worker's bytes over an even split's: 1.0 is perfect, 2.0 one worker waiting on the other
        for as long as it worked (the wall time of K workers is about this times the bytes / K's)."""
        total = sum(self.worker_bytes)
        return max(self.worker_bytes) * len(self.worker_bytes) / total if total else 1.0

    @property
    def disk_ok(self) -> bool:
        return self.free_disk_bytes is None or self.free_disk_bytes > self.bytes_written

    def to_dict(self) -> dict:
        """Plain data: what `reshard plan --json` prints."""
        data = {"source": self.source, "source_topology": self.source_topology, "format": self.format,
                "target_topology": self.target_topology, "tag": self.tag, "files": [f.to_dict() for f in self.files],
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "partition": self.stage_cut.to_dict() if self.stage_cut else None}
        if self.framework is not None:
            data["framework"] = self.framework.to_dict()
        return {**data, "workers": self.workers, "worker_bytes": list(self.worker_bytes),
                "estimated_peak_buffer_bytes": self.estimated_peak_buffer_bytes,
                "free_disk_bytes": self.free_disk_bytes, "free_disk_at": self.free_disk_at, "disk_ok": self.disk_ok,
                "advice": self.advice}


def summarize(catalog: Catalog, plan: Plan, *, fmt: str | None = None, new_rank_state: str = FRESH,
              dst: str | None = None, memory_budget: int | None = None, workers: int = 1) -> PlanSummary:
    """The summary of `plan` (made from `catalog` for --format `fmt`), its free-disk check at `dst` (default: the
    working directory), its buffers for `memory_budget` (default: the executor's) shared by `workers`."""
    memory_budget = memory_budget or DEFAULT_MEMORY_BUDGET
    summary = plan.summary()
    framework = None
    frame = framework_of(catalog)
    own = rank_state(catalog, fmt or catalog.format, plan.target, new_rank_state)
    if frame is not None and (frame.files or frame.kinds):    # (torchtitan keeps its state inside the checkpoint)
        framework = FrameworkPlan(frame.name, new_rank_state, frame.policy_line(new_rank_state), len(frame.files),
                                  tuple(framework_files(catalog, plan.target, fmt, new_rank_state)))
    elif own is not None:       # the per-process files the format keeps of its own (verl's extra state)
        policy, files = own
        framework = FrameworkPlan(catalog.format, new_rank_state, policy,
                                  len({d.source for d in files if d.source is not None}), files)
    where = fs.abspath(dst) if dst else os.getcwd()
    free = output_for(where).free_bytes(where)     # None: an object store, which states none
    while free is not None and not fs.exists(where):    # the folder it was measured at
        where = os.path.dirname(where)
    streams = stream_buffer_bytes(dst)
    return PlanSummary(
        **{f.name: getattr(summary, f.name) for f in fields(summary)}, plan=plan,
        target=plan.output.words() if plan.output else summary.format,
        framework=framework, memory_budget=memory_budget, workers=workers,
        worker_bytes=loads(list(plan.files), workers),
        estimated_peak_buffer_bytes=buffer_bytes(memory_budget, workers, streams),
        free_disk_bytes=free, free_disk_at=where,
        advice=batch_size_advice(catalog, plan.target, fmt))
