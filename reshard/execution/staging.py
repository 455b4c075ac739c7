"""Where output is built before it is committed: a hidden sibling of the destination, or the destination itself.

`.DST.reshard-tmp` holds the files being written; `.DST.reshard-lock` keeps a second writer out; a journal lists
each finished file with its digest (reshard.digests), so a run killed half way can be resumed keeping what is whole.
Committing writes the manifest and has the storage move the sibling into place (reshard.storage.protocol.OutputStorage
.commit), so the destination appears complete or not at all.

A store with no rename (object storage: OutputStorage.IN_PLACE) would have to copy every object to commit, so a
new destination is written where it goes instead: its first object is the unfinished marker
(reshard.storage.names.UNFINISHED), its last the manifest, and the marker is deleted after. Until the manifest is
there the marker says what the destination is — a conversion in progress, or killed — to `list`, `prune`, `watch` and
every reader (reshard.formats.reader_for, run_layout). Replacing a checkpoint is still built beside it and copied
in, so the old one stays whole until the new one is.
"""
from __future__ import annotations

import json
import os

from reshard import digests, paths
from reshard.errors import ReshardError, UsageError
from reshard.execution import manifest
from reshard.storage import files as fs, names
from reshard.storage.names import MANIFEST, UNFINISHED
from reshard.storage.protocol import Lock, LockHeld, OutputStorage
from reshard.storage.routing import output_for


class Staging:
    """The temporary sibling where output is built, its lock, and the journal of finished files, in `storage`."""

    JOURNAL = names.JOURNAL

    def __init__(self, dst: str, storage: OutputStorage | None = None):
        self.dst = fs.abspath(dst)
        if fs.is_store_root(self.dst):
            raise UsageError.at(self.dst, "a bucket itself cannot be the destination: name a prefix in it "
                                          f"({self.dst}/NAME)")
        self.storage = storage or output_for(self.dst)
        parent, name = os.path.split(self.dst)
        self.staged = os.path.join(parent, f".{name}{names.STAGING_SUFFIX}")
        self.tmp = self.staged       # where the files are built: `staged`, or `dst` itself once use(in_place=True)
        self.in_place = False
        self.marker = os.path.join(self.dst, UNFINISHED)
        self.lock_path = os.path.join(parent, f".{name}{names.LOCK_SUFFIX}")
        self._lock: Lock | None = None

    def leftover(self) -> bool:
        """Is the destination what an in-place run left unfinished (its marker, no manifest)?"""
        return fs.isfile(self.marker) and not fs.isfile(os.path.join(self.dst, MANIFEST))

    def choose(self, single_file: bool) -> bool:
        """Rank 0, holding the lock: build in place? Where the storage has no rename, for a folder output whose
        destination holds nothing yet, or only what an in-place run left (a checkpoint being replaced is built
        beside it, so it stays whole until the new one is)."""
        self.use(self.storage.IN_PLACE and not single_file
                 and (not fs.exists(self.dst) or not fs.listdir(self.dst) or self.leftover()))
        return self.in_place

    def use(self, in_place: bool) -> None:
        self.in_place = in_place
        self.tmp = self.dst if in_place else self.staged

    def place(self, rel: str) -> str:
        """Where the output's file `rel` is built: under the staging folder (see output_path)."""
        return output_path(self.tmp, rel)

    def paths(self, plan, single_file: bool) -> list:
        """Every path a run writes, each file of the plan placed (refused if it leads out): the destination, the
        staging folder and each file in it, the lock, the old destination an overwrite moves aside (the
        storage's commit), and a single file's manifest beside it."""
        placed = [self.place(rel) for rel in _plan_paths(plan)]
        sidecar = [f"{self.dst}.{MANIFEST}"] if single_file else []
        return [self.dst, self.staged, self.lock_path, f"{self.staged}{names.REPLACED_SUFFIX}", *sidecar, *placed]

    def acquire(self) -> None:
        self.storage.make_folder(os.path.dirname(self.dst))
        try:
            self._lock = self.storage.lock(self.lock_path)
        except LockHeld:
            raise ReshardError.at(self.dst, f"another reshard is writing it (lock {self.lock_path} is held)") from None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def prepare(self, plan, resume: bool) -> None:
        if not resume:
            self.storage.delete(self.tmp)     # the leftovers of an interrupted run; --resume would keep them
        else:
            self.storage.drop_unfinished(self.tmp)      # (no writer is at it: the lock is held)
        if self.in_place:   # before any file: until the manifest, the destination says it is not a checkpoint
            self.storage.put(self.marker, (json.dumps({"writing": self.dst}) + "\n").encode())
        self.storage.make_folder(self.tmp)
        for directory in sorted({os.path.dirname(rel) for rel in _plan_paths(plan)} - {""}):
            self.storage.make_folder(self.place(directory))

    def finished(self) -> dict:
        """Files a previous run completed: {path: (size, algorithm, hex digest)}, from the journal."""
        done: dict[str, tuple[int, str, str]] = {}
        try:
            lines = self.storage.get(self.place(self.JOURNAL)).decode().splitlines()
        except OSError:
            return done
        for line in lines:
            try:
                entry = json.loads(line)
                algorithm, digest = digests.of_entry(entry) or ("", "")
                done[entry["path"]] = (entry["size"], algorithm, digest)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue    # a line cut short by the crash
        return done

    def reusable_bytes(self) -> int:
        return sum(size for size, _, _ in self.finished().values())

    def record(self, path: str, size: int, algorithm: str, digest: str) -> None:
        line = json.dumps({"path": path, "size": size, algorithm: digest}) + "\n"
        self.storage.append(self.place(self.JOURNAL), line.encode())

    def commit(self, plan, written: dict, single_file: bool, algorithm: str = digests.DEFAULT) -> str:
        """Write the manifest (`written`: {path: (size, hex digest of `algorithm`)}) and move the output into place;
        returns the manifest's path."""
        self.storage.delete(self.place(self.JOURNAL))
        record = manifest.build(plan, written, algorithm)
        if single_file:
            (only,) = plan.files
            record["files"] = {os.path.basename(self.dst): record["files"][only.path]}
            self.storage.put(self.place(MANIFEST), (json.dumps(record, indent=1) + "\n").encode())
            self.storage.commit_file(self.place(only.path), self.dst)
            self.storage.commit_file(self.place(MANIFEST), f"{self.dst}.{MANIFEST}")
            self.storage.delete(self.tmp)
            return f"{self.dst}.{MANIFEST}"
        self.storage.put(self.place(MANIFEST), (json.dumps(record, indent=1) + "\n").encode())
        if self.in_place:   # the manifest was the commit
            self.storage.delete(self.marker)
        else:
            self.storage.commit(self.tmp, self.dst)
        return os.path.join(self.dst, MANIFEST)

    def discard(self) -> None:
        try:
            self.storage.delete(self.tmp)
        except OSError:
            pass    # what could not be removed stays; the run's own error is the one to report


def output_path(root: str, rel: str) -> str:
    """The one way a file of the output is placed: `rel` (a writer's name for it, made of a tag, a file name...)
    joined under the staging folder `root`, refused when it would lead out (an absolute path, '..', a symlink
    planted in a resumed staging folder): every file the executor writes is placed here, so no writer can
    put one outside the destination, whatever names it is given."""
    why = paths.escape(rel, root)
    if why:
        raise UsageError(f"output file {rel!r}: {why}; every file written stays inside the destination", file=rel)
    return os.path.join(root, rel)


def _plan_paths(plan) -> list:
    return [f.path for f in plan.files] + [c.path for c in plan.copied] + [t.path for t in plan.texts]
