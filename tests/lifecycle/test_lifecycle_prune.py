"""`reshard prune` / reshard.prune on run directories of real checkpoints: the plan, and each invariant."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import reshard
from reshard.lifecycle.retention import PolicyError
from reshard.lifecycle.run_layout import trash_path
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir


@pytest.fixture
def run(lifecycle_copy):
    """A copy of lifecycle_runs.deepspeed_run's DeepSpeed run: 1-3 and 6-8 whole, 4 and 5 broken (conftest)."""
    return lifecycle_copy


def tags(run) -> list:
    return sorted((p.name for p in (run / "ds").iterdir() if p.is_dir()), key=lambda n: int(n[len("global_step"):]))


def steps(run) -> list:
    return [int(t[len("global_step"):]) for t in tags(run)]


def test_dry_run_prints_the_plan_and_deletes_nothing(run):
    before = lr.snapshot(run)
    out = run_cli("prune", run, "--keep-last", "2", check=0).stdout
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith(("keep", "delete", "untouched"))}
    assert [n for n, line in lines.items() if line.startswith("delete")] == \
        ["ds/global_step1", "ds/global_step2", "ds/global_step3", "ds/global_step6"]
    assert "among the last 2 complete" in lines["ds/global_step7"]
    assert "newest complete checkpoint" in lines["ds/global_step8"] and "named by ds/latest" in lines["ds/global_step8"]
    assert "incomplete (deleted only with --delete-incomplete)" in lines["ds/global_step4"]
    assert "dry run: would delete 4 checkpoints" in out
    assert lr.snapshot(run) == before


def test_yes_deletes_exactly_the_plan_and_latest_stays_valid(run):
    kept_before = {t: lr.snapshot(run / "ds" / t) for t in ("global_step4", "global_step5", "global_step7",
                                                            "global_step8")}
    plan = reshard.prune(run, reshard.Policy(keep_last=2))
    # the files' bytes, as `list` shows them (not the blocks allocated): one size meaning everywhere
    freed = sum(os.stat(os.path.join(folder, f)).st_size for d in plan.deleting()
                for folder, _, files in os.walk(d.checkpoint.path) for f in files)
    assert freed == sum(d.checkpoint.bytes for d in plan.deleting())
    data = json.loads(run_cli("prune", run, "--keep-last", "2", "--yes", "--json", check=0).stdout)
    assert data["executed"] and data["bytes_freed"] == freed
    assert steps(run) == [4, 5, 7, 8]
    assert {t: lr.snapshot(run / "ds" / t) for t in kept_before} == kept_before
    assert not [p for p in (run / "ds").iterdir() if p.name.endswith(".reshard-trash")]
    run_cli("validate", run / "ds", check=0)        # through `latest`, as DeepSpeed's load_checkpoint reads it
    again = reshard.prune(run, reshard.Policy(keep_last=2), yes=True)
    assert again.removed == []      # a second run has nothing left to do


def test_newest_complete_and_what_latest_names_are_kept_whatever_the_rules(run):
    (run / "ds" / "latest").write_text("global_step3")       # a run resumed from step 3
    lr.age(run)
    reshard.prune(run, reshard.Policy(keep_steps=(1,)), yes=True)
    assert steps(run) == [1, 3, 4, 5, 8]        # 1 by the rule, 3 named by latest, 8 the newest complete
    run_cli("validate", run / "ds", check=0)


def test_negative_control_without_latest_naming_it_step_3_goes(run):
    reshard.prune(run, reshard.Policy(keep_steps=(1,)), yes=True)
    assert steps(run) == [1, 4, 5, 8]


def test_incomplete_checkpoints_never_count_and_go_only_with_delete_incomplete(run):
    broken = lr.copy_tag("z2_fp32_dp2", "global_step3", run / "ds", "global_step9")   # the newest save is broken
    (broken / "mp_rank_00_model_states.pt").unlink()
    lr.age(run)
    reshard.prune(run, reshard.Policy(keep_last=1), yes=True)
    assert steps(run) == [4, 5, 8, 9]           # 8: the newest complete one, though 9 is newer
    reshard.prune(run, reshard.Policy(keep_last=1, delete_incomplete=True), yes=True)
    assert steps(run) == [8]


def test_delete_incomplete_alone_keeps_every_complete_checkpoint(run):
    reshard.prune(run, reshard.Policy(delete_incomplete=True), yes=True)
    assert steps(run) == [1, 2, 3, 6, 7, 8]


