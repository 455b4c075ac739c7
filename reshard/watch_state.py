"""What `reshard watch` remembers between passes and across restarts: a small JSON file in the run directory.

For each checkpoint it reported: the fingerprint of its files when it was validated (count, bytes, blocks,
newest mtime — a save reusing the name changes it, and is then new), the verdict, whether the sha256 sums were
checked and whether the action on it (`--exec`) ran; and which checkpoint the `--export-best` file holds. It is
written whole to a hidden sibling and renamed over the old one, so a watcher killed at any point leaves the old
state or the new, never half of one. A lock file beside it keeps a second watcher out. The names are hidden
(run_layout.WATCH_STATE, WATCH_LOCK): `list` and `prune` skip them.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field, replace

from reshard.errors import ReshardError
from reshard.formats.run_layout import WATCH_LOCK, WATCH_STATE
from reshard.staging import fsync, write_text

VERSION = 1


@dataclass(frozen=True)
class Seen:
    """A checkpoint the watcher validated and reported."""
    fingerprint: tuple          # reshard.runs.fingerprint of its row when validated
    status: str                 # reshard.runs COMPLETE or INCOMPLETE
    why: str = ""
    checksums: bool = False     # validated with `checksums` asked (the sums verified where it has a manifest)
    acted: bool = False         # `--exec` ran on it (a good one), or there was nothing to run


@dataclass(frozen=True)
class Best:
    """The checkpoint `--export-best` last wrote to `out`."""
    name: str
    fingerprint: tuple
    out: str


@dataclass(frozen=True)
class WatchState:
    seen: dict = field(default_factory=dict)    # {checkpoint name (relative to the run): Seen}
    best: Best | None = None

    def with_seen(self, name: str, seen: Seen) -> WatchState:
        return replace(self, seen={**self.seen, name: seen})

    def only(self, names) -> WatchState:
        """Forget checkpoints no longer there (deleted by the policy or by the trainer's own rotation)."""
        return replace(self, seen={n: s for n, s in self.seen.items() if n in names})


def path_in(root: str) -> str:
    return os.path.join(root, WATCH_STATE)


def load(root: str) -> WatchState:
    """The state saved in run directory `root`; empty when there is none. A damaged file is refused (one line),
    never overwritten: what it says decides what may be deleted."""
    path = path_in(root)
    if not os.path.exists(path):
        return WatchState()
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}, not {VERSION}")
        seen = {name: Seen(**{**s, "fingerprint": tuple(s["fingerprint"])}) for name, s in data["seen"].items()}
        best = data.get("best")
        return WatchState(seen, Best(**{**best, "fingerprint": tuple(best["fingerprint"])}) if best else None)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ReshardError.at(path, f"not a reshard watch state ({e}); remove it to start over") from None


def save(root: str, state: WatchState) -> None:
    """Write the state atomically: a hidden sibling, fsynced, renamed over the old file."""
    path = path_in(root)
    tmp = f"{path}.tmp"
    data = {"version": VERSION, "seen": {n: asdict(s) for n, s in state.seen.items()},
            "best": asdict(state.best) if state.best else None}
    try:
        write_text(tmp, json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
        fsync(root)
    except OSError as e:
        raise ReshardError.at(path, f"cannot write the watch state ({e.strerror or e})") from None


def lock(root: str) -> int:
    """Hold the run directory's watch lock (flock; `unlock` or the end of the process releases it): a second
    watcher would report, act on and prune the same checkpoints twice."""
    path = os.path.join(root, WATCH_LOCK)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        raise ReshardError.at(path, f"cannot create the watch lock ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ReshardError.at(root, f"another reshard watch is watching it (lock {path} is held)") from None
    return fd


def unlock(root: str, fd: int) -> None:
    """Release the lock and remove its file (as reshard.staging does its own): the run keeps only the state."""
    try:
        os.unlink(os.path.join(root, WATCH_LOCK))
    except OSError:
        pass
    os.close(fd)
