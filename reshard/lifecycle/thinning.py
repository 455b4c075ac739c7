"""`reshard thin`, `reshard.thin`: a full training checkpoint replaced in place by its own framework's weights-only
form, never losing data.

Only a checkpoint `reshard list` proves complete is thinned, and never the newest complete one of its series, one
something names (`latest`, Megatron-LM's tracker, `best_model_checkpoint`, `best_model_path`, a link), a save in
progress, nor one already thinned. Its format says what its weights-only form keeps (reshard.formats
.weights_only_form); the files written anew and a provenance record (weights_only.PROVENANCE) are written beside it
through the planner and executor into a hidden sibling `.X.reshard-thin`, the files it keeps unchanged (the weights)
hard-linked there (copied where the file system has no links: otherwise no byte of them is written), and the whole
is proven complete with every checksum read (validate deep) before anything is touched. Then the swap, under a
journal `.X.reshard-thin-journal`:

  1. write the journal (its intent), fsync the folder;
  2. exchange `.X.reshard-thin` and `X` (renameat2 RENAME_EXCHANGE: one atomic step; where the file system lacks
     it, X is renamed to `.X.reshard-thinned-from` and the thinned form to X), fsync;
  3. rename the full checkpoint to `.X.reshard-thinned-from`, fsync;
  4. remove it, fsync;
  5. remove the journal.

A SIGKILL anywhere leaves X whole, full or thinned, and `recover` (run first by the next thin, `prune --yes` and
`watch`) finishes the swap or rolls it back: before step 2 the thinned copy is removed, after it the full one.
RESHARD_FAULT_AT=<step> kills the process at a step (for the tests: STEPS). In object storage, which has no rename,
the thinned form is written the same way under the hidden sibling prefix (its kept objects copied server-side) and
put in place as reshard.lifecycle.thin_objects says.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace

from reshard.commands.validate import validate
from reshard.core.catalog import Catalog
from reshard.core.planner import plan as plan_files
from reshard.core.write_requests import CopiedFile, Output, TextFile
from reshard.errors import ReshardError
from reshard.formats import read as read_catalog, weights_only, weights_only_form
from reshard.formats.framework import framework_of
from reshard.lifecycle import thin_objects, units
from reshard.lifecycle.listing import COMPLETE, RECENT_SECONDS, list_checkpoints, order, problem_line
from reshard.lifecycle.run_layout import ThinNames, thin_journals, thin_names
from reshard.storage import files as fs
from reshard.storage.names import MANIFEST, THIN_JOURNAL_SUFFIX, THIN_SUFFIX
from reshard.storage.protocol import Renaming
from reshard.storage.routing import output_for, renaming

FAULT_AT = "RESHARD_FAULT_AT"
STEPS = ("written", "proven", "journal", "swapped", "trashed", "removed")


@dataclass(frozen=True)
class ThinResult:
    """What `reshard thin` did or would do to one checkpoint."""
    path: str
    format: str
    executed: bool
    bytes_before: int               # the checkpoint's files' bytes
    bytes_after: int                # its weights-only form's (with the provenance record)
    dropped: tuple[str, ...]        # files not kept, relative to the checkpoint
    what: str                       # what was dropped, in words
    load: str                       # the framework's weights-only load that takes the thinned form
    recovered: tuple[str, ...] = ()     # interrupted thins of the folder finished or rolled back first
    written: tuple[str, ...] = ()       # files of the form written anew from its tensors (some under a dropped name)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict:
        return {"path": self.path, "format": self.format, "executed": self.executed,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after, "bytes_saved": self.bytes_saved,
                "dropped": list(self.dropped), "what": self.what, "load": self.load,
                "recovered": list(self.recovered), "written": list(self.written)}


def thin(path: str | os.PathLike[str], yes: bool = False, keep_masters: bool = False,
         recent: float = RECENT_SECONDS) -> ThinResult:
    """Replace a full checkpoint by its framework's weights-only form, as `reshard thin` does.

    Args:
        path: one checkpoint of a run directory, as `reshard list` shows it (a DeepSpeed tag folder, an HF Trainer
            `checkpoint-N/`).
        yes: act (default: what would be dropped, and the bytes before and after).
        keep_masters: keep the exact fp32 masters instead of the 16-bit weights where the run has them.
        recent: a file of the run modified less than this many seconds ago marks its save in progress.

    Returns:
        A ThinResult: bytes before and after, what is dropped, the load that takes the result; `to_dict()` is what
        `reshard thin --json` prints. A checkpoint that is not to be thinned raises a ReshardError (one line).

    Example:
        >>> result = reshard.thin("run/global_step2")
        >>> result.executed, result.bytes_after < result.bytes_before
        (False, True)
    """
    path = fs.realpath(os.fspath(path))
    recovered = tuple(recover(os.path.dirname(path))) if yes else ()
    catalog, form, before = _eligible(path, keep_masters, recent)
    text = _provenance(catalog, form, path, before, keep_masters)
    after = _form_bytes(catalog, form, path) + len(text.encode())
    written = tuple(f.path for f in form.written)
    result = ThinResult(path, catalog.format, False, before, after, form.dropped, form.what, form.load, recovered,
                        written)
    if not yes:
        return result
    names = thin_names(path)
    disk = renaming(path)       # None: object storage, no rename (reshard.lifecycle.thin_objects)
    if disk is None:
        _write_objects(catalog, form, path, names, text)
    else:
        _check_free(path, after)
        _write(catalog, form, path, names, text, disk)
    _fault("written")
    _prove(names.staged, path)
    _fault("proven")
    if disk is None:
        placed = [f.path for f in form.written] + [weights_only.PROVENANCE]
        thin_objects.swap(names, thin_objects.Swap(form.dropped, tuple(placed)))
    else:
        _swap(names, disk)
    return ThinResult(path, catalog.format, True, before, _size(path), form.dropped, form.what, form.load, recovered,
                      written)


def thinned_bytes(catalog_or_path: Catalog | str | os.PathLike[str], keep_masters: bool = False) -> int:
    """The bytes a checkpoint's files will add up to once thinned (its weights-only form and the provenance
    record), for a dry run; raises a ReshardError where its format has no weights-only form reshard writes."""
    if isinstance(catalog_or_path, Catalog):
        catalog = catalog_or_path
        frame = framework_of(catalog)
        path = frame.folder if frame is not None else catalog.root
    else:
        path = fs.realpath(os.fspath(catalog_or_path))
        catalog = read_catalog(path)
    form = weights_only_form(catalog, path, keep_masters)
    text = _provenance(catalog, form, path, _size(path), keep_masters)
    return _form_bytes(catalog, form, path) + len(text.encode())


def refusal(path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint at `path` has no weights-only form reshard writes, its catalog read (one line, as `thin`
    would say it, less the path); None where it has one. What `thin` refuses from the run (the newest, a named one,
    an incomplete one) is the listing's to say."""
    path = fs.realpath(os.fspath(path))
    try:
        weights_only_form(read_catalog(path), path)
    except ReshardError as e:
        said = str(e)
        return said[len(f"{e.file}: "):] if e.file is not None and said.startswith(f"{e.file}: ") else said
    return None


