"""The retention invariants over random histories (hypothesis), and SIGKILL during `prune --yes`.

Pure: random rows (steps, completeness, saves in progress, metrics, what `latest` names) and random policies
through reshard.lifecycle.retention.decide, against an oracle written from the issue's rules. On disk: random run dirs
of real checkpoint copies (some broken, one in progress) pruned by random policies. Faults: `prune --yes` killed at
random renames/unlinks/rmdirs (tests/scripts/fault_driver.py, from outside): every kept checkpoint is intact and a rerun
completes the prune.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import reshard
from reshard.lifecycle.listing import COMPLETE, IN_PROGRESS, INCOMPLETE, UNKNOWN, UNVERIFIABLE, Checkpoint
from reshard.lifecycle.retention import DELETE, KEEP, UNTOUCHED, Policy, PolicyError, decide
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.repo import REPO, SCRIPTS

DRIVER = str(SCRIPTS / "fault_driver.py")


@st.composite
def histories(draw):
    steps = sorted(draw(st.sets(st.integers(1, 60), min_size=1, max_size=14)))
    latest = draw(st.none() | st.sampled_from(steps))
    rows = []
    for step in steps:
        status = draw(st.sampled_from([COMPLETE, COMPLETE, COMPLETE, INCOMPLETE, IN_PROGRESS, UNVERIFIABLE,
                                       UNKNOWN]))
        metric = draw(st.none() | st.floats(0, 10, allow_nan=False))
        rows.append(Checkpoint(f"/run/ds/global_step{step}", f"ds/global_step{step}", step, float(step), 100, 100, 3,
                               "deepspeed", "dp=2,zero=2", status, "" if status == COMPLETE else "why",
                               ("named by ds/latest",) if step == latest else (),
                               {} if metric is None else {"eval_loss": metric}))
    return rows


@st.composite
def policies(draw):
    best = draw(st.none() | st.integers(1, 4))
    policy = Policy(keep_last=draw(st.none() | st.integers(1, 5)), keep_best=best, metric="eval_loss" if best else None,
                    mode=draw(st.sampled_from(["min", "max"])), keep_every=draw(st.none() | st.integers(1, 10)),
                    keep_steps=tuple(draw(st.sets(st.integers(1, 60), max_size=3))),
                    delete_incomplete=draw(st.booleans()))
    return policy if policy.keeps_by_rule() or policy.delete_incomplete else Policy(keep_last=1)


def oracle(rows, policy):
    """{step: kept?} for complete and incomplete rows, straight from the rules; None: cannot be evaluated."""
    complete = [r for r in rows if r.status == COMPLETE]
    keep = set()
    if complete:
        keep.add(complete[-1].step)
    keep |= {r.step for r in rows if r.pinned}
    if policy.keep_last:
        keep |= {r.step for r in complete[-policy.keep_last:]}
    if policy.keep_every:
        keep |= {r.step for r in complete if r.step % policy.keep_every == 0}
    keep |= {r.step for r in complete if r.step in policy.keep_steps}
    if not policy.keeps_by_rule():
        keep |= {r.step for r in complete}
    if policy.keep_best:
        scored = [r for r in complete if "eval_loss" in r.metrics]
        if not scored:
            return None
        sign = 1 if policy.mode == "min" else -1
        ranked = sorted(scored, key=lambda r: (sign * r.metrics["eval_loss"], -r.step))
        keep |= {r.step for r in ranked[:policy.keep_best]}
        if any("eval_loss" not in r.metrics and r.step not in keep for r in complete):
            return None
    return {r.step: r.step in keep or (r.status == INCOMPLETE and not policy.delete_incomplete)
            or r.status in (UNVERIFIABLE, UNKNOWN) for r in rows if r.status != IN_PROGRESS}


@settings(max_examples=400, deadline=None)
@given(histories(), policies())
def test_decisions_keep_the_invariants(rows, policy):
    expected = oracle(rows, policy)
    if expected is None:
        with pytest.raises(PolicyError):
            decide(rows, policy)
        return
    decisions = {d.checkpoint.step: d for d in decide(rows, policy)}
    assert sorted(decisions) == [r.step for r in rows]
    complete = [r for r in rows if r.status == COMPLETE]
    for r in rows:
        d = decisions[r.step]
        if r.status == IN_PROGRESS:
            assert d.action == UNTOUCHED            # a save in progress is never touched
            continue
        assert (d.action == KEEP) == expected[r.step], (r, d)
        if r.pinned or (complete and r is complete[-1]):
            assert d.action == KEEP                 # latest's and the newest complete one
        if r.status == INCOMPLETE and d.action == DELETE:
            assert policy.delete_incomplete
        if r.status in (UNVERIFIABLE, UNKNOWN):    # not proven complete nor a whole unit proven broken: kept
            assert d.action == KEEP and r.why in d.reasons
    if policy.keep_last:    # incomplete ones never count toward K: the K newest complete all stay
        assert all(decisions[r.step].action == KEEP for r in complete[-policy.keep_last:])


@pytest.fixture(scope="module")
def template(lifecycle_template):
    """lifecycle_runs.deepspeed_run, built once for the session (tests/conftest.py); only copied here."""
    return lifecycle_template


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_runs_on_disk_keep_what_the_policy_keeps(template, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("random")
    ds = root / "ds"
    ds.mkdir()
    chosen = sorted(data.draw(st.sets(st.integers(1, 12), min_size=1, max_size=8)))
    kinds = {}
    for step in chosen:
        kind = data.draw(st.sampled_from(["whole", "whole", "broken", "fresh"]))
        source = "global_step4" if kind == "broken" else "global_step8"       # rank 0's files only / whole
        shutil.copytree(template / "ds" / source, ds / f"global_step{step}")
        kinds[step] = kind
    latest = data.draw(st.sampled_from(chosen))
    (ds / "latest").write_text(f"global_step{latest}")
    lr.age(root)
    for step, kind in kinds.items():
        if kind == "fresh":
            lr.age(ds / f"global_step{step}", 0)      # still being written
    policy = data.draw(policies().filter(lambda p: not p.keep_best))
    snapshots = {s: lr.snapshot(ds / f"global_step{s}") for s in chosen}
    plan = reshard.prune(root, policy, yes=True)
    left = sorted(int(p.name[len("global_step"):]) for p in ds.iterdir() if p.is_dir())
    assert left == sorted(d.checkpoint.step for d in plan.decisions if d.action != DELETE)
    complete = [s for s in chosen if kinds[s] == "whole"]
    assert latest in left and (not complete or max(complete) in left)
    assert all(s in left for s in chosen if kinds[s] == "fresh")
    assert all(s in left for s in chosen if kinds[s] == "broken") or policy.delete_incomplete
    assert all(lr.snapshot(ds / f"global_step{s}") == snapshots[s] for s in left)
    validated = run_cli("validate", ds)
    assert validated.returncode == 0 or latest not in complete, validated.stdout + validated.stderr


def test_sigkill_at_random_points_of_prune_yes_keeps_every_kept_checkpoint_and_a_rerun_completes(template,
                                                                                                 tmp_path):
    args = ["prune", "--keep-last", "2", "--delete-incomplete", "--yes"]
    expected = None
    points = random.Random(17).sample(range(1, 30), 10) + [1]
    killed = 0
    for n in points:
        root = tmp_path / f"run{n}-{killed}"
        shutil.copytree(template, root, symlinks=True)
        if expected is None:
            plan = reshard.prune(root, Policy(keep_last=2, delete_incomplete=True))
            expected = sorted(d.checkpoint.name for d in plan.decisions if d.action == KEEP)
            assert len(expected) < len(plan.decisions)      # something to delete
        kept = {name: lr.snapshot(root / name) for name in expected}
        proc = subprocess.run([sys.executable, DRIVER, "fs", str(n), args[0], str(root), *args[1:]],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode == -9:
            killed += 1
        else:
            assert proc.returncode == 0, proc.stderr     # past the last deletion: it simply finished
        assert {name: lr.snapshot(root / name) for name in expected} == kept
        rerun = run_cli(*args[:1], root, *args[1:])      # in this process: the kill was the driver's
        assert rerun.returncode == 0, rerun.stderr
        listing = reshard.list_checkpoints(root)
        assert sorted(c.name for c in listing.checkpoints) == expected and listing.trash == []
        assert not [p for p in (root / "ds").iterdir() if p.name.startswith(".")]
        assert {name: lr.snapshot(root / name) for name in expected} == kept
    assert killed >= 5      # most points land inside the deletions
