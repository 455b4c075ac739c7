"""What `reshard watch` remembers between passes and across restarts: a small JSON file in the run directory.

For each checkpoint it reported: the fingerprint of its files when it was validated (count, bytes, blocks,
newest mtime — a save reusing the name changes it, and is then new), the verdict, whether the digests were
checked and whether the action on it (`--exec`) ran; and which checkpoint the `--export-best` file holds, with
its score and the file's identity as written (so a restarted watcher replaces it only with a better one). It is
written whole to a hidden sibling and renamed over the old one, so a watcher killed at any point leaves the old
state or the new, never half of one. A lock file beside it keeps a second watcher out. The names are hidden
(reshard.storage.names.WATCH_STATE, WATCH_LOCK): `list` and `prune` skip them.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from reshard.errors import ReshardError
from reshard.storage import files as fs
from reshard.storage.names import WATCH_LOCK, WATCH_STATE
from reshard.storage.protocol import Lock, LockHeld
from reshard.storage.routing import output_for

VERSION = 2
READABLE = (1, 2)       # 1: a Best without its score (what it held is then beaten by any best)


@dataclass(frozen=True)
class Seen:
    """A checkpoint the watcher validated and reported."""
    fingerprint: tuple          # reshard.lifecycle.listing.fingerprint of its row when validated
    status: str                 # reshard.lifecycle.listing COMPLETE or INCOMPLETE
    why: str = ""
    checksums: bool = False     # validated with `checksums` asked (the sums verified where it has a manifest)
    acted: bool = False         # `--exec` ran on it (a good one), or there was nothing to run


@dataclass(frozen=True)
class Best:
    """The checkpoint `--export-best` last wrote to `out`, what it scored, and the file as written: the export is
    replaced only by a strictly better checkpoint, also once its source is deleted (it holds the weights)."""
    name: str
    fingerprint: tuple
    out: str
    metric: str = ""            # ranked by `metric` in `mode`; another ranking makes this memory void
    mode: str = "min"
    value: float | None = None  # None: written by a version that kept no score (any best replaces it)
    step: int | None = None
    written: tuple = ()         # identity(out) after the export: anything else there now was not written by us

    def scored(self, out: str, metric: str, mode: str) -> bool:
        """Whether this is what `out` holds when ranked by `metric` in `mode`, with a score to beat."""
        return (self.out, self.metric, self.mode) == (out, metric, mode) and self.value is not None

    def better(self, value: float) -> bool:
        """Whether `value` is strictly better than the exported one's (any is, where it kept no score)."""
        if self.value is None:
            return True
        return value < self.value if self.mode == "min" else value > self.value


def identity(path: str) -> tuple:
    """What the file at `path` is (on disk: inode, size, mtime in ns; reshard.storage.files.identity); () when
    there is none. The export is replaced by a rename, so a new file there, or an edit, changes it."""
    return fs.identity(path)


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
    if not fs.exists(path):
        return WatchState()
    try:
        with fs.open(path) as f:
            data = json.load(f)
        if data.get("version") not in READABLE:
            raise ValueError(f"version {data.get('version')!r}, not {VERSION}")
        seen = {name: Seen(**{**s, "fingerprint": tuple(s["fingerprint"])}) for name, s in data["seen"].items()}
        best = data.get("best")
        return WatchState(seen, Best(**{**best, "fingerprint": tuple(best["fingerprint"]),
                                        "written": tuple(best.get("written", ()))}) if best else None)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ReshardError.at(path, f"not a reshard watch state ({e}); remove it to start over") from None


def save(root: str, state: WatchState) -> None:
    """Write the state atomically (on disk: a hidden sibling, fsynced, renamed over the old file)."""
    path = path_in(root)
    data = {"version": VERSION, "seen": {n: asdict(s) for n, s in state.seen.items()},
            "best": asdict(state.best) if state.best else None}
    text = json.dumps(data, indent=1) + "\n"
    try:
        output_for(root).put_atomic(path, text.encode())
    except OSError as e:
        raise ReshardError.at(path, f"cannot write the watch state ({e.strerror or e})") from None


def lock(root: str) -> Lock:
    """Hold the run directory's watch lock (the storage's: an flock on disk, a conditional PUT in an object store;
    `release()` or, on disk, the end of the process lets go of it, removing its file): a second watcher would
    report, act on and prune the same checkpoints twice."""
    path = os.path.join(root, WATCH_LOCK)
    try:
        return output_for(root).lock(path)
    except LockHeld:
        raise ReshardError.at(root, f"another reshard watch is watching it (lock {path} is held)") from None
    except OSError as e:
        raise ReshardError.at(path, f"cannot create the watch lock ({e.strerror})") from None