def recover(run_dir: str | os.PathLike[str]) -> list[str]:
    """Finish or roll back every `reshard thin` a kill interrupted under `run_dir`; the checkpoints' paths.
    Before its swap a thinned copy is removed (the full checkpoint stays); after it, the full one."""
    root = fs.realpath(os.fspath(run_dir))
    disk = renaming(root)
    if disk is None:
        return thin_objects.recover(root)
    if not fs.isdir(root):
        return []
    done = []
    for journal in thin_journals(root):
        folder, name = os.path.split(journal)
        names = thin_names(os.path.join(folder, name[1:-len(THIN_JOURNAL_SUFFIX)]))
        _settle(names, disk)
        done.append(names.path)
    for folder, dirs, _ in fs.walk(root):     # a thinned copy written or proven, killed before its journal
        for d in [d for d in dirs if d.startswith(".") and d.endswith(THIN_SUFFIX)]:
            names = thin_names(os.path.join(folder, d[1:-len(THIN_SUFFIX)]))
            if not fs.exists(names.journal):
                _remove(names.staged)
                done.append(names.path)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
    return sorted(set(done))


def _eligible(path: str, keep_masters: bool, recent: float):
    """(catalog, form, bytes) of a checkpoint that may be thinned; else a ReshardError saying why not."""
    if not fs.isdir(path):
        raise ReshardError.at(path, "no such checkpoint folder" if not fs.exists(path) else
                                    "a checkpoint file: thinning one is not built (checkpoint folders only)")
    done = weights_only.provenance(path)
    if done is not None or weights_only.is_thinned(path):
        raise ReshardError.at(path, f"already weights-only (thinned on {(done or {}).get('thinned_on', '?')})")
    run = list_checkpoints(os.path.dirname(path), recent=recent)
    row = next((r for r in run.checkpoints if fs.normpath(r.path) == fs.normpath(path)), None)
    if row is None:
        raise ReshardError.at(path, f"not a checkpoint `reshard list {os.path.dirname(path)}` shows")
    if row.status != COMPLETE:
        raise ReshardError.at(path, f"{row.status} ({row.why}): only a complete checkpoint is thinned")
    if row.pinned:
        raise ReshardError.at(path, f"{'; '.join(row.pinned)}: kept full")
    series = sorted((r for r in run.checkpoints if r.complete and r.series == row.series), key=order)
    if series[-1].path == row.path:
        raise ReshardError.at(path, "the newest complete checkpoint of its series: kept full")
    catalog = read_catalog(path)
    report = validate(catalog)
    if not report.ok:
        raise ReshardError.at(path, f"incomplete: {problem_line(report)}")
    return catalog, weights_only_form(catalog, path, keep_masters), row.bytes


