"""Tiered retention (issue 39, deliverable 4): every keep rule at a tier, full or weights, `--keep-interval`, THIN.

Pure: reshard.lifecycle.retention.decide on synthetic rows (sizes and kinds, no files), each rule with its negative
control; the worked example of docs/lifecycle.md (a 175B run's 100 saves) computed by the planner. Execution: carry_out
with a thinner double (ThinnerDouble) for ordering and bookkeeping only — what is thinned, in which order, after the
deletions, a failing thin left full while the rest go on; the real reshard.lifecycle.thinning is wired and proven end to
end where it lands. On a real run: the dry run's lines and JSON, bad values in one line (exit 2), a build without
reshard.lifecycle.thinning refusing `--yes` before it changes anything, and watch thinning as saves land (the double
again).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import reshard
from reshard.errors import ReshardError, UsageError
from reshard.lifecycle.listing import COMPLETE, INCOMPLETE, UNVERIFIABLE, Checkpoint, RunListing, measure
from reshard.lifecycle.pruning import PrunePlan, carry_out
from reshard.lifecycle.retention import (
    DELETE,
    FULL,
    KEEP,
    THIN,
    WEIGHTS,
    Policy,
    decide,
    duration_text,
    parse_duration,
)
from reshard.lifecycle.sizes import BytesByKind
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.repo import REPO

HOUR, DAY = 3600.0, 86400.0
KINDS = BytesByKind(20, 70, 10)


def row(step: int, *, mtime: float | None = None, kinds: BytesByKind | None = KINDS,
        status: str = COMPLETE, pinned: tuple = (), weights_only: bool = False, folder: str = "/run/ds") -> Checkpoint:
    """A listing row with sizes and kinds, no files: 100 bytes, 20 of weights, 70 of optimizer, 10 other."""
    total = kinds.total if kinds is not None else 100
    return Checkpoint(f"{folder}/global_step{step}", f"{os.path.basename(folder)}/global_step{step}", step,
                      float(step) if mtime is None else mtime, total, total, 3, "deepspeed", "dp=2,zero=2", status,
                      "" if status == COMPLETE else "why", pinned, bytes_by_kind=kinds if status == COMPLETE else None,
                      weights_only=weights_only)


def plan_of(rows: list, policy: Policy) -> dict:
    """{step: (action, tier)}."""
    return {d.checkpoint.step: (d.action, d.tier) for d in decide(rows, policy)}


# --- the rules at their tiers (pure) ---

def test_a_checkpoint_kept_only_at_the_weights_tier_is_thinned_and_the_richest_tier_wins():
    rows = [row(s) for s in range(1, 11)]
    plan = plan_of(rows, Policy(keep_last=2, keep_every=3, keep_every_tier=WEIGHTS))
    assert plan[3] == plan[6] == (THIN, WEIGHTS)
    assert plan[9] == plan[10] == (KEEP, FULL)      # 9: every 3 (weights) and last 2 (full): the richest, full
    assert [s for s, (action, _) in plan.items() if action == DELETE] == [1, 2, 4, 5, 7, 8]
    # negative control: the same rule at the default tier keeps them full, thins nothing
    full = plan_of(rows, Policy(keep_last=2, keep_every=3))
    assert full[3] == full[6] == (KEEP, FULL) and not [s for s, (a, _) in full.items() if a == THIN]


@pytest.mark.parametrize("rule", ["keep_last", "keep_best", "keep_every", "keep_steps", "keep_interval"])
def test_every_rule_takes_a_tier(rule):
    values = {"keep_last": 3, "keep_best": 1, "keep_every": 4, "keep_steps": (4,), "keep_interval": 3.0}
    rows = [replace(row(s), metrics={"eval_loss": 9.0 - s if s != 4 else 0.5}) for s in range(1, 7)]
    extra = {"metric": "eval_loss"} if rule == "keep_best" else {}
    weights = plan_of(rows, Policy(**{rule: values[rule], f"{rule}_tier": WEIGHTS}, **extra))
    full = plan_of(rows, Policy(**{rule: values[rule]}, **extra))
    assert weights[4] == (THIN, WEIGHTS) and full[4] == (KEEP, FULL)
    assert weights[6] == full[6] == (KEEP, FULL)        # the newest: full whatever the tier
    assert weights[2] == full[2] == (DELETE, None)      # kept by no rule (keep_interval: steps 1 and 4)


def test_a_weights_tier_rule_never_thins_the_newest_nor_a_pinned_one():
    rows = [row(1), row(2, pinned=("named by ds/latest",)), row(3)]
    plan = plan_of(rows, Policy(keep_last=3, keep_last_tier=WEIGHTS))
    assert plan == {1: (THIN, WEIGHTS), 2: (KEEP, FULL), 3: (KEEP, FULL)}
    decisions = {d.checkpoint.step: d for d in decide(rows, Policy(keep_last=3, keep_last_tier=WEIGHTS))}
    assert "newest complete checkpoint" in decisions[3].reasons
    assert "among the last 3 complete (weights)" in decisions[3].reasons


def test_keep_interval_keeps_one_per_duration_of_save_time():
    """Orbax's EveryNSeconds: oldest first by save time, the first, then each at least DURATION after the last
    kept. Negative control: one saved a second short of the interval is deleted; the next, at it, is kept."""
    times = {1: 0.0, 2: HOUR - 1, 3: HOUR, 4: 2 * HOUR - 1, 5: 2 * HOUR + 30, 6: 2 * HOUR + 60}
    rows = [row(s, mtime=t) for s, t in times.items()]
    plan = plan_of(rows, Policy(keep_interval=HOUR))
    assert {s for s, (a, _) in plan.items() if a == KEEP} == {1, 3, 5, 6}     # 6: the newest
    assert plan[2] == plan[4] == (DELETE, None)
    # by save time, not step: a step saved out of order is walked where its time puts it
    shuffled = [row(1, mtime=0.0), row(2, mtime=2 * HOUR), row(3, mtime=HOUR), row(4, mtime=3 * HOUR)]
    assert plan_of(shuffled, Policy(keep_interval=HOUR, keep_interval_tier=WEIGHTS)) == \
        {1: (THIN, WEIGHTS), 2: (THIN, WEIGHTS), 3: (THIN, WEIGHTS), 4: (KEEP, FULL)}
    reasons = decide(rows, Policy(keep_interval=HOUR))[2].reasons
    assert reasons == ("one per 1h of save time",)


def test_keep_interval_counts_only_complete_checkpoints():
    """An incomplete save does not start an interval: the next complete one is kept by the rule."""
    rows = [row(1, mtime=0.0), row(2, mtime=HOUR, status=INCOMPLETE), row(3, mtime=HOUR + 10), row(4, mtime=HOUR + 20)]
    plan = plan_of(rows, Policy(keep_interval=HOUR, delete_incomplete=True))
    assert plan[3] == (KEEP, FULL) and plan[2] == (DELETE, None)


def test_a_weights_only_checkpoint_is_never_thinned_twice_nor_made_full():
    rows = [row(1, weights_only=True, kinds=BytesByKind(20, 0, 10)), row(2, weights_only=True), row(3),
            row(4, weights_only=True), row(5)]
    decisions = {d.checkpoint.step: d for d in decide(rows, Policy(keep_steps=(1,), keep_steps_tier=WEIGHTS,
                                                                   keep_every=2))}
    assert (decisions[1].action, decisions[1].tier) == (KEEP, WEIGHTS)     # already weights-only: kept, not thinned
    assert (decisions[2].action, decisions[2].tier) == (KEEP, WEIGHTS)     # a full rule: never "upgraded"
    assert "already weights-only" in decisions[2].reasons and decisions[2].bytes_after == decisions[2].bytes_before
    assert (decisions[4].action, decisions[4].tier) == (KEEP, WEIGHTS)
    assert decisions[3].action == DELETE and decisions[5].action == KEEP
    # negative control: a weights-only one kept by no rule is deleted like any complete checkpoint
    assert plan_of(rows, Policy(keep_last=1))[1] == (DELETE, None)


def test_a_thin_is_planned_only_where_the_kinds_are_known():
    rows = [row(1, kinds=None), row(2), row(3)]
    decisions = decide(rows, Policy(keep_last=3, keep_last_tier=WEIGHTS))
    assert (decisions[0].action, decisions[0].tier) == (KEEP, FULL)
    assert decisions[0].reasons[-1] == "kept full: its bytes by kind are unknown, so no thin is planned"
    assert (decisions[1].action, decisions[1].bytes_after, decisions[1].estimate) == (THIN, 30, True)  # 20 + 10


def test_only_complete_checkpoints_are_thinned():
    rows = [row(2, status=INCOMPLETE), row(4, status=UNVERIFIABLE), row(6), row(8)]
    plan = plan_of(rows, Policy(keep_every=2, keep_every_tier=WEIGHTS))
    assert plan == {2: (KEEP, None), 4: (KEEP, None), 6: (THIN, WEIGHTS), 8: (KEEP, FULL)}


def test_bad_tiers_and_intervals_are_refused_in_one_line():
    for policy, words in ((Policy(keep_last=1, keep_last_tier="gold"), "--keep-last's tier is full or weights"),
                          (Policy(keep_interval=0.0), "--keep-interval must be more than 0 s"),
                          (Policy(keep_interval=-5.0), "--keep-interval must be more than 0 s")):
        with pytest.raises(UsageError, match=words):
            decide([row(1)], policy)
    assert [parse_duration(t) for t in ("30m", "6h", "2d", "1w", "90s", "1.5h")] == \
        [1800, 6 * HOUR, 2 * DAY, 7 * DAY, 90, 5400]
    for bad in ("", "6", "h", "6x", "-1h", "0d", "nand", "infd"):
        with pytest.raises(UsageError, match="not a duration"):
            parse_duration(bad)
    assert [duration_text(s) for s in (DAY, 6 * HOUR, 90.0, 5400.0)] == ["1d", "6h", "90s", "90m"]


@st.composite
def tiered(draw):
    steps = sorted(draw(st.sets(st.integers(1, 40), min_size=1, max_size=12)))
    rows = [row(s, mtime=float(draw(st.integers(0, 100))) * 600, status=draw(st.sampled_from([COMPLETE] * 4 + [
        INCOMPLETE, UNVERIFIABLE])), weights_only=draw(st.booleans()), kinds=draw(st.sampled_from(
            [BytesByKind(20, 70, 10), None]))) for s in steps]
    tiers = st.sampled_from([FULL, WEIGHTS])
    policy = Policy(keep_last=draw(st.none() | st.integers(1, 4)), keep_last_tier=draw(tiers),
                    keep_every=draw(st.none() | st.integers(1, 6)), keep_every_tier=draw(tiers),
                    keep_steps=tuple(draw(st.sets(st.integers(1, 40), max_size=3))), keep_steps_tier=draw(tiers),
                    keep_interval=draw(st.none() | st.sampled_from([600.0, HOUR, 5 * HOUR])),
                    keep_interval_tier=draw(tiers))
    return rows, policy if policy.keeps_by_rule() else Policy(keep_last=1, keep_last_tier=WEIGHTS)


@settings(max_examples=300, deadline=None)
@given(tiered())
def test_tiers_keep_the_invariants(case):
    """Over random rows and tiered policies: only a complete, not weights-only row with known kinds is thinned;
    the newest complete one is never thinned; what is kept or thinned is what decide kept without tiers."""
    rows, policy = case
    decisions = decide(rows, policy)
    untiered = decide(rows, replace(policy, keep_last_tier=FULL, keep_every_tier=FULL, keep_steps_tier=FULL,
                                    keep_interval_tier=FULL))
    complete = [r for r in sorted(rows, key=lambda r: r.step) if r.status == COMPLETE]
    for d, plain in zip(decisions, untiered, strict=True):
        r = d.checkpoint
        assert (d.action == DELETE) == (plain.action == DELETE)     # tiers change what is kept, not whether
        if d.action == THIN:
            assert r.status == COMPLETE and not r.weights_only and r.bytes_by_kind is not None
            assert r is not complete[-1] and d.bytes_after < d.bytes_before
        if r.weights_only and r.status == COMPLETE and d.action != DELETE:
            assert (d.action, d.tier) == (KEEP, WEIGHTS)
        if complete and r is complete[-1]:
            assert d.action == KEEP and d.tier == (WEIGHTS if r.weights_only else FULL)


# --- the worked example of docs/lifecycle.md: a 175B run, 100 saves (pure, no files) ---

PARAMS = 175 * 10 ** 9
WEIGHTS_BYTES = 2 * PARAMS          # bf16: 350 GB
OPTIMIZER_BYTES = 12 * PARAMS       # fp32 master + Adam's two moments, 4 bytes each: 2.1 TB
OTHER_BYTES = 10 ** 9               # RNG, scheduler, config, headers: 1 GB (stated, not measured)
EXAMPLE = "--keep-last 3 --keep-every 10000:weights --keep-interval 1d:weights"


def test_the_worked_example_is_what_the_planner_computes():
    """100 saves, one every 6 h at steps 1000..100000; each 2.451 TB (350 GB of bf16 weights, 2.1 TB of fp32
    master and Adam state, 1 GB other). The numbers asserted here are the doc's, and the doc must say them."""
    kinds = BytesByKind(WEIGHTS_BYTES, OPTIMIZER_BYTES, OTHER_BYTES)
    rows = [row(1000 * k, mtime=(k - 1) * 6 * HOUR, kinds=kinds) for k in range(1, 101)]
    policy = Policy(keep_last=3, keep_every=10000, keep_every_tier=WEIGHTS, keep_interval=DAY,
                    keep_interval_tier=WEIGHTS)
    plan = PrunePlan("/run", decide(rows, policy), [])
    actions = {d.checkpoint.step // 1000: d.action for d in plan.decisions}
    full = [k for k, a in actions.items() if a == KEEP]
    thinned = [k for k, a in actions.items() if a == THIN]
    assert full == [98, 99, 100]
    assert thinned == sorted({k for k in range(1, 98) if k % 10 == 0 or (k - 1) % 4 == 0})
    assert (len(full), len(thinned), len(plan.deleting())) == (3, 34, 63)
    data = plan.to_dict(price=0.023)
    assert data["bytes_before"] == 245_100 * 10 ** 9                # 100 × 2.451 TB
    assert data["bytes_after"] == 19_287 * 10 ** 9                  # 3 × 2.451 TB + 34 × 351 GB
    assert data["bytes_freed"] == 225_813 * 10 ** 9
    cost = data["cost_per_month"]
    assert (round(cost["before"], 2), round(cost["after"], 2)) == (5637.30, 443.60)
    doc = (REPO / "docs" / "lifecycle.md").read_text()
    for said in (EXAMPLE, "2.451 TB", "245.1 TB", "19.287 TB", "$5,637.30", "$443.60", "98, 99 and 100",
                 "34 as weights", "63 deleted"):
        assert said in doc, said
    # negative control: the same rules all at the full tier keep 37 whole saves, at 37 × 2.451 TB
    untiered = PrunePlan("/run", decide(rows, replace(policy, keep_every_tier=FULL, keep_interval_tier=FULL)), [])
    assert not untiered.thinning() and untiered.bytes_after == 37 * kinds.total
    assert "90.687 TB" in doc and "$2,085.80" in doc


# --- carrying it out: a thinner double, for ordering and bookkeeping only ---

@dataclass(frozen=True)
class Outcome:
    bytes_before: int
    bytes_after: int
    executed: bool = True


class ThinnerDouble:
    """Records the paths it is asked to thin, and what was gone at each call; fails (ReshardError) on `fail`,
    says "not carried out" on `skip`, has no weights-only form of `refuse` (its catalog would say so). It changes
    no file: what a thin does to files is reshard.lifecycle.thinning's."""

    def __init__(self, watch=(), fail=(), skip=(), refuse=()):
        self.calls, self.gone_at_call = [], []
        self.watch, self.fail, self.skip, self.refuse = list(watch), set(fail), set(skip), set(refuse)

    def refusal(self, path: str) -> str | None:
        return "no weights-only form: test double" if path in self.refuse else None

    def thin(self, path: str) -> Outcome:
        self.calls.append(path)
        self.gone_at_call.append([p for p in self.watch if not os.path.exists(p)])
        if path in self.fail:
            raise ReshardError.at(path, "cannot be thinned: test double")
        return Outcome(100, 30, path not in self.skip)


def files_run(root: Path, steps) -> RunListing:
    """A run of plain folders whose rows (sizes, times) are measured as `list` measures them."""
    rows = []
    for i, step in enumerate(steps):
        folder = root / "ds" / f"global_step{step}"
        folder.mkdir(parents=True)
        (folder / "model.bin").write_bytes(b"x" * 100)
        os.utime(folder / "model.bin", (1000.0 + i, 1000.0 + i))
        os.utime(folder, (1000.0 + i, 1000.0 + i))
        f = measure(str(folder), str(root))
        rows.append(Checkpoint(str(folder), f"ds/global_step{step}", step, f.mtime, f.bytes, f.disk_bytes, f.count,
                               "deepspeed", "dp=1", COMPLETE, bytes_by_kind=BytesByKind(30, 60, 10)))
    return RunListing(str(root), rows, [], [])


def test_deletions_come_first_then_thins_oldest_first(tmp_path):
    listing = files_run(tmp_path, range(1, 8))
    decisions = decide(listing.checkpoints, Policy(keep_last=1, keep_every=2, keep_every_tier=WEIGHTS))
    deleted = [d.checkpoint.path for d in decisions if d.action == DELETE]
    double = ThinnerDouble(watch=deleted)
    plan = carry_out(listing, decisions, yes=True, thinner=double)
    steps = [int(p.rsplit("step", 1)[1]) for p in double.calls]
    assert steps == [2, 4, 6]           # oldest first, never 7 (the newest)
    assert double.gone_at_call[0] == deleted        # the deletions freed their space before the first thin
    assert sorted(plan.removed) == sorted(deleted) and [t.path for t in plan.thinned] == double.calls
    assert (plan.bytes_before, plan.bytes_after, plan.bytes_freed) == (700, 100 + 3 * 30, 510)
    # negative control: the dry run asks the thinner nothing and deletes nothing
    dry, listing = ThinnerDouble(), files_run(tmp_path / "dry", range(1, 8))
    carry_out(listing, decide(listing.checkpoints, Policy(keep_last=1, keep_every=2, keep_every_tier=WEIGHTS)),
              yes=False, thinner=dry)
    assert dry.calls == [] and len(os.listdir(tmp_path / "dry" / "ds")) == 7


def test_a_failing_thin_leaves_its_checkpoint_full_and_the_rest_go_on(tmp_path):
    listing = files_run(tmp_path, range(1, 6))
    paths = [r.path for r in listing.checkpoints]
    double = ThinnerDouble(fail={paths[0]}, skip={paths[2]})
    plan = carry_out(listing, decide(listing.checkpoints, Policy(keep_last=5, keep_last_tier=WEIGHTS)), yes=True,
                     thinner=double)
    assert double.calls == paths[:4]                    # 1 failed, 2 went on; 5 (the newest) never asked
    assert [t.path for t in plan.thinned] == [paths[1], paths[3]]
    assert [(n.path, n.why) for n in plan.not_thinned] == [
        (paths[0], f"{paths[0]}: cannot be thinned: test double"),
        (paths[2], f"{paths[2]}: the thin was not carried out; left full")]
    assert plan.removed == [] and all(os.path.isdir(p) for p in paths)     # never deleted instead
    by_path = {d.checkpoint.path: plan.after(d) for d in plan.decisions}
    assert by_path[paths[0]] == by_path[paths[2]] == 100 and by_path[paths[1]] == 30


def test_a_checkpoint_changed_since_the_listing_is_not_thinned(tmp_path):
    listing = files_run(tmp_path, range(1, 4))
    (Path(listing.checkpoints[0].path) / "model.bin").write_bytes(b"y" * 150)      # a save reusing its name
    double = ThinnerDouble()
    plan = carry_out(listing, decide(listing.checkpoints, Policy(keep_last=3, keep_last_tier=WEIGHTS)), yes=True,
                     thinner=double)
    assert double.calls == [listing.checkpoints[1].path] and plan.changed == [listing.checkpoints[0].path]


def test_prune_with_tiers_thins_with_the_real_thinner(tmp_path):
    """`prune --keep-last 1 --keep-steps 1:weights` on a DeepSpeed save dir of three steps, with
    reshard.lifecycle.thinning itself: step 3 (the newest, named by latest) stays full, step 1 is thinned to its
    module files (weights-only,
    complete, its export the full one's bit for bit; the engine's module-only load of that form:
    tests/commands/test_thin.py), step 2 is deleted; on a ZeRO-3 save the same, step 1 thinned to its fp32 partitions.
    The control: the same rules
    at the full tier keep step 1 whole."""
    save = lr.ds_run(tmp_path, "z1_bf16_dp2")
    rules = ["--keep-last", "1", "--keep-steps", "1:weights"]
    planned = json.loads(run_cli("prune", save, *rules, "--json", check=0).stdout)
    actions = {d["name"]: d["action"] for d in planned["decisions"]}
    assert actions == {"global_step1": "thin", "global_step2": "delete", "global_step3": "keep"}, actions
    run_cli("export", save / "global_step3", tmp_path / "full.safetensors", check=0)
    run_cli("prune", save, *rules, "--yes", "--quiet", check=0)
    assert sorted(n for n in os.listdir(save) if n.startswith("global_step")) == ["global_step1", "global_step3"]
    rows = {r["name"]: r for r in json.loads(run_cli("list", save, "--json", check=0).stdout)["checkpoints"]}
    assert rows["global_step1"]["status"] == "complete" and rows["global_step1"]["weights_only"]
    assert not rows["global_step3"]["weights_only"]
    assert sorted(os.listdir(save / "global_step1")) == ["mp_rank_00_model_states.pt", "reshard-thinned.json"]
    run_cli("export", save / "global_step1", tmp_path / "thin.safetensors", check=0)
    assert (tmp_path / "thin.safetensors").read_bytes() == (tmp_path / "full.safetensors").read_bytes()
    # the control: the same rules at the full tier keep step 1 whole
    (tmp_path / "again").mkdir()
    again = lr.ds_run(tmp_path / "again", "z1_bf16_dp2")
    run_cli("prune", again, "--keep-last", "1", "--keep-steps", "1", "--yes", "--quiet", check=0)
    assert "reshard-thinned.json" not in os.listdir(again / "global_step1")
    # ZeRO-3: step 1 thinned to its fp32 partitions (the engine's module-only load of it: tests/commands/test_thin.py)
    (tmp_path / "z3").mkdir()
    zero3 = lr.ds_run(tmp_path / "z3", "z3_bf16_dp2")
    run_cli("export", zero3 / "global_step3", tmp_path / "z3-full.safetensors", check=0)
    run_cli("prune", zero3, *rules, "--yes", "--quiet", check=0)
    assert sorted(n for n in os.listdir(zero3) if n.startswith("global_step")) == ["global_step1", "global_step3"]
    record = json.loads((zero3 / "global_step1" / "reshard-thinned.json").read_text())
    assert record["bytes_after"] < record["bytes_before"]
    run_cli("export", zero3 / "global_step1", tmp_path / "z3-thin.safetensors", check=0)
    assert (tmp_path / "z3-thin.safetensors").read_bytes() == (tmp_path / "z3-full.safetensors").read_bytes()


def test_the_plan_says_ahead_which_thins_its_format_refuses(tmp_path):
    """A checkpoint kept at the weights tier whose format has no weights-only form reshard writes (a ZeRO-3
    mixture of experts) is kept full in the dry run already, the reason said; --yes leaves it full and exits 0.
    The control: a ZeRO-3 save without experts is planned as a thin."""
    rules = ["--keep-last", "1", "--keep-steps", "1:weights"]
    moe = lr.ds_run(tmp_path, "autoep2_z3_fp32_dp2")
    planned = {d["name"]: d for d in json.loads(run_cli("prune", moe, *rules, "--json", check=0).stdout)["decisions"]}
    step1 = planned["global_step1"]
    assert (step1["action"], step1["tier"]) == ("keep", "full") and step1["bytes_after"] == step1["bytes"]
    assert any(r.startswith("kept full, not thinned: a ZeRO-3 mixture-of-experts save") for r in step1["reasons"])
    done = run_cli("prune", moe, *rules, "--yes", check=0)
    assert "kept full, not thinned" in done.stdout and done.stderr == ""
    assert "reshard-thinned.json" not in os.listdir(moe / "global_step1")
    (tmp_path / "z3").mkdir()
    zero3 = lr.ds_run(tmp_path / "z3", "z3_bf16_dp2")
    planned = json.loads(run_cli("prune", zero3, *rules, "--json", check=0).stdout)["decisions"]
    assert [d["action"] for d in planned] == ["thin", "delete", "keep"]


def test_a_thin_refused_ahead_is_never_asked_for(run):
    """With the double: the checkpoint it has no form of is kept full in the plan and never handed to it."""
    step2 = str(run / "ds" / "global_step2")
    policy = Policy(keep_last=1, keep_every=2, keep_every_tier=WEIGHTS)
    dry = reshard.prune(run, policy, thinner=ThinnerDouble(refuse={step2}))
    by_name = {os.path.basename(d.checkpoint.path): d for d in dry.decisions}
    assert (by_name["global_step2"].action, by_name["global_step2"].tier) == (KEEP, FULL)
    assert by_name["global_step6"].action == THIN
    double = ThinnerDouble(refuse={step2})
    plan = reshard.prune(run, policy, yes=True, thinner=double)
    assert [os.path.basename(p) for p in double.calls] == ["global_step6"] and plan.not_thinned == []


# --- on a real run: lifecycle_runs.deepspeed_run (1-3, 6-8 whole, 4 and 5 broken, latest names 8) ---

@pytest.fixture
def run(lifecycle_copy):
    return lifecycle_copy


def test_the_dry_run_prints_keep_thin_delete_with_bytes_and_cost(run):
    before = lr.snapshot(run)
    out = run_cli("prune", run, "--keep-last", "1", "--keep-every", "2:weights", "--price", "0.023", check=0).stdout
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith(("keep", "thin", "delete"))}
    assert [n for n, line in lines.items() if line.startswith("thin")] == ["ds/global_step2", "ds/global_step6"]
    assert [n for n, line in lines.items() if line.startswith("delete")] == \
        ["ds/global_step1", "ds/global_step3", "ds/global_step7"]
    assert " weights " in lines["ds/global_step2"] and "(estimate)" in lines["ds/global_step2"]
    assert "step a multiple of 2 (weights)" in lines["ds/global_step2"]
    assert " full " in lines["ds/global_step8"] and "step a multiple of 2 (weights)" in lines["ds/global_step8"]
    assert "dry run: would delete 3 checkpoints, thin 2 to their weights" in out
    assert "cost: <$0.01 a month before, <$0.01 after (at $0.023 per GB (10^9 bytes) and month)" in out
    data = json.loads(run_cli("prune", run, "--keep-last", "1", "--keep-every", "2:weights", "--price", "0.023",
                              "--json", check=0).stdout)
    listed = {c["name"]: c for c in json.loads(run_cli("list", run, "--json", check=1).stdout)["checkpoints"]}
    for d in data["decisions"]:
        kinds = listed[d["name"]]["bytes_by_kind"]
        expected = {"thin": kinds and kinds["weights"] + kinds["other"], "delete": 0}.get(d["action"], d["bytes"])
        assert d["bytes_after"] == expected and d["estimate"] == (d["action"] == "thin")
    assert data["bytes_before"] - data["bytes_after"] == data["bytes_freed"] > 0
    assert data["cost_per_month"]["after"] == pytest.approx(data["bytes_after"] / 1e9 * 0.023)
    assert lr.snapshot(run) == before


