"""The checkpoints of a training run: `reshard list`, `reshard.list_checkpoints`.

A run directory is scanned by names (reshard.lifecycle.run_layout), each checkpoint's metadata read by the
format registry and proven whole by reshard.validate's coverage proof (metadata only: no tensor byte is read),
and its metrics gathered from what the framework recorded (reshard.lifecycle.run_metrics) or a user's file.
A save still being written — a staging name, a DCP folder without `.metadata`, a file modified within the last
`recent` seconds or growing during `settle` — is "in progress", and is never opened. A checkpoint recognised whole
that no reader of the format registry reads, or of whose files the reader leaves one unread (Accelerate's plain
save_state: its optimizer.bin), or a pickle asking for a class off the allow-list, is "unverifiable", and one no
framework's layout accounts for "unknown": neither is ever complete, nor deleted.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from reshard.commands.validate import validate
from reshard.errors import ReshardError, UnprovenMappingError, UnreadLayoutError, UnsafeCheckpointError
from reshard.formats import read as read_catalog, weights_only
from reshard.lifecycle import run_layout, run_metrics, units
from reshard.lifecycle.sizes import BytesByKind, RunBytes, added_up, cost_per_month, split
from reshard.storage import files as fs

COMPLETE, INCOMPLETE, IN_PROGRESS = "complete", "incomplete", "in progress"
UNVERIFIABLE, UNKNOWN = "unverifiable", "unknown"      # never complete, never deleted: kept with `why`
KEPT_UNREAD = {units.OPAQUE: UNVERIFIABLE, units.UNKNOWN: UNKNOWN}
RECENT_SECONDS = 10.0       # a file modified this recently may still be written
CHECK = "coverage"          # what `list` proves: every element of every tensor present once (metadata only)


@dataclass(frozen=True)
class Checkpoint:
    """One row of `reshard list`."""
    path: str
    name: str                   # relative to the run directory
    step: int | None
    mtime: float                # newest modification time of its files
    bytes: int                  # the files' bytes (apparent size): the size `list`, `prune` and `watch` show
    disk_bytes: int             # allocated on disk (varies with the file system; for noticing a change only)
    files: int
    format: str | None
    topology: str | None
    status: str                 # COMPLETE, INCOMPLETE, IN_PROGRESS, UNVERIFIABLE, UNKNOWN
    why: str = ""               # for all but COMPLETE
    pinned: tuple = ()          # why something names it (`latest`, best_model_checkpoint, a link)
    metrics: dict = field(default_factory=dict)
    unit: str | None = None     # what it is whole: framework and backend ("HF Trainer with DeepSpeed")
    bytes_by_kind: BytesByKind | None = None    # complete ones: `bytes` as weights, optimizer, other (lifecycle.sizes)
    member: bool = True         # of its folder's series (False: named unlike the save loop beside it, ranked alone)
    weights_only: bool = False  # complete and thinned by `reshard thin` (its provenance is there): the weights tier

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE

    @property
    def series(self) -> str:
        """The folder holding it (relative to the run): the checkpoints of one save loop, ranked together. One
        named unlike the loop's checkpoints beside it (a `checkpoint-1-weights/` export) is a series of its own."""
        return os.path.dirname(self.name) if self.member else self.name

    def to_dict(self, price: float | None = None) -> dict:
        kinds = self.bytes_by_kind.to_dict() if self.bytes_by_kind is not None else None
        out = {"name": self.name, "path": self.path, "series": self.series, "step": self.step, "mtime": self.mtime,
               "bytes": self.bytes, "disk_bytes": self.disk_bytes, "files": self.files, "format": self.format,
               "topology": self.topology, "unit": self.unit, "status": self.status, "why": self.why or None,
               "pinned": list(self.pinned), "metrics": self.metrics,
               "bytes_by_kind": kinds, "weights_only": self.weights_only}
        if price is not None:       # kinds unknown: the total only
            out["cost_per_month"] = cost_per_month(kinds or {"total": self.bytes}, price)
        return out


@dataclass(frozen=True)
class RunListing:
    root: str
    checkpoints: list           # [Checkpoint], oldest first
    trash: list                 # what an interrupted prune left (removed by the next `prune --yes`)
    notes: list                 # links leaving the run directory, not followed
    check: str = CHECK
    pointers: dict = field(default_factory=dict)    # {checkpoint path: why something names it} (`latest`)

    def total_bytes_by_kind(self) -> RunBytes:
        """Every row's bytes added up (lifecycle.sizes.RunBytes: those whose kinds are not known under `unknown`)."""
        return added_up((c.bytes, c.bytes_by_kind) for c in self.checkpoints)

    def to_dict(self, price: float | None = None) -> dict:
        total = self.total_bytes_by_kind().to_dict()
        rows = [c.to_dict(price) for c in self.checkpoints]
        out: dict = {"root": self.root, "check": self.check, "checkpoints": rows, "trash": self.trash,
                     "notes": self.notes, "total_bytes_by_kind": total}
        if price is not None:
            out["price_usd_per_gb_month"] = price
            out["cost_per_month"] = cost_per_month(total, price)
        return out