def _provenance(catalog: Catalog, form, path: str, before: int, keep_masters: bool) -> str:
    """The record's text, its own size included in the bytes after."""
    kept = _form_bytes(catalog, form, path)
    on = time.strftime("%Y-%m-%d", time.gmtime())
    text = ""
    for _ in range(3):      # the number's digits are part of the size it states
        text = weights_only.provenance_record(on, form.what, form.dropped, before, kept + len(text.encode()),
                                              catalog.format, keep_masters,
                                              weights_only.Trained.of(catalog))
    return text


def _targets(catalog: Catalog, form, path: str, text: str | None = None, kept: bool = True):
    """The plan writing the form (its kept files copied unless `kept` is False, its written ones from the
    checkpoint's tensors, and the record where `text` is given), its output beside the checkpoint, in its folder."""
    targets: list = [CopiedFile(n, os.path.join(path, n), fs.getsize(os.path.join(path, n)))
                     for n in _kept(form)] if kept else []
    targets += list(form.written)
    if text is not None:
        targets.append(TextFile(weights_only.PROVENANCE, text))
    made = plan_files(catalog, catalog.layout, targets, catalog.tag, Output(catalog.format))
    return replace(made, source=path, save_dir=path)


def _kept(form) -> list[str]:
    return [n for n in form.kept if n != MANIFEST]


def _form_bytes(catalog: Catalog, form, path: str) -> int:
    """The form's bytes, the record aside."""
    return _targets(catalog, form, path).bytes_written


def _size(path: str) -> int:
    return sum(size for _, size, _ in fs.tree(path).files_under(path))


def _check_free(path: str, needed: int) -> None:
    free = output_for(path).free_bytes(os.path.dirname(path))
    if free is not None and free < needed:
        raise ReshardError.at(path, f"{needed} bytes needed beside it for the thinned form, {free} free; "
                                    "nothing written")


