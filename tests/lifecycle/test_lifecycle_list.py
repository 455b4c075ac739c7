"""`reshard list` / reshard.list_checkpoints on run directories of real checkpoints
(tests/helpers/lifecycle_runs.py)."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import reshard
from reshard.lifecycle.listing import COMPLETE, IN_PROGRESS, INCOMPLETE
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import fixture_dir


def rows_by_name(listing) -> dict:
    return {c.name: c for c in listing.checkpoints}


@pytest.fixture(scope="module")
def ds_run(lifecycle_template):
    """lifecycle_runs.deepspeed_run, built once for the session (tests/conftest.py); listing only reads it."""
    return lifecycle_template


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frameworks")
    _, hf_state = lr.hf_run(root)
    _, pl_scores, pl_best = lr.lightning_run(root)
    return root, hf_state, pl_scores, pl_best


def test_deepspeed_save_dir_each_tag_one_row_broken_ones_incomplete_with_why(ds_run):
    rows = rows_by_name(reshard.list_checkpoints(ds_run))
    assert sorted(rows) == [f"ds/global_step{n}" for n in range(1, 9)]
    assert [rows[f"ds/global_step{n}"].step for n in range(1, 9)] == list(range(1, 9))
    for n in (1, 2, 3, 6, 7, 8):
        assert rows[f"ds/global_step{n}"].status == COMPLETE, rows[f"ds/global_step{n}"].why
    rank0_only, truncated = rows["ds/global_step4"], rows["ds/global_step5"]
    assert rank0_only.status == INCOMPLETE and "zero_pp_rank_1_mp_rank_00" in rank0_only.why
    assert "% of elements missing" in rank0_only.why and rank0_only.topology == "dp=4,zero=3"
    assert truncated.status == INCOMPLETE and "zero_pp_rank_1_mp_rank_00_optim_states.pt: truncated" in truncated.why
    assert rows["ds/global_step7"].topology == "dp=3,zero=2"       # the tag `reshard convert --tag-out` wrote
    assert rows["ds/global_step8"].pinned == ("named by ds/latest",)
    assert all(not r.pinned for name, r in rows.items() if name != "ds/global_step8")
    assert rows["ds/global_step1"].bytes == sum(f.stat().st_size for f in (ds_run / "ds/global_step1").iterdir())
    assert rows["ds/global_step1"].format == "deepspeed"


def test_the_same_tags_whole_are_complete(tmp_path):
    """Negative control of the above: the rank files restored, both rows are complete."""
    ds = tmp_path / "ds"
    ds.mkdir()
    lr.copy_tag("z3_fp32_dp4", "global_step3", ds, "global_step4")
    lr.copy_tag("z2_fp32_dp2", "global_step3", ds, "global_step5")
    lr.age(tmp_path)
    rows = reshard.list_checkpoints(tmp_path).checkpoints
    assert [(r.name, r.status) for r in rows] == [("ds/global_step4", COMPLETE), ("ds/global_step5", COMPLETE)]
    run_cli("list", tmp_path, check=0)      # none incomplete: exit 0


def test_cli_list_text_and_json(ds_run):
    text = run_cli("list", ds_run, check=1).stdout        # exit 1: it shows incomplete checkpoints
    assert "coverage proof" in text
    line = next(ln for ln in text.splitlines() if ln.rstrip().endswith("ds/global_step4"))
    assert "INCOMPLETE" in line and "dp=4,zero=3" in line
    assert "named by ds/latest" in next(ln for ln in text.splitlines() if "ds/global_step8" in ln)
    data = json.loads(run_cli("list", ds_run, "--json", check=1).stdout)
    assert data["check"] == "coverage"
    assert [(c["name"], c["status"]) for c in data["checkpoints"]] == \
        [(c.name, c.status) for c in reshard.list_checkpoints(ds_run).checkpoints]
    bad = run_cli("list", ds_run / "nowhere", "--json", check=1)
    assert bad.stderr.count("\n") == 1 and "nowhere: not a directory" in bad.stderr


def test_dcp_loop_unfinished_save_in_progress_and_older_one_abandoned(tmp_path):
    dcp_dir = lr.dcp_loop(tmp_path, [1, 2, 3, 4])
    rows = rows_by_name(reshard.list_checkpoints(tmp_path))
    assert [rows[f"dcp/step-{n}"].status for n in (1, 2, 3, 4)] == [COMPLETE] * 4
    assert rows["dcp/step-4"].format == "dcp"
    (dcp_dir / "step-4" / ".metadata").unlink()     # the newest save has not written .metadata yet
    (dcp_dir / "step-2" / ".metadata").unlink()     # a save that died long ago: step 3 finished after it
    lr.age(dcp_dir / "step-2")
    rows = rows_by_name(reshard.list_checkpoints(tmp_path))
    assert rows["dcp/step-4"].status == IN_PROGRESS and ".metadata" in rows["dcp/step-4"].why
    assert rows["dcp/step-2"].status == INCOMPLETE and "abandoned" in rows["dcp/step-2"].why
    assert rows["dcp/step-3"].status == COMPLETE
    lr.age(dcp_dir / "step-2", 0)       # but written to a moment ago: still a save in progress
    rows = rows_by_name(reshard.list_checkpoints(tmp_path))
    assert rows["dcp/step-2"].status == IN_PROGRESS and "written" in rows["dcp/step-2"].why


def test_staging_names_recent_and_growing_files_are_in_progress(tmp_path):
    ds = tmp_path / "run"
    ds.mkdir()
    lr.copy_tag("z2_fp32_dp2", "global_step3", ds, "global_step3")
    hf_staging = tmp_path / "run" / "tmp-checkpoint-9"
    shutil.copytree(fixture_dir("z2_fp32_dp2") / "global_step3", hf_staging)
    reshard_staging = tmp_path / "run" / ".global_step10.reshard-tmp"
    shutil.copytree(fixture_dir("z2_fp32_dp2") / "global_step3", reshard_staging)
    lr.age(tmp_path)
    fresh = lr.copy_tag("z2_fp32_dp2", "global_step3", ds, "global_step11")
    lr.age(fresh, 0)    # written just now
    rows = rows_by_name(reshard.list_checkpoints(tmp_path))
    assert rows["run/tmp-checkpoint-9"].status == IN_PROGRESS and "staging" in rows["run/tmp-checkpoint-9"].why
    assert rows["run/.global_step10.reshard-tmp"].status == IN_PROGRESS
    assert rows["run/global_step11"].status == IN_PROGRESS and "written" in rows["run/global_step11"].why
    assert rows["run/global_step3"].status == COMPLETE
    lr.age(fresh)
    assert rows_by_name(reshard.list_checkpoints(tmp_path))["run/global_step11"].status == COMPLETE
    # a file still growing while `settle` looks twice (its mtime set back each time, so only the size tells)
    growing = fresh / "mp_rank_00_model_states.pt"
    stop = threading.Event()

    def grow():
        while not stop.is_set():
            with open(growing, "ab") as f:
                f.write(b"\0" * 64)
            lr.age(fresh)
            time.sleep(0.05)
    thread = threading.Thread(target=grow)
    thread.start()
    try:
        rows = rows_by_name(reshard.list_checkpoints(tmp_path, settle=0.5))
    finally:
        stop.set()
        thread.join()
    assert rows["run/global_step11"].status == IN_PROGRESS and "changed" in rows["run/global_step11"].why
    assert rows["run/global_step3"].status == COMPLETE


def test_hf_trainer_run_metrics_at_eval_steps_and_best_model_checkpoint_pinned(framework_runs):
    root, hf_state, _, _ = framework_runs
    rows = {r.name: r for r in reshard.list_checkpoints(root).checkpoints if r.series == "hf"}
    assert sorted(rows, key=lambda n: rows[n].step) == [f"hf/checkpoint-{n}" for n in (2, 4, 6, 8)]
    assert all(r.status == COMPLETE and r.format == "hf-trainer" for r in rows.values())
    evals = {h["step"]: h["eval_loss"] for h in hf_state.log_history if "eval_loss" in h}
    assert sorted(evals) == [3, 6, 8]   # save_steps 2, eval_steps 3 (and the last step): 2 and 4 have no eval
    assert rows["hf/checkpoint-6"].metrics["eval_loss"] == evals[6]
    assert rows["hf/checkpoint-8"].metrics["eval_loss"] == evals[8]
    assert all("eval_loss" not in rows[f"hf/checkpoint-{n}"].metrics for n in (2, 4))
    best = os.path.basename(hf_state.best_model_checkpoint)
    assert rows[f"hf/{best}"].pinned and "best_model_checkpoint" in rows[f"hf/{best}"].pinned[0]


def test_lightning_run_scores_are_the_callbacks_and_best_model_path_pinned(framework_runs):
    root, _, pl_scores, pl_best = framework_runs
    rows = {r.path: r for r in reshard.list_checkpoints(root).checkpoints if r.series == "lightning"}
    assert sorted(rows) == sorted(pl_scores)
    for path, score in pl_scores.items():
        assert rows[path].status == COMPLETE and rows[path].format == "lightning"
        assert rows[path].metrics["val_loss"] == pytest.approx(score, rel=1e-6)
    assert [p for p, r in rows.items() if r.pinned] == [pl_best]


def test_metrics_file_json_and_csv(ds_run, tmp_path):
    as_json = tmp_path / "evals.json"
    as_json.write_text(json.dumps({"eval_loss": {"6": 1.5, "8": 1.25}}))
    as_csv = tmp_path / "evals.csv"
    as_csv.write_text("step,eval_loss,acc\n6,1.5,0.5\n8,1.25,\n")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"6": 1.5, "8": 1.25}))
    for path, name in ((as_json, None), (as_csv, None), (bare, "eval_loss")):
        rows = rows_by_name(reshard.list_checkpoints(ds_run, metrics=str(path), metric_name=name))
        assert rows["ds/global_step6"].metrics["eval_loss"] == 1.5
        assert rows["ds/global_step8"].metrics["eval_loss"] == 1.25
        assert "eval_loss" not in rows["ds/global_step7"].metrics
    assert rows_by_name(reshard.list_checkpoints(ds_run, metrics=str(as_csv)))["ds/global_step6"].metrics["acc"] == 0.5
    broken = tmp_path / "broken.csv"
    broken.write_text("iteration,loss\n1,2\n")
    bad = run_cli("list", ds_run, "--metrics", broken, check=1)
    assert bad.stderr.count("\n") == 1 and "broken.csv: not a metrics file" in bad.stderr


def test_links_are_not_followed_out_of_the_run(tmp_path):
    outside = tmp_path / "elsewhere"
    lr.copy_tag("z2_fp32_dp2", "global_step3", outside, "global_step9")
    run = tmp_path / "run"
    ds = run / "ds"
    ds.mkdir(parents=True)
    lr.copy_tag("z2_fp32_dp2", "global_step3", ds, "global_step3")
    (ds / "global_step9").symlink_to(outside / "global_step9")      # a link to a checkpoint elsewhere
    leaky = lr.copy_tag("z2_fp32_dp2", "global_step3", ds, "global_step4")
    rank_file = leaky / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_file.unlink()
    rank_file.symlink_to(outside / "global_step9" / rank_file.name)   # a rank file that lives elsewhere
    lr.age(tmp_path)
    listing = reshard.list_checkpoints(run)
    rows = rows_by_name(listing)
    assert sorted(rows) == ["ds/global_step3", "ds/global_step4"]
    assert any("global_step9" in note and "not followed" in note for note in listing.notes)
    assert rows["ds/global_step4"].status == INCOMPLETE and "leaves the run directory" in rows["ds/global_step4"].why


def test_universal_tree_and_hf_checkpoint_with_deepspeed_inside_are_one_row_each(framework_runs, tmp_path):
    """A universal save dir written by `reshard convert --format universal` (its tags listed, `latest_universal`
    named), and a Trainer checkpoint-N folder holding a DeepSpeed save as the Trainer's DeepSpeed integration
    writes it (the engine's tag folder and `latest` beside trainer_state.json): one checkpoint, not a save dir."""
    root, hf_state, _, _ = framework_runs
    run = tmp_path / "run"
    run_cli("convert", fixture_dir("z2_fp32_dp2"), run / "universal", "--format", "universal", "--tag-out",
            "global_step3", check=0)
    hf_ds = run / "hf" / "checkpoint-6"
    shutil.copytree(root / "hf" / "checkpoint-6", hf_ds)
    (hf_ds / "optimizer.pt").unlink()       # with DeepSpeed the engine's files hold the optimizer
    shutil.copytree(fixture_dir("z2_fp32_dp2") / "global_step3", hf_ds / "global_step6")
    (hf_ds / "latest").write_text("global_step6")
    rng = hf_ds / "rng_state.pth"       # a 2-process Trainer writes one RNG file per process
    if rng.exists():
        for rank in (0, 1):
            shutil.copy(rng, hf_ds / f"rng_state_{rank}.pth")
        rng.unlink()
    lr.age(run)
    rows = rows_by_name(reshard.list_checkpoints(run))
    assert sorted(rows) == ["hf/checkpoint-6", "universal/global_step3"]
    universal = rows["universal/global_step3"]
    assert universal.status == COMPLETE and universal.format == "universal" and universal.pinned
    inside = rows["hf/checkpoint-6"]
    assert inside.status == COMPLETE and inside.format == "deepspeed" and inside.step == 6
    evals = {h["step"]: h["eval_loss"] for h in hf_state.log_history if "eval_loss" in h}
    assert inside.metrics["eval_loss"] == evals[6]


@shares("lightning_deepspeed.py")
def lightning_save(out):
    """One ZeRO-2 save at 2 ranks, in the launch of tests/formats/framework/test_lightning_deepspeed.py's saves."""
    return [(2, None, {"mode": "save", "dir": str(out / "ckpts"), "seed": 0, "truth": str(out / "truth.safetensors"),
                       "stage": 2, "steps": 2})]


@pytest.mark.engine
def test_lightning_deepspeed_ckpt_folders_are_one_checkpoint_each(engine_launches):
    """Lightning's DeepSpeedStrategy (ZeRO-2, 2 ranks, tests/scripts/lightning_deepspeed.py) saves `step=K.ckpt/`
    folders (a DeepSpeed save dir inside): each is one row, complete, its step from the name, the folder its
    ModelCheckpoint's best_model_path names pinned; with a rank's optimizer file gone it is incomplete."""
    ckpt = Path(engine_launches.results(lightning_save)[0]["ckpt"])
    tmp_path = ckpt.parent.parent
    lr.age(tmp_path)
    [row] = reshard.list_checkpoints(tmp_path / "ckpts").checkpoints
    assert (row.path, row.status, row.step, row.format) == (str(ckpt), COMPLETE, 2, "deepspeed")
    assert row.pinned and "best_model_path" in row.pinned[0]
    next(ckpt.rglob("*rank_1_*optim_states.pt")).unlink()
    lr.age(tmp_path)    # (the deletion is a change of its folder: just now, it would be in progress)
    [row] = reshard.list_checkpoints(tmp_path / "ckpts").checkpoints
    assert row.status == INCOMPLETE and "rank_1" in row.why
