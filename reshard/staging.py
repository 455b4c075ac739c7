"""Where output is built before it is committed: a hidden sibling of the destination.

`.DST.reshard-tmp` holds the files being written; `.DST.reshard-lock` (flock) keeps a second
writer out; a journal lists each finished file with its sha256, so a run killed half way can be
resumed keeping what is whole. Committing writes the manifest and renames the sibling into place,
so the destination appears complete or not at all.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil

from reshard import manifest, paths
from reshard.errors import ReshardError, UsageError


class Staging:
    """The temporary sibling where output is built, its lock, and the journal of finished files."""

    JOURNAL = ".reshard-journal"

    def __init__(self, dst: str):
        self.dst = os.path.abspath(dst)
        parent, name = os.path.split(self.dst)
        self.tmp = os.path.join(parent, f".{name}.reshard-tmp")
        self.lock_path = os.path.join(parent, f".{name}.reshard-lock")
        self._lock = None

    def place(self, rel: str) -> str:
        """Where the output's file `rel` is built: under the staging folder (see output_path)."""
        return output_path(self.tmp, rel)

    def paths(self, plan, single_file: bool) -> list:
        """Every path a run writes, each file of the plan placed (refused if it leads out): the destination, the
        staging folder and each file in it, the lock, the old destination an overwrite moves aside, and a single
        file's manifest beside it."""
        placed = [self.place(rel) for rel in _plan_paths(plan)]
        sidecar = [f"{self.dst}.{manifest.NAME}"] if single_file else []
        return [self.dst, self.tmp, self.lock_path, f"{self.tmp}.old", *sidecar, *placed]

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.dst), exist_ok=True)
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ReshardError.at(self.dst, f"another reshard is writing it (lock {self.lock_path} is held)") from None
        self._lock = fd

    def release(self) -> None:
        if self._lock is not None:
            try:
                os.unlink(self.lock_path)
            except OSError:
                pass
            os.close(self._lock)
            self._lock = None

    def prepare(self, plan, resume: bool) -> None:
        if os.path.exists(self.tmp) and not resume:
            shutil.rmtree(self.tmp)     # the leftovers of an interrupted run; --resume would keep them
        os.makedirs(self.tmp, exist_ok=True)
        for directory in sorted({os.path.dirname(rel) for rel in _plan_paths(plan)} - {""}):
            os.makedirs(self.place(directory), exist_ok=True)

    def finished(self) -> dict:
        """Files a previous run completed: {path: (size, sha256)}, from the journal."""
        done = {}
        try:
            with open(self.place(self.JOURNAL)) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        done[entry["path"]] = (entry["size"], entry["sha256"])
                    except (ValueError, KeyError, TypeError):
                        continue    # a line cut short by the crash
        except OSError:
            pass
        return done

    def reusable_bytes(self) -> int:
        return sum(size for size, _ in self.finished().values())

    def record(self, path: str, size: int, sha256: str) -> None:
        line = json.dumps({"path": path, "size": size, "sha256": sha256}) + "\n"
        fd = os.open(self.place(self.JOURNAL), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self, plan, digests: dict, single_file: bool) -> str:
        """Write the manifest and move the output into place; returns the manifest's path."""
        journal = self.place(self.JOURNAL)
        if os.path.exists(journal):
            os.unlink(journal)
        record = manifest.build(plan, digests)
        if single_file:
            (only,) = plan.files
            record["files"] = {os.path.basename(self.dst): record["files"][only.path]}
            write_text(self.place(manifest.NAME), json.dumps(record, indent=1) + "\n")
            os.replace(self.place(only.path), self.dst)
            os.replace(self.place(manifest.NAME), f"{self.dst}.{manifest.NAME}")
            fsync(os.path.dirname(self.dst))
            shutil.rmtree(self.tmp)
            return f"{self.dst}.{manifest.NAME}"
        write_text(self.place(manifest.NAME), json.dumps(record, indent=1) + "\n")
        _rename_into_place(self.tmp, self.dst)
        return os.path.join(self.dst, manifest.NAME)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


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


def write_text(path: str, text: str | bytes) -> None:
    with open(path, "wb" if isinstance(text, bytes) else "w") as fh:
        fh.write(text)
    fsync(path)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_into_place(tmp: str, dst: str) -> None:
    for folder, _, files in os.walk(tmp):
        fsync(folder)
    if os.path.exists(dst):
        trash = f"{tmp}.old"
        os.rename(dst, trash)
        os.rename(tmp, dst)
        shutil.rmtree(trash)
    else:
        os.rename(tmp, dst)
    fsync(os.path.dirname(dst))