def _write(catalog: Catalog, form, path: str, names: ThinNames, text: str, disk: Renaming) -> None:
    """The written files and the record through the planner and executor into the hidden sibling, the kept ones
    linked there (Renaming.link_or_copy)."""
    from reshard.execution.executor import execute
    _remove(names.staged)       # (what a killed run left before its journal: recover removes it too)
    # the checkpoint is what must stay apart from the output: its copy goes beside it, in its folder
    execute(_targets(catalog, form, path, text, kept=False), names.staged, progress=False)
    disk.delete_file(os.path.join(names.staged, MANIFEST))     # the form is the framework's files and the record
    folders = {names.staged}
    for n in _kept(form):
        # a hard link (the same bytes, none written; the swap then removes only the checkpoint's name of it), or a
        # durable copy where the file system has no links: either keeps the file's own times
        disk.link_or_copy(os.path.join(path, n), os.path.join(names.staged, n))
        folders.add(os.path.dirname(os.path.join(names.staged, n)))
    for folder in sorted(folders, reverse=True):
        disk.sync(folder)
    # the save's times, which `list` and time-based retention read, kept: a kept file's own, a file written anew
    # and the record the save's (its newest file's)
    newest = max((mtime for _, _, mtime in fs.tree(path).files_under(path)), default=0.0)
    for n in [f.path for f in form.written] + [weights_only.PROVENANCE]:
        disk.set_mtime(os.path.join(names.staged, n), newest)
    for folder, _, _ in sorted(fs.walk(names.staged), reverse=True):     # its folders' too, deepest first
        source = os.path.join(path, os.path.relpath(folder, names.staged))
        if fs.isdir(source):
            disk.copy_times(source, folder)
        else:
            disk.set_mtime(folder, newest)


def _write_objects(catalog: Catalog, form, path: str, names: ThinNames, text: str) -> None:
    """In object storage: the written files and the record through the planner and executor under the hidden
    sibling prefix (committed by its manifest, which is then deleted), the kept objects copied there server-side."""
    from reshard.execution.executor import execute
    out = output_for(path)
    out.delete(names.staged)        # (what a killed run left before its journal: recover removes it too)
    execute(_targets(catalog, form, path, text, kept=False), names.staged, progress=False)
    out.delete(os.path.join(names.staged, MANIFEST))
    for n in _kept(form):
        out.copy(os.path.join(path, n), os.path.join(names.staged, n))


def _prove(staged: str, path: str) -> None:
    """The thinned copy is whole, every checksum read, and the unit `list` will take for a complete checkpoint."""
    try:
        report = validate(read_catalog(staged), deep=True)
        unit = units.framework_unit(os.path.basename(path), units.Listing.of(staged), staged)
    except ReshardError as e:
        _remove(staged)
        raise ReshardError.at(path, f"its thinned form does not read back ({e}); nothing changed") from None
    if not report.ok or (unit is not None and unit.reading != units.READ):
        _remove(staged)
        why = problem_line(report) if not report.ok else unit.why if unit is not None else ""
        raise ReshardError.at(path, f"its thinned form is not proven whole ({why}); nothing changed")


def _swap(names: ThinNames, disk: Renaming) -> None:
    folder = os.path.dirname(names.path)
    line = f"reshard thin: {os.path.basename(names.staged)} replaces {os.path.basename(names.path)}\n"
    disk.put(names.journal, line.encode())      # (durable on return)
    disk.sync(folder)
    _fault("journal")
    if not disk.exchange(names.staged, names.path):
        disk.rename(names.path, names.trash)    # (a file system without RENAME_EXCHANGE: recover covers the gap)
        disk.sync(folder)
        disk.rename(names.staged, names.path)
        disk.sync(folder)
        _fault("swapped")
        _fault("trashed")
    else:
        disk.sync(folder)
        _fault("swapped")
        disk.rename(names.staged, names.trash)
        disk.sync(folder)
        _fault("trashed")
    _remove(names.trash)
    _fault("removed")
    disk.delete_file(names.journal)
    disk.sync(folder)


def _settle(names: ThinNames, disk: Renaming) -> None:
    """One journal's swap finished (the thinned form in place) or rolled back (the full one)."""
    folder = os.path.dirname(names.path)
    here, staged, trash = (fs.exists(p) for p in (names.path, names.staged, names.trash))
    if here and staged:     # before the exchange (the thinned copy, never swapped in) or after it (the full one)
        _remove(names.staged)
    elif not here and staged:   # between the two renames of the fallback: finish
        disk.rename(names.staged, names.path)
        disk.sync(folder)
    elif not here and trash:     # nothing in place: the full one back
        disk.rename(names.trash, names.path)
        disk.sync(folder)
        trash = False
    if trash:
        _remove(names.trash)
    disk.delete_file(names.journal)
    disk.sync(folder)


def _remove(path: str) -> None:
    """The file or folder at `path` removed (links not followed), its folder's names made durable."""
    out = output_for(path)
    out.delete(path)
    out.sync(os.path.dirname(path))


def _fault(step: str) -> None:
    if os.environ.get(FAULT_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