def test_a_save_in_progress_is_never_touched(tmp_path):
    dcp = lr.dcp_loop(tmp_path, [1, 2, 3, 4])
    (dcp / "step-4" / ".metadata").unlink()                  # being written
    staging = dcp / "tmp-checkpoint-5"
    shutil.copytree(dcp / "step-3", staging)
    fresh = dcp / "step-6"
    shutil.copytree(dcp / "step-3", fresh)
    lr.age(fresh, 0)                                         # files written a moment ago
    before = {p: lr.snapshot(p) for p in (dcp / "step-4", staging, fresh)}
    plan = reshard.prune(tmp_path, reshard.Policy(keep_last=1, delete_incomplete=True), yes=True)
    assert {d.checkpoint.name: d.action for d in plan.decisions} == {
        "dcp/step-1": "delete", "dcp/step-2": "delete", "dcp/step-3": "keep", "dcp/step-4": "untouched",
        "dcp/tmp-checkpoint-5": "untouched", "dcp/step-6": "untouched"}
    assert {p: lr.snapshot(p) for p in before} == before
    assert sorted(p.name for p in dcp.iterdir()) == ["step-3", "step-4", "step-6", "tmp-checkpoint-5"]


def test_a_policy_that_cannot_be_evaluated_deletes_nothing(run, tmp_path):
    before = lr.snapshot(run)
    bad = run_cli("prune", run, "--keep-best", "1", "--metric", "eval_loss", "--yes", check=1)
    assert bad.stderr.count("\n") == 1 and "no complete checkpoint records metric 'eval_loss'" in bad.stderr
    some = tmp_path / "some.json"
    some.write_text(json.dumps({"eval_loss": {"7": 1.0, "8": 2.0}}))
    bad = run_cli("prune", run, "--keep-best", "1", "--metric", "eval_loss", "--metrics", some, "--yes", check=1)
    assert bad.stderr.count("\n") == 1 and "global_step1: records no 'eval_loss'" in bad.stderr
    assert lr.snapshot(run) == before
    assert run_cli("prune", run, "--keep-best", "1", check=2).stderr.count("--metric") >= 1
    assert "no retention rule" in run_cli("prune", run, check=2).stderr


def test_keep_best_by_a_metrics_file_min_and_max(run, tmp_path):
    metrics = tmp_path / "evals.csv"
    metrics.write_text("step,eval_loss\n1,0.5\n2,0.9\n3,0.7\n6,0.2\n7,1.5\n8,1.0\n")
    plan = reshard.prune(run, reshard.Policy(keep_best=2, metric="eval_loss"), metrics=str(metrics))
    kept = sorted(d.checkpoint.step for d in plan.decisions if d.action == "keep" and d.checkpoint.complete)
    assert kept == [1, 6, 8]
    reshard.prune(run, reshard.Policy(keep_best=1, metric="eval_loss", mode="max", keep_every=3),
                  metrics=str(metrics), yes=True)
    assert steps(run) == [3, 4, 5, 6, 7, 8]     # 7 the best by max; 3 and 6 multiples of 3; 8 the newest


def test_hf_trainer_run_unranked_saves_refuse_keep_best_and_best_checkpoint_survives_keep_last(tmp_path):
    hf_dir, state = lr.hf_run(tmp_path)
    with pytest.raises(PolicyError, match="checkpoint-2: records no 'eval_loss'"):
        reshard.prune(tmp_path, reshard.Policy(keep_last=1, keep_best=1, metric="eval_loss"), yes=True)
    assert sorted(os.listdir(hf_dir)) == [f"checkpoint-{n}" for n in (2, 4, 6, 8)]
    (hf_dir / "checkpoint-8" / "trainer_state.json").write_text(json.dumps(
        {**json.loads((hf_dir / "checkpoint-8" / "trainer_state.json").read_text()),
         "best_model_checkpoint": str(hf_dir / "checkpoint-6")}))      # as when step 6 evaluated best
    lr.age(hf_dir)
    reshard.prune(tmp_path, reshard.Policy(keep_last=1), yes=True)
    assert sorted(os.listdir(hf_dir)) == ["checkpoint-6", "checkpoint-8"]
    run_cli("validate", hf_dir / "checkpoint-6", check=0)


def test_lightning_run_keep_best_by_the_callbacks_monitor(tmp_path):
    out, scores, best = lr.lightning_run(tmp_path)
    newest = max(scores, key=lambda p: int(p.split("step=")[1].split(".")[0]))
    two_best = sorted(scores, key=scores.get)[:2]
    reshard.prune(tmp_path, reshard.Policy(keep_best=2, metric="val_loss"), yes=True)
    assert sorted(str(p) for p in out.iterdir()) == sorted({*two_best, newest, best})
    for path in {*two_best, newest}:
        run_cli("validate", path, check=0)


