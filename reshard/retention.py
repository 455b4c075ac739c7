"""Which checkpoints a retention policy keeps: pure, from the rows of a listing (reshard.listing), no I/O.

A policy is a set of rules, each keeping some complete checkpoints: the last K, the best M by a metric, every
N-th step, named steps. A checkpoint kept by any rule stays; the others are deleted. Above the rules stand the
invariants: the newest complete checkpoint and every checkpoint something names (`latest`, the framework's best)
are kept; an incomplete checkpoint never counts toward K and is deleted only with `delete_incomplete`; a save
in progress is never touched; a checkpoint whose contents reshard cannot verify, or that it does not recognise
whole, is always kept and never counts toward K: only what was proven complete (or, with `delete_incomplete`,
proven incomplete as a whole unit) is ever deleted. A policy that cannot be evaluated (no checkpoint records the
metric) deletes nothing: PolicyError, one line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reshard.errors import ReshardError, UsageError
from reshard.listing import COMPLETE, IN_PROGRESS, INCOMPLETE, UNKNOWN, UNVERIFIABLE, order
from reshard.text import counted

KEEP, DELETE, UNTOUCHED = "keep", "delete", "untouched"


class PolicyError(ReshardError):
    """The policy cannot be evaluated on this run: nothing is deleted."""


@dataclass(frozen=True)
class Policy:
    keep_last: int | None = None        # the K newest complete checkpoints
    keep_best: int | None = None        # the M best complete checkpoints by `metric`
    metric: str | None = None
    mode: str = "min"                   # "min": lower is better (a loss); "max": higher (an accuracy)
    keep_every: int | None = None       # every checkpoint whose step is a multiple of N
    keep_steps: tuple = ()              # these steps
    delete_incomplete: bool = False     # also delete incomplete checkpoints nothing names

    def keeps_by_rule(self) -> bool:
        return bool(self.keep_last or self.keep_best or self.keep_every or self.keep_steps)

    def check(self) -> None:
        """Refuse (UsageError) a policy that says nothing or contradicts itself."""
        if not (self.keeps_by_rule() or self.delete_incomplete):
            raise UsageError("no retention rule given (--keep-last, --keep-best, --keep-every, --keep-steps, "
                             "--delete-incomplete)")
        for name in ("keep_last", "keep_best", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        if self.keep_best and not self.metric:
            raise UsageError("--keep-best needs --metric NAME")
        if self.mode not in ("min", "max"):
            raise UsageError(f"--mode is min or max (got {self.mode!r})")


@dataclass(frozen=True)
class Decision:
    checkpoint: object          # a reshard.listing.Checkpoint
    action: str                 # KEEP, DELETE, UNTOUCHED
    reasons: tuple = field(default_factory=tuple)


def decide(rows: list, policy: Policy) -> list:
    """A Decision for every row, series by series (each folder of checkpoints is ranked on its own), oldest first."""
    policy.check()
    series: dict[str, list] = {}
    for r in sorted(rows, key=order):
        series.setdefault(r.series, []).append(r)
    return [d for group in series.values() for d in _decide_series(group, policy)]


def _decide_series(rows: list, policy: Policy) -> list:
    complete = [r for r in rows if r.status == COMPLETE]
    kept: dict[str, list[str]] = {r.path: [] for r in rows}
    if complete:
        kept[complete[-1].path].append("newest complete checkpoint")
    for r in rows:
        kept[r.path] += list(r.pinned)
    if policy.keep_last:
        for r in complete[-policy.keep_last:]:
            kept[r.path].append(f"among the last {policy.keep_last} complete")
    if policy.keep_best:
        _keep_best(complete, policy, kept)
    if policy.keep_every:
        for r in complete:
            if r.step is not None and r.step % policy.keep_every == 0:
                kept[r.path].append(f"step a multiple of {policy.keep_every}")
    for r in complete:
        if r.step is not None and r.step in policy.keep_steps:
            kept[r.path].append(f"step {r.step} kept by --keep-steps")
        if not policy.keeps_by_rule():      # --delete-incomplete alone removes broken saves, nothing else
            kept[r.path].append("complete, and no --keep rule given")
    if policy.keep_best and policy.metric:  # one the metric cannot rank may be the best: not the policy's call
        unranked = [r for r in complete if metric_of(r, policy.metric) is None and not kept[r.path]]
        if unranked:
            raise PolicyError.at(unranked[0].path, f"records no {policy.metric!r} at its step, so --keep-best cannot "
                                 f"rank it ({counted(len(unranked), 'such checkpoint')}; --metrics FILE gives values): "
                                 "nothing deleted")
    return [_decision(r, kept[r.path], policy) for r in rows]


def metric_of(row, metric: str) -> float | None:
    """The row's value of `metric`; Hugging Face logs `eval_X` for a metric_for_best_model `X`."""
    for name in (metric, f"eval_{metric}"):
        if name in row.metrics:
            return row.metrics[name]
    return None


def _keep_best(complete: list, policy: Policy, kept: dict) -> None:
    assert policy.metric is not None        # (Policy: --keep-best needs --metric)
    if not any(metric_of(r, policy.metric) is not None for r in complete):
        recorded = sorted({k for r in complete for k in r.metrics})
        raise PolicyError(f"no complete checkpoint records metric {policy.metric!r} (recorded: "
                          f"{', '.join(recorded) or 'none'}; --metrics FILE gives values): nothing deleted")
    for rank, (value, r) in enumerate(ranked(complete, policy.metric, policy.mode)[:policy.keep_best], 1):
        kept[r.path].append(f"best {rank} of {policy.keep_best} by {policy.metric} ({value:g})")


def ranked(rows: list, metric: str, mode: str) -> list:
    """[(value, row)] of the rows (oldest first) that record `metric`, best first; between equal values the newer."""
    scored = [(metric_of(r, metric), age, r) for age, r in enumerate(rows)]
    best_first = sorted(((v, age, r) for v, age, r in scored if v is not None),
                        key=lambda s: (s[0] if mode == "min" else -s[0], -s[1]))
    return [(v, r) for v, _, r in best_first]


def _decision(row, reasons: list, policy: Policy) -> Decision:
    if row.status == IN_PROGRESS:
        return Decision(row, UNTOUCHED, (f"in progress: {row.why}",))
    if row.status in (UNVERIFIABLE, UNKNOWN):
        return Decision(row, KEEP, (row.why, *reasons))
    if reasons:
        return Decision(row, KEEP, tuple(reasons))
    if row.status == INCOMPLETE:
        if policy.delete_incomplete:
            return Decision(row, DELETE, (f"incomplete: {row.why}",))
        return Decision(row, KEEP, ("incomplete (deleted only with --delete-incomplete)",))
    if row.status != COMPLETE:      # a status this policy does not know: kept
        return Decision(row, KEEP, (f"{row.status}: {row.why}",))
    return Decision(row, DELETE, ("kept by no rule",))