@pytest.mark.parametrize("args", [("--keep-last", "3:gold"), ("--keep-every", "10:"), ("--keep-interval", "5x"),
                                  ("--keep-interval", "0d"), ("--keep-steps", "1,x:weights"),
                                  ("--keep-best", "0:weights")])
def test_bad_values_are_one_line_exit_2(run, args):
    for command in ("prune", "watch"):
        err = run_cli(command, run, *args, check=2).stderr
        assert len(err.strip().splitlines()) == 1 and args[0] in err, err


def test_prune_yes_thins_what_the_plan_thins(run):
    """With the double: the CLI's path through reshard.prune(thinner=...) is the API's; deletions done, thins
    asked for in order, the newest and latest's never."""
    double = ThinnerDouble()
    plan = reshard.prune(run, Policy(keep_last=1, keep_every=2, keep_every_tier=WEIGHTS), yes=True, thinner=double)
    assert [os.path.basename(p) for p in double.calls] == ["global_step2", "global_step6"]
    assert sorted(os.path.basename(p) for p in plan.removed) == ["global_step1", "global_step3", "global_step7"]
    assert sorted(p.name for p in (run / "ds").iterdir() if p.is_dir()) == \
        ["global_step2", "global_step4", "global_step5", "global_step6", "global_step8"]