def test_links_are_never_followed_and_an_outside_target_survives(tmp_path):
    outside = tmp_path / "elsewhere"
    target = lr.copy_tag("z2_fp32_dp2", "global_step3", outside, "global_step9")
    run = tmp_path / "run"
    ds = run / "ds"
    ds.mkdir(parents=True)
    for step in (1, 2, 3):
        lr.copy_tag("z2_fp32_dp2", "global_step3", ds, f"global_step{step}")
    (ds / "global_step9").symlink_to(target)
    leaky = ds / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    leaky.unlink()
    leaky.symlink_to(target / leaky.name)
    lr.age(tmp_path)
    before = lr.snapshot(outside)
    reshard.prune(run, reshard.Policy(keep_last=1, delete_incomplete=True), yes=True)
    assert sorted(p.name for p in ds.iterdir()) == ["global_step3", "global_step9"]
    assert (ds / "global_step9").is_symlink() and lr.snapshot(outside) == before


def test_a_rerun_finishes_an_interrupted_prune(run):
    trash = trash_path(str(run / "ds" / "global_step1"))
    os.rename(run / "ds" / "global_step1", trash)         # where a prune killed after its rename stopped
    listing = reshard.list_checkpoints(run)
    assert "ds/global_step1" not in {c.name for c in listing.checkpoints} and listing.trash == [trash]
    assert "interrupted prune" in run_cli("list", run, check=1).stdout     # 1: global_step4 and 5 incomplete
    reshard.prune(run, reshard.Policy(keep_last=10))      # a dry run leaves it
    assert os.path.exists(trash)
    plan = reshard.prune(run, reshard.Policy(keep_last=10), yes=True)
    assert not os.path.exists(trash) and plan.trash == [trash] and plan.removed == []
    assert steps(run) == [2, 3, 4, 5, 6, 7, 8]


def test_the_api_mirrors_the_command(run):
    plan = reshard.prune(run, reshard.Policy(keep_last=3, keep_every=2))
    cli = json.loads(run_cli("prune", run, "--keep-last", "3", "--keep-every", "2", "--json", check=0).stdout)
    assert [(d["name"], d["action"]) for d in cli["decisions"]] == \
        [(d.checkpoint.name, d.action) for d in plan.decisions]
    assert not cli["executed"] and fixture_dir("z2_fp32_dp2").exists()


@pytest.mark.engine
def test_a_real_deepspeed_run_saving_every_step_pruned_by_its_client_state_metric_and_loaded(tmp_path):
    """DeepSpeed (ZeRO-3, 2 ranks) saves 8 steps with eval_loss in its client state; step 3 is made a rank-0-only
    save and step 5 truncated. `list` shows both broken and every eval_loss; prune keeps the last complete and
    the 2 best; the engine then loads `latest` and each kept tag, holding exactly the weights of that step."""
    from tests.helpers.torchrun import run_torchrun
    run = tmp_path / "run"
    saved = run_torchrun("lifecycle_deepspeed.py", 2, {"mode": "train", "dir": str(run), "steps": 8}, tmp_path, "train")
    for f in (run / "global_step3").glob("*rank_1_*"):
        f.unlink()                              # rank 1 never wrote its partitions
    optim = next((run / "global_step5").glob("*rank_1_*optim_states.pt"))
    with open(optim, "r+b") as f:
        f.truncate(optim.stat().st_size // 3)
    lr.age(tmp_path)
    rows = {c.name: c for c in reshard.list_checkpoints(run).checkpoints}
    assert sorted(rows, key=lambda n: rows[n].step) == [f"global_step{n}" for n in range(1, 9)]
    assert [n for n, r in rows.items() if not r.complete] == ["global_step3", "global_step5"]
    assert "% of elements missing" in rows["global_step3"].why
    for name, r in rows.items():
        assert r.metrics["eval_loss"] == saved[name]["eval_loss"] or not r.complete
    assert len({v["sum"] for v in saved.values()}) == 8       # each step's weights tell it apart (the control)
    whole = [n for n in saved if rows[n].complete]
    best = sorted(whole, key=lambda n: (saved[n]["eval_loss"], -rows[n].step))[:2]
    reshard.prune(run, reshard.Policy(keep_last=1, keep_best=2, metric="eval_loss", delete_incomplete=True), yes=True)
    left = sorted(p.name for p in run.iterdir() if p.is_dir())
    assert left == sorted({*best, "global_step8"})
    loaded = run_torchrun("lifecycle_deepspeed.py", 2, {"mode": "load", "dir": str(run), "tags": [None, *left]},
                          tmp_path, "load")
    assert loaded["None"] == {"loaded": True, "global_steps": 8, "sum": saved["global_step8"]["sum"]}
    for tag in left:
        assert loaded[tag] == {"loaded": True, "global_steps": int(tag[len("global_step"):]), "sum": saved[tag]["sum"]}