@dataclass(frozen=True)
class Files:
    """What a checkpoint's files add up to; equal twice means nothing changed between."""
    count: int
    bytes: int
    disk_bytes: int
    mtime: float
    outside: str | None         # a link inside it that leaves the run directory


def list_checkpoints(run_dir, metrics: str | None = None, metric_name: str | None = None,
                     recent: float = RECENT_SECONDS, settle: float = 0.0) -> RunListing:
    """Every checkpoint of a run directory, as `reshard list` shows them; metadata only.

    Args:
        run_dir: a DeepSpeed save dir, Hugging Face output dir, Lightning checkpoint dir, DCP step dirs, or a
            folder holding several.
        metrics: a user's metrics file (JSON or CSV, step -> value); `metric_name` names a bare {step: value}
            file's values.
        recent: a file modified less than this many seconds ago marks its save in progress.
        settle: also look again after this many seconds; a checkpoint whose files changed is in progress.

    Returns:
        A RunListing: `checkpoints` (Checkpoint rows, oldest first: name, step, status, format, topology, size,
        why when incomplete), `notes`; `to_dict()` is what `reshard list --json` prints.

    Example:
        >>> run = reshard.list_checkpoints("ckpt/")
        >>> [(row.name, row.step, row.status) for row in run.checkpoints]
        [('global_step2', 2, 'complete'), ('global_step3', 3, 'complete')]
    """
    root = fs.realpath(str(run_dir))
    with fs.settled():      # (the run's folders, asked of an object store once each)
        found = run_layout.scan(root)
    user = run_metrics.read_metrics_file(metrics, metric_name) if metrics else {}
    sizes = {e.path: measure(e.path, root) for e in found.entries}
    if settle > 0:
        time.sleep(settle)
    now = time.time()
    rows, records, unfinished = [], {}, set()
    for entry in found.entries:
        files = sizes[entry.path]
        if settle > 0 and measure(entry.path, root) != files:
            rows.append(_row(entry, files, IN_PROGRESS, f"its files changed within {settle:g} s"))
            continue
        if now - files.mtime < recent:     # before the names: a staging folder being written is never abandoned
            written = f"a file was written {max(0.0, now - files.mtime):.0f} s ago"
            why = f"{entry.unfinished}; {written}" if entry.unfinished else written
            rows.append(_row(entry, files, IN_PROGRESS, why))
            continue
        if entry.unfinished:
            rows.append(_row(entry, files, IN_PROGRESS, entry.unfinished))
            unfinished.add(entry.path)
            continue
        if entry.unit is not None and entry.unit.reading != units.READ:
            rows.append(_row(entry, files, KEPT_UNREAD[entry.unit.reading], entry.unit.why))
            continue
        if files.outside:
            rows.append(_row(entry, files, INCOMPLETE, f"{files.outside} leaves the run directory (not followed)"))
            continue
        row, records[entry.path] = _checked(entry, files)
        rows.append(row)
    rows = _abandoned(rows, unfinished)
    rows = _with_metrics(rows, records, user)
    rows = _with_pins(rows, records, found, root)
    rows.sort(key=order)
    notes = [f"{link.path}: a link to {link.target}, outside the run directory: not followed"
             for link in found.links if not link.inside]
    return RunListing(root, rows, found.trash, notes, pointers=dict(found.pointers))


def order(row: Checkpoint) -> tuple:
    """Series by series, oldest first: by step where the name or the checkpoint gives one, then by time."""
    return (row.series, row.step if row.step is not None else -1, row.mtime, row.name)


def _row(entry, files: Files, status: str, why: str = "", catalog=None, step=None) -> Checkpoint:
    fmt = catalog.format if catalog is not None else entry.reader or (entry.unit and entry.unit.format)
    return Checkpoint(entry.path, entry.name, entry.step if entry.step is not None else step, files.mtime, files.bytes,
                      files.disk_bytes, files.count, fmt,
                      catalog.layout.topology(brief=True) if catalog is not None else None,
                      status, why, unit=entry.unit.what if entry.unit is not None else None, member=entry.member)


def _checked(entry, files: Files) -> tuple:
    """(its row, what it records): opened by the registry and proven whole, or why not."""
    try:
        catalog = read_catalog(entry.path)
    # not proof that anything is missing: only that reshard cannot read it, or cannot tell its tensors apart
    except (UnsafeCheckpointError, UnprovenMappingError, UnreadLayoutError) as e:
        return _row(entry, files, UNVERIFIABLE, f"{e}; never deleted"), run_metrics.Recorded()
    except ReshardError as e:
        return _row(entry, files, INCOMPLETE, str(e)), run_metrics.Recorded()
    step = catalog.contents().step if catalog.training.global_steps is None else catalog.training.global_steps
    unread = units.unread(catalog, entry.path) if entry.unit is not None and entry.unit.claimed else ()
    if unread:      # a proof on the files read says nothing of these: not proven whole, so never deleted
        return _row(entry, files, UNVERIFIABLE, _unread_line(unread, entry.path, catalog.format), catalog, step), \
            run_metrics.Recorded()
    report = validate(catalog)
    try:
        recorded = run_metrics.recorded(entry.path, entry.step if entry.step is not None else step, catalog)
    except ReshardError as e:
        return _row(entry, files, INCOMPLETE, str(e), catalog, step), run_metrics.Recorded()
    if report.ok:     # read whole: its bytes by kind (an incomplete one's are not known)
        kinds = split(catalog, files.bytes, entry.path)
        row = _row(entry, files, COMPLETE, "", catalog, step)
        return replace(row, bytes_by_kind=kinds, weights_only=thinned(entry.path)), recorded
    return _row(entry, files, INCOMPLETE, problem_line(report), catalog, step), recorded


