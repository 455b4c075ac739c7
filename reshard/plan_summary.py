"""What a conversion would do, for people and machines: the files it writes, the bytes it reads and writes, the
memory its copy buffers take, whether the disk has room, and what becomes of the training framework's own files."""
from __future__ import annotations

import os
from dataclasses import dataclass

from reshard.convert import batch_size_advice, framework_files
from reshard.core.catalog import Catalog
from reshard.core.planner import Plan
from reshard.core.write_requests import StageCut
from reshard.executor import DEFAULT_MEMORY_BUDGET, buffer_bytes
from reshard.formats import FRESH, REPRODUCIBILITY
from reshard.formats.framework import framework_of
from reshard.storage import files as fs
from reshard.storage.routing import output_for, stream_buffer_bytes


@dataclass(frozen=True)
class PlannedFile:
    """One file the conversion writes: a tensor file (with its tensors and copy operations), a small text file, or
    a file copied whole from the source (`copied_from`)."""
    path: str
    bytes: int
    tensors: int | None = None
    copies: int | None = None
    copied_from: str | None = None

    def to_dict(self) -> dict:
        data: dict = {"path": self.path, "bytes": self.bytes}
        if self.tensors is not None:
            data.update(tensors=self.tensors, copies=self.copies)
        if self.copied_from is not None:
            data["copied_from"] = self.copied_from
        return data


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
class PlanSummary:
    """A conversion's plan as `reshard plan` shows it; `plan` is the Plan itself, which `execute` runs."""
    plan: Plan
    source: str
    source_topology: str
    target: str                 # the output in its format's words (Output.words)
    format: str
    target_topology: str | None
    tag: str | None
    files: tuple[PlannedFile, ...]
    bytes_read: int
    bytes_written: int
    stage_cut: StageCut | None  # a pipeline target's stage boundaries
    framework: FrameworkPlan | None
    memory_budget: int
    workers: int
    estimated_peak_buffer_bytes: int
    free_disk_bytes: int | None     # None: the output goes to object storage (no local disk, and none to check)
    free_disk_at: str           # the folder the free space was measured at: DST's, or the nearest that exists (or
                                # the object store's URL)
    advice: str | None          # what happens to the global batch size, and how to keep it

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
        return {**data, "estimated_peak_buffer_bytes": self.estimated_peak_buffer_bytes,
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
    if frame is not None and (frame.files or frame.kinds):    # (torchtitan keeps its state inside the checkpoint)
        framework = FrameworkPlan(frame.name, new_rank_state, frame.policy_line(new_rank_state), len(frame.files),
                                  tuple(framework_files(catalog, plan.target, fmt, new_rank_state)))
    where = fs.abspath(dst) if dst else os.getcwd()
    free = output_for(where).free_bytes(where)     # None: an object store, which states none
    while free is not None and not fs.exists(where):    # the folder it was measured at
        where = os.path.dirname(where)
    streams = stream_buffer_bytes(dst)
    return PlanSummary(
        plan=plan, source=plan.source, source_topology=summary["source_topology"],
        target=plan.output.words() if plan.output else summary["format"], format=summary["format"],
        target_topology=summary["target_topology"], tag=summary["tag"],
        files=tuple(PlannedFile(f["path"], f["bytes"], f.get("tensors"), f.get("copies"), f.get("copied_from"))
                    for f in summary["files"]),
        bytes_read=summary["bytes_read"], bytes_written=summary["bytes_written"], stage_cut=plan.stage_cut,
        framework=framework, memory_budget=memory_budget, workers=workers,
        estimated_peak_buffer_bytes=buffer_bytes(memory_budget, workers, streams),
        free_disk_bytes=free, free_disk_at=where,
        advice=batch_size_advice(catalog, plan.target, fmt))
