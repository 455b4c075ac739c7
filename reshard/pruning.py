"""`reshard prune`, `reshard.prune`: delete what a retention policy does not keep, crash-safely.

The plan comes from reshard.retention on a fresh listing; without `yes` it is only returned (the dry run).
With `yes` each checkpoint to delete is first renamed to a hidden trash name in its own folder (one atomic
rename: from then on no reader sees it as a checkpoint), the folder fsynced, then the trash removed. A prune
killed at any point leaves every kept checkpoint as it was and at most some trash, which the next `prune --yes`
removes before anything else. A checkpoint whose files changed since the listing is left alone (a save
reusing its name). Links are never followed: a link inside a deleted folder is removed, not its target.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from reshard.errors import ReshardError
from reshard.formats.run_layout import trash_path
from reshard.listing import RECENT_SECONDS, RunListing, list_checkpoints, unchanged
from reshard.retention import DELETE, Policy, decide
from reshard.staging import fsync
from reshard.storage import files as fs
from reshard.storage.routing import output_for
from reshard.thinning import recover


@dataclass(frozen=True)
class PrunePlan:
    root: str
    decisions: list             # [reshard.retention.Decision], oldest first
    trash: list                 # left by an interrupted prune (removed by `yes`)
    executed: bool = False
    removed: list = field(default_factory=list)     # paths deleted (with `yes`)
    changed: list = field(default_factory=list)     # planned for deletion, but their files changed: left alone

    def deleting(self) -> list:
        return [d for d in self.decisions if d.action == DELETE]

    @property
    def bytes_freed(self) -> int:
        """The files' bytes (apparent size, as `list` shows them) of the deletions planned (or, once executed, done)."""
        done = set(self.removed) if self.executed else None
        return sum(d.checkpoint.bytes for d in self.deleting() if done is None or d.checkpoint.path in done)

    def to_dict(self) -> dict:
        return {"root": self.root, "executed": self.executed, "bytes_freed": self.bytes_freed,
                "trash": self.trash, "removed": self.removed, "changed": self.changed,
                "decisions": [{"name": d.checkpoint.name, "step": d.checkpoint.step, "action": d.action,
                               "reasons": list(d.reasons), "status": d.checkpoint.status,
                               "bytes": d.checkpoint.bytes, "disk_bytes": d.checkpoint.disk_bytes}
                              for d in self.decisions]}


def prune(run_dir, policy: Policy, yes: bool = False, metrics: str | None = None, recent: float = RECENT_SECONDS,
          settle: float = 0.0) -> PrunePlan:
    """The checkpoints a retention policy does not keep, as `reshard prune` plans them; deleted with `yes`.

    Args:
        run_dir: a run directory, as for list_checkpoints.
        policy: a Policy (keep_last, keep_best by metric, keep_every, keep_steps, delete_incomplete). Always
            kept: the newest complete checkpoint, and any one `latest`, the framework's best or a link names.
        yes: delete (default: the plan only).
        metrics, recent, settle: as for list_checkpoints.

    Returns:
        A PrunePlan: `decisions` (keep / delete / untouched, and why), `bytes_freed`, and once executed what was
        removed; `to_dict()` is what `reshard prune --json` prints. Raises PolicyError (nothing deleted) when
        the policy cannot be evaluated, UsageError when it says nothing.

    Example:
        >>> plan = reshard.prune("ckpt/", reshard.Policy(keep_last=1))
        >>> [(d.checkpoint.name, d.action) for d in plan.decisions], plan.executed
        ([('global_step2', 'delete'), ('global_step3', 'keep')], False)
    """
    policy.check()
    if yes:     # a `reshard thin` a kill interrupted: finished or rolled back before anything is judged
        recover(run_dir)
    listing = list_checkpoints(run_dir, metrics, policy.metric, recent, settle)
    return carry_out(listing, decide(listing.checkpoints, policy), yes)


def carry_out(listing: RunListing, decisions: list, yes: bool) -> PrunePlan:
    """The plan of `decisions` (reshard.retention.decide on `listing`'s rows, or rows a caller judged itself);
    with `yes`, carried out: an interrupted prune's trash removed first, then each deletion unless its files
    changed since the listing."""
    if not yes:
        return PrunePlan(listing.root, decisions, listing.trash)
    for leftover in listing.trash:      # an interrupted prune's renamed checkpoints: finish it first
        _remove(leftover)
    removed, changed = [], []
    for d in decisions:
        if d.action != DELETE:
            continue
        row = d.checkpoint
        if not unchanged(row, listing.root):
            changed.append(row.path)
            continue
        _delete(row.path)
        removed.append(row.path)
    return PrunePlan(listing.root, decisions, listing.trash, True, removed, changed)


def _delete(path: str) -> None:
    if fs.is_url(path):     # no rename in an object store: its objects go in batched deletes
        try:
            output_for(path).delete(path)
        except OSError as e:
            raise ReshardError.at(path, f"cannot delete ({e.strerror or e}); a rerun of prune --yes finishes it") \
                from None
        return
    trash = trash_path(path)
    try:
        os.rename(path, trash)
        fsync(os.path.dirname(path))
    except OSError as e:
        raise ReshardError.at(path, f"cannot rename for deletion ({e.strerror}); nothing of it deleted") from None
    _remove(trash)


def _remove(trash: str) -> None:
    try:
        if os.path.isdir(trash) and not os.path.islink(trash):
            shutil.rmtree(trash)
        else:
            os.unlink(trash)
        fsync(os.path.dirname(trash))
    except OSError as e:
        raise ReshardError.at(trash, f"cannot remove ({e.strerror}); a rerun of prune --yes finishes it") from None
