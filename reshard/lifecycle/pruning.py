"""`reshard prune`, `reshard.prune`: delete what a retention policy does not keep, thin what it keeps at the weights
tier only, crash-safely.

The plan comes from reshard.lifecycle.retention on a fresh listing; without `yes` it is only returned (the dry run).
With `yes` the deletions come first (they free the space a thin writes its weights-only form into), then the thins,
oldest first, each by a Thinner (reshard.lifecycle.thinning, which journals its own swap); a checkpoint that cannot be
thinned is left full and said, never deleted instead, and the rest go on. Each checkpoint to delete is first
renamed to a hidden trash name in its own folder (one atomic rename: from then on no reader sees it as a
checkpoint), the folder fsynced, then the trash removed. A prune killed at any point leaves every kept checkpoint
as it was and at most some trash, which the next `prune --yes` removes before anything else. A checkpoint whose
files changed since the listing is left alone (a save reusing its name). Links are never followed: a link inside a
deleted folder is removed, not its target.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

from reshard.errors import ReshardError
from reshard.lifecycle.listing import RECENT_SECONDS, RunListing, list_checkpoints, unchanged
from reshard.lifecycle.retention import DELETE, FULL, KEEP, THIN, Decision, Policy, decide
from reshard.lifecycle.run_layout import trash_path
from reshard.lifecycle.sizes import cost_per_month
from reshard.lifecycle.thinning import recover
from reshard.storage.protocol import OutputStorage
from reshard.storage.routing import output_for


class ThinOutcome(Protocol):
    """What thinning one checkpoint did (reshard.lifecycle.thinning.thin's result, frozen: read-only here too)."""
    @property
    def bytes_before(self) -> int: ...
    @property
    def bytes_after(self) -> int: ...
    @property
    def executed(self) -> bool: ...


class Thinner(Protocol):
    """Replaces a complete checkpoint by its weights-only form in place; raises ReshardError (one line) when it
    cannot, leaving the checkpoint full."""

    def thin(self, path: str) -> ThinOutcome: ...

    def refusal(self, path: str) -> str | None:
        """Why the checkpoint at `path` has no weights-only form, as its catalog says before anything is written
        (one line); None where it has one."""
        ...


class LibraryThinner:
    """`reshard thin CKPT --yes`, as reshard.lifecycle.thinning does it. Imported when built, not before: the listing
    and planning never need it, and a build without it refuses a plan with thins before anything is done."""

    def __init__(self, recent: float = RECENT_SECONDS):
        from reshard.lifecycle import thinning  # (it imports the executor: only a plan that thins needs it)
        self.thinning = thinning
        self.recent = recent

    def thin(self, path: str) -> ThinOutcome:
        return self.thinning.thin(path, yes=True, recent=self.recent)

    def refusal(self, path: str) -> str | None:
        return self.thinning.refusal(path)


@dataclass(frozen=True)
class Thinned:
    """A checkpoint thinned to its weights-only form: its files' bytes before and after."""
    path: str
    bytes_before: int
    bytes_after: int


@dataclass(frozen=True)
class NotThinned:
    """A checkpoint planned for a thin and left full: why, one line."""
    path: str
    why: str


@dataclass(frozen=True)
class PrunePlan:
    root: str
    decisions: list             # [reshard.lifecycle.retention.Decision], oldest first
    trash: list                 # left by an interrupted prune (removed by `yes`)
    executed: bool = False
    removed: list = field(default_factory=list)     # paths deleted (with `yes`)
    changed: list = field(default_factory=list)     # planned for deletion or a thin, but their files changed: left
    thinned: list = field(default_factory=list)     # [Thinned] (with `yes`)
    not_thinned: list = field(default_factory=list)     # [NotThinned]: a thin refused; left full

    def deleting(self) -> list:
        return [d for d in self.decisions if d.action == DELETE]

    def thinning(self) -> list:
        return [d for d in self.decisions if d.action == THIN]

    def after(self, d) -> int:
        """A decision's files' bytes after the plan: planned (a thin's an estimate) or, once executed, done."""
        if not self.executed:
            return d.bytes_after
        done = {t.path: t.bytes_after for t in self.thinned}
        if d.action == DELETE and d.checkpoint.path in self.removed:
            return 0
        return done.get(d.checkpoint.path, d.checkpoint.bytes)

    def estimated(self, d) -> bool:
        """Is after(d) an estimate (a thin planned, not done)?"""
        return d.estimate and not self.executed

    @property
    def bytes_before(self) -> int:
        """The files' bytes of every checkpoint listed (apparent size, as `list` shows them)."""
        return sum(d.checkpoint.bytes for d in self.decisions)

    @property
    def bytes_after(self) -> int:
        return sum(self.after(d) for d in self.decisions)

    @property
    def bytes_freed(self) -> int:
        """What the deletions and thins planned (or, once executed, done) free of the files' bytes."""
        return self.bytes_before - self.bytes_after

    def to_dict(self, price: float | None = None) -> dict:
        out = {"root": self.root, "executed": self.executed, "bytes_before": self.bytes_before,
               "bytes_after": self.bytes_after, "bytes_freed": self.bytes_freed,
               "estimate": any(self.estimated(d) for d in self.decisions),
               "trash": self.trash, "removed": self.removed, "changed": self.changed,
               "thinned": [{"path": t.path, "bytes_before": t.bytes_before, "bytes_after": t.bytes_after}
                           for t in self.thinned],
               "not_thinned": [{"path": n.path, "why": n.why} for n in self.not_thinned],
               "decisions": [self._decision(d, price) for d in self.decisions]}
        if price is not None:
            out["price_usd_per_gb_month"] = price
            out["cost_per_month"] = cost_per_month({"before": self.bytes_before, "after": self.bytes_after}, price)
        return out

    def _decision(self, d, price: float | None) -> dict:
        r = d.checkpoint
        out = {"name": r.name, "step": r.step, "action": d.action, "tier": d.tier, "reasons": list(d.reasons),
               "status": r.status, "bytes": r.bytes, "disk_bytes": r.disk_bytes, "bytes_after": self.after(d),
               "estimate": self.estimated(d)}
        if price is not None:
            out["cost_per_month"] = cost_per_month({"before": r.bytes, "after": self.after(d)}, price)
        return out


def prune(run_dir, policy: Policy, yes: bool = False, metrics: str | None = None, recent: float = RECENT_SECONDS,
          settle: float = 0.0, thinner: Thinner | None = None) -> PrunePlan:
    """The checkpoints a retention policy does not keep, and those it keeps at the weights tier only, as `reshard
    prune` plans them; deleted and thinned with `yes`.

    Args:
        run_dir: a run directory, as for list_checkpoints.
        policy: a Policy (keep_last, keep_best by metric, keep_every, keep_steps, keep_interval, each at a tier,
            full or weights; delete_incomplete). Always kept full: the newest complete checkpoint, and any one
            `latest`, the framework's best or a link names.
        yes: delete and thin (default: the plan only).
        metrics, recent, settle: as for list_checkpoints.
        thinner: what thins (default: reshard.lifecycle.thinning, as `reshard thin --yes`).

    Returns:
        A PrunePlan: `decisions` (keep / thin / delete / untouched, the tier, why, bytes after), `bytes_before`,
        `bytes_after`, `bytes_freed`, and once executed what was removed and thinned; `to_dict(price)` is what
        `reshard prune --json` prints. Raises PolicyError (nothing deleted) when
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
    decisions = decide(listing.checkpoints, policy)
    if thinner is None and any(d.action == THIN for d in decisions):
        thinner = LibraryThinner(recent)    # a thin looks at the run again: as recent as this listing
    return carry_out(listing, known_refusals(decisions, thinner), yes, thinner)


def known_refusals(decisions: list, thinner: Thinner | None) -> list:
    """The decisions, each planned thin of a checkpoint with no weights-only form (its catalog says so) made a
    keep at the full tier with the reason: the dry run says ahead what --yes would leave full."""
    out = []
    for d in decisions:
        why = thinner.refusal(d.checkpoint.path) if d.action == THIN and thinner is not None else None
        kept = (*d.reasons, f"kept full, not thinned: {why}")
        out.append(d if why is None else Decision(d.checkpoint, KEEP, kept, FULL, d.checkpoint.bytes))
    return out


def carry_out(listing: RunListing, decisions: list, yes: bool, thinner: Thinner | None = None) -> PrunePlan:
    """The plan of `decisions` (reshard.lifecycle.retention.decide on `listing`'s rows, or rows a caller judged itself);
    with `yes`, carried out: an interrupted prune's trash removed first, then each deletion, then each thin (by
    `thinner`, default LibraryThinner), each unless its files changed since the listing."""
    if not yes:
        return PrunePlan(listing.root, decisions, listing.trash)
    if thinner is None and any(d.action == THIN for d in decisions):
        thinner = LibraryThinner()      # before anything is done: a build that cannot thin changes nothing
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
    thinned, refused = _thin_all([d for d in decisions if d.action == THIN], listing.root, thinner, changed)
    return PrunePlan(listing.root, decisions, listing.trash, True, removed, changed, thinned, refused)


def _thin_all(thins: list, root: str, thinner: Thinner | None, changed: list) -> tuple:
    """([Thinned], [NotThinned]): each planned thin, oldest first. One that fails is left full (the thinner swaps
    in the weights-only form only once it is whole) and the others go on: a thin is never a deletion."""
    thinned, refused = [], []
    for d in thins:
        row = d.checkpoint
        if not unchanged(row, root):
            changed.append(row.path)
            continue
        assert thinner is not None      # (carry_out builds one when a thin is planned)
        try:
            outcome = thinner.thin(row.path)
        except ReshardError as e:
            refused.append(NotThinned(row.path, str(e)))
            continue
        if not outcome.executed:
            refused.append(NotThinned(row.path, f"{row.path}: the thin was not carried out; left full"))
            continue
        thinned.append(Thinned(row.path, outcome.bytes_before, outcome.bytes_after))
    return thinned, refused


def _delete(path: str) -> None:
    """Set aside in one step (on disk: renamed to its trash name), then removed (in an object store, which has no
    rename, its objects go in batched deletes, its manifest first)."""
    storage = output_for(path)
    try:
        gone = storage.set_aside(path, trash_path(path))
    except OSError as e:
        raise ReshardError.at(path, f"cannot rename for deletion ({e.strerror}); nothing of it deleted") from None
    _remove(gone, storage)


def _remove(trash: str, storage: OutputStorage | None = None) -> None:
    storage = storage or output_for(trash)
    try:
        storage.delete(trash)
        storage.sync(os.path.dirname(trash))
    except OSError as e:
        raise ReshardError.at(trash, f"cannot remove ({e.strerror or e}); a rerun of prune --yes finishes it") \
            from None
