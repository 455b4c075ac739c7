"""The swap of `reshard thin` in object storage, which has no rename (reshard.lifecycle.thinning writes and proves the
thinned form first, in the hidden sibling prefix `.X.reshard-thin/`, its kept objects copied server-side).

Then, under a journal object `.X.reshard-thin-journal` naming what goes and what comes:

  1. put the journal (the dropped files, the files to place, the record last);
  2. delete X's dropped objects, one at a time: from the first one on, X is no longer a whole full checkpoint and
     reads as incomplete (its optimizer files, or its engine save, are missing; a DeepSpeed tag folder with its
     module files alone is incomplete for `list`), while the hidden thinned form is whole;
  3. copy the objects to place (the files written anew, the provenance record last: until it is there X is no
     thinned checkpoint either) from the thinned form to X, server-side;
  4. delete the thinned form's prefix;
  5. delete the journal.

At every point the full checkpoint (before 2) or the thinned one (the hidden prefix from 1 to 3, X from 3 on) is
whole, and X is complete only as the one or the other. `recover` finishes a journal's swap (every journaled swap goes
forward: its thinned form was proven before the journal was put) and removes a thinned form no journal names (a
kill before 1: X was never touched). RESHARD_FAULT_AT=<step> kills the process at a step (for the tests: STEPS).
"""
from __future__ import annotations

import json
import os
import posixpath
import signal
from dataclasses import dataclass

from reshard.errors import ReshardError
from reshard.lifecycle.run_layout import ThinNames, thin_names
from reshard.storage import files as fs
from reshard.storage.names import THIN_JOURNAL_SUFFIX, THIN_SUFFIX
from reshard.storage.protocol import OutputStorage
from reshard.storage.routing import output_for

FAULT_AT = "RESHARD_FAULT_AT"
STEPS = ("written", "proven", "journal", "emptying", "emptied", "placed", "removed")
KIND = "reshard.thin-journal"


@dataclass(frozen=True)
class Swap:
    """What one swap removes from the checkpoint and places there, files relative to it."""
    dropped: tuple[str, ...]
    placed: tuple[str, ...]        # the provenance record last

    def to_json(self) -> str:
        return json.dumps({"kind": KIND, "dropped": list(self.dropped), "placed": list(self.placed)}) + "\n"

    @classmethod
    def from_json(cls, where: str, text: bytes) -> Swap:
        try:
            data = json.loads(text)
            if data.get("kind") != KIND:
                raise ValueError(data.get("kind"))
            return cls(tuple(data["dropped"]), tuple(data["placed"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReshardError.at(where, "not a journal of reshard thin; left as it is") from None


def swap(names: ThinNames, plan: Swap) -> None:
    """The thinned form at names.staged (whole, proven) put in the checkpoint's place, steps 1-5."""
    out = output_for(names.path)
    out.put(names.journal, plan.to_json().encode())
    _fault("journal")
    _finish(out, names, plan)


def recover(root: str) -> list[str]:
    """Every swap a kill interrupted under the run prefix `root` finished, every thinned form no journal names
    removed; the checkpoints' URLs."""
    out = output_for(root)
    done = []
    keys = [u for u, _, _ in fs.tree(root).files_under(root)] if fs.isdir(root) else []
    journals = sorted(u for u in keys if posixpath.basename(u).startswith(".")
                      and u.endswith(THIN_JOURNAL_SUFFIX))
    for journal in journals:
        folder, name = posixpath.split(journal)
        names = thin_names(posixpath.join(folder, name[1:-len(THIN_JOURNAL_SUFFIX)]))
        _finish(out, names, Swap.from_json(journal, out.get(journal)))
        done.append(names.path)
    staged = {u.split(THIN_SUFFIX + "/")[0] + THIN_SUFFIX for u in keys if THIN_SUFFIX + "/" in u}
    for prefix in sorted(staged):     # written or proven, killed before its journal: X was never touched
        folder, name = posixpath.split(prefix)
        names = thin_names(posixpath.join(folder, name[1:-len(THIN_SUFFIX)]))
        if not fs.exists(names.journal):
            out.delete(names.staged)
            done.append(names.path)
    return sorted(set(done))


def _finish(out: OutputStorage, names: ThinNames, plan: Swap) -> None:
    """Steps 2-5, each skipped where it was done: what is still in X of the dropped files deleted, the files to
    place copied from the thinned form while it holds them (a kill in step 4 left them in X already)."""
    for i, name in enumerate(plan.dropped):
        target = posixpath.join(names.path, name)
        if fs.isfile(target):
            out.delete_file(target)     # (delete() would take every object under the prefix `target` too)
        if i == 0:
            _fault("emptying")
    _fault("emptied")
    for name in plan.placed:
        source, target = posixpath.join(names.staged, name), posixpath.join(names.path, name)
        if fs.isfile(source):
            out.copy(source, target)
        elif not fs.isfile(target):
            raise ReshardError.at(names.path, f"{name}: in neither the thinned form nor the checkpoint; the journal "
                                              f"{os.path.basename(names.journal)} is left for a person to look at")
    _fault("placed")
    if fs.isdir(names.staged):
        out.delete(names.staged)
    _fault("removed")
    out.delete(names.journal)


def _fault(step: str) -> None:
    if os.environ.get(FAULT_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