def test_watch_thins_as_saves_land(run):
    double = ThinnerDouble()
    said = []
    with reshard.Watcher(run, Policy(keep_last=1, keep_every=2, keep_every_tier=WEIGHTS), settle=0, thinner=double,
                         say=lambda text, error: said.append(text)) as watcher:
        done = watcher.poll()
    assert sorted(done.thinned) == ["ds/global_step2", "ds/global_step6"]
    assert sorted(done.removed) == ["ds/global_step1", "ds/global_step3", "ds/global_step7"]
    assert [os.path.basename(p) for p in double.calls] == ["global_step2", "global_step6"]
    assert any(line.startswith("thinned ds/global_step2 (step 2) to its weights") for line in said), said
    # the double changed no file, so the next pass plans the same thins: one fails, a problem line, kept full
    step2 = str(run / "ds" / "global_step2")
    failing = ThinnerDouble(fail={step2})
    with reshard.Watcher(run, Policy(keep_last=1, keep_every=2, keep_every_tier=WEIGHTS), settle=0,
                         thinner=failing) as watcher:
        again = watcher.poll()
    assert again.thinned == ("ds/global_step6",) and again.removed == ()
    assert again.problems == ("ds/global_step2: cannot be thinned: test double (left full)",) and os.path.isdir(step2)
