"""`reshard watch`, `reshard.Watcher`: the sidecar beside training that validates each checkpoint as it lands.

Each pass lists the run directory (reshard.lifecycle.listing, with its `settle` second look: a checkpoint whose files
changed between the two looks, or were modified in the last `recent` seconds, is still being written; a DCP
folder is finished only with its `.metadata`). A tag folder newer than the one `latest` names is held back too:
DeepSpeed moves `latest` only when the save is done. Each newly finished checkpoint is then judged — the
listing's coverage proof, and with `checksums` the digests of a manifest where it has one — and looked at
once more: if its files changed while it was judged it is retried next pass, never reported broken. Then it is
reported (one line), remembered (reshard.lifecycle.watch_state), acted on (`exec`), the best exported, and last the
retention policy applied to the checkpoints the watcher validated, all others counting as in progress: nothing
it has not validated is ever deleted, and prune's invariants hold (the same reshard.lifecycle.retention.decide).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from reshard.commands.inspect import human_bytes
from reshard.commands.validate import validate
from reshard.errors import ReshardError, UsageError
from reshard.formats import read as read_catalog
from reshard.lifecycle import watch_state
from reshard.lifecycle.listing import (
    COMPLETE,
    IN_PROGRESS,
    INCOMPLETE,
    RECENT_SECONDS,
    Checkpoint,
    fingerprint,
    list_checkpoints,
    problem_line,
    unchanged,
)
from reshard.lifecycle.pruning import LibraryThinner, Thinner, carry_out, known_refusals
from reshard.lifecycle.retention import THIN, Policy, decide, metric_of, ranked
from reshard.lifecycle.thinning import recover
from reshard.storage import files as fs

SETTLE_SECONDS = 1.0        # the second look of each pass: sizes equal twice this far apart
INTERVAL_SECONDS = 5.0
EXEC_VARIABLE = "RESHARD_CHECKPOINT"    # --exec CMD sees the checkpoint's path here, and as `{}` in CMD
STEP_VARIABLE = "RESHARD_STEP"
EXPORT_SUFFIX = ".safetensors"          # one file: the export replaces it with a single rename


@dataclass(frozen=True)
class Event:
    """A checkpoint the watcher judged: validated (complete, incomplete) or, unread, kept (unverifiable, unknown);
    one line of `reshard watch`."""
    name: str
    path: str
    step: int | None
    status: str                 # COMPLETE, INCOMPLETE, or (kept, never deleted) UNVERIFIABLE, UNKNOWN
    why: str
    bytes: int
    metrics: dict = field(default_factory=dict)
    checksums: bool = False     # its manifest's digests were verified

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE

    def line(self, root: str, metric: str | None = None) -> str:
        """`step 4000: complete, 42.1 GiB, eval_loss 1.83 (global_step4000)`, or the loud INCOMPLETE one."""
        head = label(self)
        if self.status == INCOMPLETE:
            return f"{head}: INCOMPLETE — {within(self.why, root)} ({self.name})"
        if not self.complete:
            return f"{head}: {self.status}, kept — {within(self.why, root)} ({self.name})"
        words = [f"complete{' (digests checked)' if self.checksums else ''}", human_bytes(self.bytes)]
        value = metric_of(self, metric) if metric else None
        if value is not None:
            words.append(f"{metric} {value:g}")
        elif not metric:
            words += [f"{k} {v:g}" for k, v in sorted(self.metrics.items())]
        return f"{head}: {', '.join(words)} ({self.name})"


@dataclass(frozen=True)
class Pass:
    """What one pass of the watcher did."""
    reported: tuple = ()        # (Event), in the order judged: validated, or kept unread (unverifiable, unknown)
    waiting: tuple = ()         # (reshard.lifecycle.listing.Checkpoint) still being written, or changed while validated
    removed: tuple = ()         # names the policy deleted
    exported: str | None = None     # the name newly exported as the best
    problems: tuple = ()        # lines: a policy that cannot be evaluated, a failed --exec, export or thin
    thinned: tuple = ()         # names the policy thinned to their weights

    @property
    def broken(self) -> bool:
        return any(e.status == INCOMPLETE for e in self.reported)


class Watcher:
    """Watch run directory `run_dir`: `poll()` is one pass, `run()` passes every `interval` seconds until
    `stop()`; one Watcher per directory at a time (`close()`, or the end of a `with`, lets the next in).
    `policy`: retention applied after validation (None: delete nothing); `metric`/`mode` rank `export_best` (a
    .safetensors file outside the run) and name the metric each line shows (default: the policy's); `exec_cmd`:
    a shell command run for each good checkpoint, its path in $RESHARD_CHECKPOINT and in place of `{}`;
    `say(text, error)`: where lines go (default: nowhere); `thinner`: what thins a checkpoint the policy keeps at
    the weights tier only (default: reshard.lifecycle.thinning).

    Args:
        run_dir: a run directory, as for list_checkpoints; its state is kept in a file there.
        policy, checksums, export_best, metric, mode, exec_cmd, say: as above; metrics, recent, settle: as for
            list_checkpoints.

    Returns:
        `poll()` returns a Pass: the checkpoints newly judged (`reported`: validated, or kept unread as
        unverifiable or unknown), those still being written, those deleted, the problems.

    Example:
        >>> with reshard.Watcher("ckpt/", settle=0) as watcher:
        ...     done = watcher.poll()
        >>> [(event.name, event.status) for event in done.reported], done.removed
        ([('global_step2', 'complete'), ('global_step3', 'complete')], ())
    """

    def __init__(self, run_dir, policy: Policy | None = None, *, checksums: bool = False,
                 export_best: str | None = None, metric: str | None = None, mode: str | None = None,
                 exec_cmd: str | None = None, metrics: str | None = None, recent: float = RECENT_SECONDS,
                 settle: float = SETTLE_SECONDS, say: Callable[[str, bool], None] | None = None,
                 thinner: Thinner | None = None):
        self._lock = None       # first: close() (and __del__) may run however far __init__ got
        self.root = fs.realpath(str(run_dir))
        if not fs.isdir(self.root):
            raise ReshardError.at(self.root, "not a directory")
        if policy is not None:
            policy.check()
        self.policy = policy
        self.metric = metric or (policy.metric if policy else None)
        self.mode = mode or (policy.mode if policy else "min")
        self.export_best = os.path.abspath(export_best) if export_best else None
        if self.export_best:
            _check_export(self.export_best, self.root, self.metric)
        self.checksums, self.exec_cmd, self.metrics = checksums, exec_cmd, metrics
        self.recent, self.settle = recent, settle
        self.say = say or (lambda text, error: None)
        self.thinner = thinner
        self._lock = watch_state.lock(self.root)
        try:
            self.state = watch_state.load(self.root)
        except ReshardError:
            self.close()
            raise
        self.stopped = threading.Event()
        # (name, fingerprint) whose export failed: not retried every pass
        self._failed_exports: set[tuple[str, tuple]] = set()
        self._said: set[str] = set()    # problem lines already said (a policy error repeats every pass)

    def close(self) -> None:
        """Let another watcher watch the directory (also when this process ends)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    __del__ = close     # a Watcher dropped without close() (`Watcher(d).poll()`) lets go of the lock too

    def stop(self) -> None:
        """End `run()` after the step under way (a signal handler may call it)."""
        self.stopped.set()

    def run(self, interval: float = INTERVAL_SECONDS) -> None:
        while not self.stopped.is_set():
            self.poll()
            self.stopped.wait(interval)

    def poll(self) -> Pass:
        """One pass: report, remember, act on, export and prune what finished since the last."""
        try:
            return self._pass()
        except FileNotFoundError:
            # A checkpoint vanished while it was read (the trainer's own rotation, save_total_limit): what was
            # done is recorded; the next pass lists the run as it is then.
            return Pass()

    def _pass(self) -> Pass:
        recover(self.root)      # a `reshard thin` a kill interrupted: finished or rolled back first
        listing = list_checkpoints(self.root, self.metrics, self.metric, self.recent, self.settle)
        rows = _held_for_pointers(listing)
        reported, waiting, problems = [], [], []
        for row in rows:
            if self.stopped.is_set():
                break       # the rest waits for the next start: nothing of it was recorded
            if row.status == IN_PROGRESS:
                waiting.append(row)
                continue
            seen = self.state.seen.get(row.name)
            if seen is not None and seen.fingerprint == fingerprint(row) and (seen.checksums or not self.checksums):
                if not seen.acted:      # killed during its --exec: run it again, not report it again
                    problems += self._act(row, seen)
                continue
            judged, summed = self._judged(row)
            if judged is None:
                waiting.append(replace(row, status=IN_PROGRESS, why="its files changed while it was validated"))
                continue
            event = Event(row.name, row.path, row.step, judged.status, judged.why, row.bytes, row.metrics, summed)
            self._remember(row.name, judged)
            self.say(event.line(self.root, self.metric), False)
            reported.append(event)
            problems += self._act(row, judged)
        if self.stopped.is_set():
            return Pass(tuple(reported), tuple(waiting), (), None, tuple(problems))
        verdicts = self._verdicts(rows)
        exported, failed = self._export(verdicts)
        removed, thinned, refused = self._prune(listing, verdicts)
        kept = self.state.only({r.name for r in rows} - set(removed))
        if kept != self.state:      # a quiet pass writes nothing: no fsync every few seconds for nothing
            self.state = kept
            watch_state.save(self.root, self.state)
        return Pass(tuple(reported), tuple(waiting), tuple(removed), exported, tuple(problems + failed + refused),
                    tuple(thinned))

    def _judged(self, row: Checkpoint) -> tuple:
        """(the verdict on a finished row, whether digests were verified): the listing's coverage proof, and
        the sums where asked and a manifest is there; (None, False) when its files changed meanwhile (a writer
        still at work: retried)."""
        status, why, summed = row.status, row.why, False
        if status == COMPLETE and self.checksums:
            try:
                catalog = read_catalog(row.path)
                report = validate(catalog, checksums=True)
                summed = report.checksums       # False where there is no manifest (every training save)
                if not report.ok:
                    status, why = INCOMPLETE, problem_line(report)
            except ReshardError as e:
                status, why = INCOMPLETE, str(e)
        if not unchanged(row, self.root):
            return None, False
        acted = not (status == COMPLETE and self.exec_cmd)      # nothing to run on it
        return watch_state.Seen(fingerprint(row), status, why, self.checksums, acted), summed

    def _remember(self, name: str, seen: watch_state.Seen) -> None:
        self.state = self.state.with_seen(name, seen)
        watch_state.save(self.root, self.state)     # at once: a restart does not report it again

    def _act(self, row: Checkpoint, seen: watch_state.Seen) -> list:
        """`exec_cmd` on a good checkpoint; recorded as done once it ran, whatever its exit status."""
        if seen.acted or not self.exec_cmd:
            return []
        env = {**os.environ, EXEC_VARIABLE: row.path, STEP_VARIABLE: "" if row.step is None else str(row.step)}
        command = self.exec_cmd.replace("{}", shlex.quote(row.path))
        code = subprocess.run(command, shell=True, env=env).returncode
        self._remember(row.name, replace(seen, acted=True))
        if code == 0:
            return []
        return [self._problem(f"{row.path}: --exec exited {code}")]

    def _verdicts(self, rows: list) -> list:
        """The rows as the watcher judged them: a row it has not validated (as its files are now) counts as in
        progress, so the policy neither deletes it nor counts it as the newest complete checkpoint."""
        out = []
        for r in rows:
            seen = self.state.seen.get(r.name)
            if r.status == IN_PROGRESS:
                out.append(r)
            elif seen is None or seen.fingerprint != fingerprint(r):
                out.append(replace(r, status=IN_PROGRESS, why="not validated by the watcher yet"))
            else:
                out.append(replace(r, status=seen.status, why=seen.why))
        return out

    def _export(self, verdicts: list) -> tuple:
        """(name exported, problems): into `export_best`, the best validated checkpoint by the metric when it is
        strictly better than the one exported before (remembered, scored, across restarts: retention may have
        deleted that one since, and an export of a worse one would lose the best weights of the run). When the
        file is not the one written (removed, or changed by someone), it is written again from the remembered
        checkpoint, or where that is gone from the best one left, which is said as a problem when it is worse."""
        if not self.export_best:
            return None, []
        metric = self.metric
        assert metric is not None and self.mode is not None     # (checked when built: --export-best needs --metric)
        complete = [r for r in verdicts if r.status == COMPLETE]
        best = ranked(complete, metric, self.mode)
        held = self.state.best
        if not (held and held.scored(self.export_best, metric, self.mode)):
            held = None         # nothing exported yet, or ranked otherwise then: no score to beat
        better = bool(best) and (held is None or held.better(best[0][0]))
        lost = held is not None and watch_state.identity(self.export_best) != held.written
        if not better and not lost:
            return None, []
        pick, note, worse = best[0] if best else None, "", False
        if held is not None and lost:
            was = f"{'changed' if fs.exists(self.export_best) else 'removed'} since {label(held)} " \
                  f"({self.metric} {held.value:g}) was exported to it"
            source = [r for r in complete if (r.name, fingerprint(r)) == (held.name, held.fingerprint)]
            if better:
                note = f"{was}; a better checkpoint is written"
            elif source:
                pick, note = (held.value, source[0]), f"{was}: written again from it"
            elif not best:
                return None, [self._problem(f"{self.export_best}: {was}, which is deleted, and no validated "
                                            f"checkpoint left records {self.metric}: nothing written")]
            else:
                worse = best[0][0] != held.value
                note = f"{was}, which is deleted: the best checkpoint left is written" + \
                    (", a worse one" if worse else "")
        assert pick is not None         # (with no best, a lost export returned above or picked its own source)
        value, row = pick
        key = (row.name, fingerprint(row))
        if key in self._failed_exports:
            return None, []
        try:
            _export_file(row.path, self.export_best)
        except ReshardError as e:
            self._failed_exports.add(key)
            return None, [self._problem(f"--export-best: {e}")]
        self.state = replace(self.state, best=watch_state.Best(
            row.name, fingerprint(row), self.export_best, metric, self.mode, value, row.step,
            watch_state.identity(self.export_best)))
        watch_state.save(self.root, self.state)
        self.say(f"best {self.metric} {value:g}: {label(row)} exported to {self.export_best}", False)
        if worse:       # the best weights of the run are lost: an error, also for `--once`'s exit status
            return row.name, [self._problem(f"{self.export_best}: {note}")]
        if note:
            self.say(f"{self.export_best}: {note}", False)
        return row.name, []

    def _prune(self, listing, verdicts: list) -> tuple:
        """(names removed, names thinned, problems): the policy on the watcher's verdicts, carried out. A thinned
        checkpoint's files are new, so the next pass validates it again, as weights-only."""
        if self.policy is None:
            return [], [], []
        # A series with no validated complete checkpoint yet (a run's first saves still landing) waits: there
        # is nothing for its rules to rank, and decide would call that a policy it cannot evaluate.
        ready = {r.series for r in verdicts if r.status == COMPLETE}
        try:
            decisions = decide([r for r in verdicts if r.series in ready], self.policy)
            thinner = self.thinner or (LibraryThinner() if any(d.action == THIN for d in decisions) else None)
        except ReshardError as e:       # a policy it cannot evaluate, or a build that cannot thin: nothing done
            return [], [], [self._problem(str(e))]
        plan = carry_out(listing, known_refusals(decisions, thinner), yes=True, thinner=thinner)
        removed = set(plan.removed)
        names = []
        for d in plan.deleting():
            r = d.checkpoint
            if r.path in removed:
                names.append(r.name)
                self.say(f"deleted {r.name}{_step(r)}, {human_bytes(r.bytes)}: {self._reasons(d)}", False)
        rows = {d.checkpoint.path: d for d in plan.thinning()}
        thinned = []
        for done in plan.thinned:
            d = rows[done.path]
            thinned.append(d.checkpoint.name)
            self.say(f"thinned {d.checkpoint.name}{_step(d.checkpoint)} to its weights, "
                     f"{human_bytes(done.bytes_before)} → {human_bytes(done.bytes_after)}: {self._reasons(d)}", False)
        problems = [self._problem(f"{within(n.why, self.root)} (left full)") for n in plan.not_thinned]
        return names, thinned, problems

    def _reasons(self, d) -> str:
        return within("; ".join(d.reasons), self.root)

    def _problem(self, text: str) -> str:
        if text not in self._said:
            self._said.add(text)
            self.say(f"reshard: {text}", True)
        return text


def label(row) -> str:
    """How a line names a checkpoint (a row or an Event): by its step, or its name when it carries none."""
    return f"step {row.step}" if row.step is not None else row.name


def _step(row) -> str:
    return f" (step {row.step})" if row.step is not None else ""


def within(text: str, root: str) -> str:
    """`text` with the paths inside the run shown from it: a line names the file, not where the disk is."""
    return text.replace(root + os.sep, "")


def _held_for_pointers(listing) -> list:
    """The listing's rows, each newer than the checkpoint a pointer of its folder names (DeepSpeed's `latest`)
    turned in progress: the pointer moves when the save is done, after the last rank's files."""
    named: dict[str, Any] = {}      # series -> the newest row a pointer names
    for r in listing.checkpoints:
        if r.path in listing.pointers and r.step is not None and r.step > getattr(named.get(r.series), "step", -1):
            named[r.series] = r
    out = []
    for r in listing.checkpoints:
        pointed = named.get(r.series)
        if pointed and r.step is not None and r.step > pointed.step and r.status != IN_PROGRESS:
            why = f"newer than {pointed.name}, {listing.pointers[pointed.path]} (moved when a save is done)"
            r = replace(r, status=IN_PROGRESS, why=why)
        out.append(r)
    return out


def _check_export(out: str, root: str, metric: str | None) -> None:
    if not metric:
        raise UsageError("--export-best needs --metric NAME (the best by what?)")
    if not out.endswith(EXPORT_SUFFIX):
        raise UsageError.at(out, f"--export-best writes one {EXPORT_SUFFIX} file (replaced by a single rename)")
    real = fs.realpath(out)
    if real == root or real.startswith(root + os.sep):
        raise UsageError.at(out, f"--export-best must be outside the watched directory {root}")


def _export_file(source: str, out: str) -> None:
    """The checkpoint at `source` exported to `out`: written beside it (`.OUT.reshard-tmp`) and renamed over
    it, so a reader of `out` sees the old best or the new, whole."""
    from reshard.commands.export import export_plan
    from reshard.commands.validate import prove_complete
    from reshard.execution.executor import execute
    made = export_plan(prove_complete(read_catalog(source)), out)
    execute(made.plan, out, overwrite=True, progress=False, single_file=made.single_file)
