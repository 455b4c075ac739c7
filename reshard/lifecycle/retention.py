"""Which checkpoints a retention policy keeps, and at which tier: pure, from the rows of a listing
(reshard.lifecycle.listing), no I/O.

A policy is a set of rules, each keeping some complete checkpoints at a tier, full (as saved) or weights (the
weights-only form `reshard thin` leaves): the last K, the best M by a metric, every N-th step, named steps, one per
DURATION of save time. A checkpoint kept by several rules gets the richest of their tiers; one kept only at the
weights tier is thinned (THIN), and one kept by no rule is deleted. Above the rules stand the invariants: the
newest complete checkpoint and every checkpoint something names (`latest`, the framework's best) are kept full; an
incomplete checkpoint never counts toward K and is deleted only with `delete_incomplete`; a save in progress is
never touched; a checkpoint whose contents reshard cannot verify, or that it does not recognise whole, is always
kept as it is and never counts toward K: only what was proven complete (or, with `delete_incomplete`, proven
incomplete as a whole unit) is ever deleted or thinned. A checkpoint already weights-only is kept as it is (it is
never thinned twice, and nothing can make it full again). A policy that cannot be evaluated (no checkpoint records
the metric) deletes nothing: PolicyError, one line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reshard.errors import ReshardError, UsageError
from reshard.lifecycle.listing import COMPLETE, IN_PROGRESS, INCOMPLETE, UNKNOWN, UNVERIFIABLE, Checkpoint, order
from reshard.text import counted

KEEP, THIN, DELETE, UNTOUCHED = "keep", "thin", "delete", "untouched"
FULL, WEIGHTS = "full", "weights"
TIERS = (FULL, WEIGHTS)         # richest first: a checkpoint kept by several rules gets the first of theirs
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


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
    keep_interval: float | None = None  # seconds: one checkpoint per this much save time (Orbax's EveryNSeconds)
    # the tier each rule keeps at (FULL or WEIGHTS)
    keep_last_tier: str = FULL
    keep_best_tier: str = FULL
    keep_every_tier: str = FULL
    keep_steps_tier: str = FULL
    keep_interval_tier: str = FULL

    def keeps_by_rule(self) -> bool:
        return bool(self.keep_last or self.keep_best or self.keep_every or self.keep_steps or self.keep_interval)

    def check(self) -> None:
        """Refuse (UsageError) a policy that says nothing or contradicts itself."""
        for name in ("keep_last", "keep_best", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        if self.keep_interval is not None and not self.keep_interval > 0:
            raise UsageError(f"--keep-interval must be more than 0 s (got {self.keep_interval:g})")
        for name in ("keep_last", "keep_best", "keep_every", "keep_steps", "keep_interval"):
            tier = getattr(self, f"{name}_tier")
            if tier not in TIERS:
                raise UsageError(f"--{name.replace('_', '-')}'s tier is {' or '.join(TIERS)} (got {tier!r})")
        if not (self.keeps_by_rule() or self.delete_incomplete):
            raise UsageError("no retention rule given (--keep-last, --keep-best, --keep-every, --keep-steps, "
                             "--keep-interval, --delete-incomplete)")
        if self.keep_best and not self.metric:
            raise UsageError("--keep-best needs --metric NAME")
        if self.mode not in ("min", "max"):
            raise UsageError(f"--mode is min or max (got {self.mode!r})")


@dataclass(frozen=True)
class Decision:
    checkpoint: Checkpoint
    action: str                 # KEEP, THIN, DELETE, UNTOUCHED
    reasons: tuple = field(default_factory=tuple)
    tier: str | None = None     # a complete one kept or thinned: what it is afterwards (FULL, WEIGHTS)
    bytes_after: int = 0        # its files' bytes once the plan is carried out (a thin's: `estimate`)
    estimate: bool = False      # bytes_after is the split's weights + other, not a thinned form's files

    @property
    def bytes_before(self) -> int:
        return self.checkpoint.bytes


def parse_duration(text: str) -> float:
    """Seconds of `30m`, `6h`, `2d`, `1w`, `90s` (a number and one unit); UsageError, one line, otherwise."""
    number, unit = text.strip()[:-1], text.strip()[-1:].lower()
    try:
        seconds = float(number) * DURATION_UNITS[unit]
    except (KeyError, ValueError):
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(f"not a duration: {text!r} (a number and s, m, h, d or w: 30m, 6h, 2d)")
    return seconds


def duration_text(seconds: float) -> str:
    """`1d`, `6h`, `90s`: the largest unit that divides it (how a reason names the interval)."""
    for unit, size in sorted(DURATION_UNITS.items(), key=lambda u: -u[1]):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def decide(rows: list, policy: Policy) -> list:
    """A Decision for every row, series by series (each folder of checkpoints is ranked on its own), oldest first."""
    policy.check()
    series: dict[str, list] = {}
    for r in sorted(rows, key=order):
        series.setdefault(r.series, []).append(r)
    return [d for group in series.values() for d in _decide_series(group, policy)]


def _decide_series(rows: list, policy: Policy) -> list:
    complete = [r for r in rows if r.status == COMPLETE]
    kept: dict[str, list[tuple[str, str]]] = {r.path: [] for r in rows}    # path -> [(why, tier)]
    if complete:
        kept[complete[-1].path].append(("newest complete checkpoint", FULL))
    for r in rows:
        kept[r.path] += [(why, FULL) for why in r.pinned]
    if policy.keep_last:
        for r in complete[-policy.keep_last:]:
            kept[r.path].append((f"among the last {policy.keep_last} complete", policy.keep_last_tier))
    if policy.keep_best:
        _keep_best(complete, policy, kept)
    if policy.keep_every:
        for r in complete:
            if r.step is not None and r.step % policy.keep_every == 0:
                kept[r.path].append((f"step a multiple of {policy.keep_every}", policy.keep_every_tier))
    if policy.keep_interval:
        _keep_interval(complete, policy.keep_interval, policy.keep_interval_tier, kept)
    for r in complete:
        if r.step is not None and r.step in policy.keep_steps:
            kept[r.path].append((f"step {r.step} kept by --keep-steps", policy.keep_steps_tier))
        if not policy.keeps_by_rule():      # --delete-incomplete alone removes broken saves, nothing else
            kept[r.path].append(("complete, and no --keep rule given", FULL))
    if policy.keep_best and policy.metric:  # one the metric cannot rank may be the best: not the policy's call
        unranked = [r for r in complete if metric_of(r, policy.metric) is None and not kept[r.path]]
        if unranked:
            raise PolicyError.at(unranked[0].path, f"records no {policy.metric!r} at its step, so --keep-best cannot "
                                 f"rank it ({counted(len(unranked), 'such checkpoint')}; --metrics FILE gives values): "
                                 "nothing deleted")
    return [_decision(r, kept[r.path], policy) for r in rows]


def _keep_interval(complete: list, seconds: float, tier: str, kept: dict) -> None:
    """Orbax's EveryNSeconds: oldest first by save time (the newest file's mtime), the first one, then each saved
    at least `seconds` after the last one this rule kept."""
    last = None
    for r in sorted(complete, key=lambda r: (r.mtime, order(r))):
        if last is None or r.mtime - last >= seconds:
            kept[r.path].append((f"one per {duration_text(seconds)} of save time", tier))
            last = r.mtime


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
        why = f"best {rank} of {policy.keep_best} by {policy.metric} ({value:g})"
        kept[r.path].append((why, policy.keep_best_tier))


def ranked(rows: list, metric: str, mode: str) -> list:
    """[(value, row)] of the rows (oldest first) that record `metric`, best first; between equal values the newer."""
    scored = [(metric_of(r, metric), age, r) for age, r in enumerate(rows)]
    best_first = sorted(((v, age, r) for v, age, r in scored if v is not None),
                        key=lambda s: (s[0] if mode == "min" else -s[0], -s[1]))
    return [(v, r) for v, _, r in best_first]


def _decision(row, kept: list, policy: Policy) -> Decision:
    if row.status == IN_PROGRESS:
        return Decision(row, UNTOUCHED, (f"in progress: {row.why}",), bytes_after=row.bytes)
    reasons = tuple(_worded(why, tier) for why, tier in kept)
    if row.status in (UNVERIFIABLE, UNKNOWN):
        return Decision(row, KEEP, (row.why, *reasons), bytes_after=row.bytes)
    if reasons and row.status == COMPLETE:
        return _kept(row, reasons, richest(tier for _, tier in kept))
    if reasons:         # an incomplete one something names: kept as it is
        return Decision(row, KEEP, reasons, bytes_after=row.bytes)
    if row.status == INCOMPLETE:
        if policy.delete_incomplete:
            return Decision(row, DELETE, (f"incomplete: {row.why}",))
        return Decision(row, KEEP, ("incomplete (deleted only with --delete-incomplete)",), bytes_after=row.bytes)
    if row.status != COMPLETE:      # a status this policy does not know: kept
        return Decision(row, KEEP, (f"{row.status}: {row.why}",), bytes_after=row.bytes)
    return Decision(row, DELETE, ("kept by no rule",))


def _kept(row, reasons: tuple, tier: str) -> Decision:
    """A complete checkpoint some rule keeps, at `tier`: kept, or thinned where every rule keeping it says weights."""
    if row.weights_only:        # thinned before: never thinned twice, never made full again
        return Decision(row, KEEP, (*reasons, "already weights-only"), WEIGHTS, row.bytes)
    if tier == FULL:
        return Decision(row, KEEP, reasons, FULL, row.bytes)
    kinds = row.bytes_by_kind
    if kinds is None:       # nothing says what a thin would leave: no thin is planned blind
        return Decision(row, KEEP, (*reasons, "kept full: its bytes by kind are unknown, so no thin is planned"),
                        FULL, row.bytes)
    return Decision(row, THIN, reasons, WEIGHTS, kinds.weights + kinds.other, estimate=True)


def richest(tiers) -> str:
    """The richest of some tiers (FULL before WEIGHTS)."""
    return min(tiers, key=TIERS.index)


def _worded(why: str, tier: str) -> str:
    return f"{why} (weights)" if tier == WEIGHTS else why