def thinned(path: str) -> bool:
    """Is the checkpoint at `path` a weights-only one `reshard thin` left (its provenance file inside)? A file
    checkpoint has no inside: never."""
    return fs.isdir(path) and weights_only.is_thinned(path)


def _unread_line(unread: tuple, path: str, fmt: str) -> str:
    first = os.path.relpath(unread[0], path) if unread[0] != path else os.path.basename(path)
    more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
    return f"{first}{more}: not read by reshard's {fmt} reader, so the checkpoint is not proven whole; never deleted"


def problem_line(report) -> str:
    """Why a validate Report is not whole, in one line: its first problem, how many more, the elements missing."""
    more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
    missing = f"; {100 * report.missing_fraction:.1f}% of elements missing" if report.missing_elements else ""
    return f"{report.problems[0]}{more}{missing}"


def _abandoned(rows: list, unfinished: set) -> list:
    """A staging folder (path in `unfinished`: nothing written to it lately) older than a finished save of a later
    step will never finish: incomplete, not in progress (so `prune --delete-incomplete` may remove it)."""
    newest_of: dict[str, int] = {}
    for r in rows:
        if r.complete and r.step is not None:
            newest_of[r.series] = max(r.step, newest_of.get(r.series, r.step))
    out = []
    for r in rows:
        newest = newest_of.get(r.series)
        if r.path in unfinished and r.step is not None and newest is not None and r.step < newest:
            r = replace(r, status=INCOMPLETE, why=f"{r.why}; abandoned: step {newest} was saved after it")
        out.append(r)
    return out


def _with_metrics(rows: list, records: dict, user: dict) -> list:
    # folder -> step -> values: a log speaks for the checkpoints saved beside it
    history: dict[str, dict[int, dict[str, float]]] = {}
    for path, recorded in records.items():
        for step, values in recorded.history.items():
            history.setdefault(os.path.dirname(path), {}).setdefault(step, {}).update(values)
    out = []
    for r in rows:
        values = dict(history.get(os.path.dirname(r.path), {}).get(r.step, {})) if r.step is not None else {}
        if r.path in records:
            values.update(records[r.path].metrics)
        if r.step is not None:
            values.update(user.get(r.step, {}))
        out.append(replace(r, metrics=values))
    return out


def _with_pins(rows: list, records: dict, found, root: str) -> list:
    pins = {path: [why] for path, why in found.pointers.items()}
    for link in found.links:
        if link.inside:
            pins.setdefault(link.target, []).append(f"linked by {os.path.relpath(link.path, root)}")
    newest_in = {}      # folder -> its newest checkpoint's row that names a best one
    for r in sorted(rows, key=order):
        if r.path in records and records[r.path].best:
            newest_in[os.path.dirname(r.path)] = r
    for folder, r in newest_in.items():
        recorded = records[r.path]
        best = os.path.join(folder, os.path.basename(recorded.best.rstrip("/")))
        pins.setdefault(best, []).append(f"named by {r.name}'s {recorded.best_by}")
    return [replace(r, pinned=tuple(pins.get(r.path, ()))) for r in rows]


def fingerprint(row: Checkpoint) -> tuple:
    """What a row's files added up to when it was listed: equal to a later look's means nothing changed."""
    return (row.files, row.bytes, row.disk_bytes, row.mtime)


def unchanged(row: Checkpoint, root: str) -> bool:
    """Are the row's files still as they were listed (no save reusing its name, no writer still at work)?"""
    now = measure(row.path, root)
    return (now.count, now.bytes, now.disk_bytes, now.mtime) == fingerprint(row)


def measure(path: str, root: str) -> Files:
    """Sizes and newest time of a checkpoint's files, links not followed (one leaving the run is named). In an
    object store: its objects, as one listing gives them (no links; what they take is what they hold)."""
    count = size = disk = 0
    newest, outside = 0.0, None
    for found in fs.found_under(path):
        if found.link is not None:
            if not (found.link == root or found.link.startswith(root + os.sep)):
                outside = outside or found.path
            continue
        newest = max(newest, found.mtime)
        if not found.folder:
            count, size, disk = count + 1, size + found.size, disk + found.disk_bytes
    return Files(count, size, disk, newest, outside)
