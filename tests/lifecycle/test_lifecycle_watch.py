"""`reshard watch` / reshard.Watcher on run directories of real checkpoints, and beside a live DeepSpeed run."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import reshard
from reshard.lifecycle import watching
from reshard.storage.names import WATCH_STATE
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir
from tests.helpers.repo import REPO

TIMEOUT = 600       # generous: the machine is shared; nothing here measures how fast


@pytest.fixture
def run(lifecycle_copy):
    """A copy of lifecycle_runs.deepspeed_run's DeepSpeed run: 1-3 and 6-8 whole, 4 and 5 broken (conftest)."""
    return lifecycle_copy


def reported(out: str) -> dict:
    """{step: line} of what the watcher reported."""
    return {int(line.split(":")[0].split()[1]): line for line in out.splitlines()
            if line.startswith("step ") and line.split(": ")[1].startswith(("complete", "INCOMPLETE"))}


def summary(run, complete: int, incomplete: int, unread: int = 0, waiting: int = 0, deleted: int = 0) -> str:
    """`watch --once`'s last line: what the pass did."""
    validated = complete + incomplete
    return (f"{os.path.realpath(run)}: validated {validated} checkpoint{'s' * (validated != 1)} ({complete} "
            f"complete, {incomplete} incomplete), kept {unread} unverifiable or unknown unread, left {waiting} in "
            f"progress, deleted {deleted}")


def test_once_reports_every_checkpoint_once_flags_the_broken_and_exits_1(run):
    before = lr.snapshot(run)
    proc = run_cli("watch", run, "--once", check=1)
    lines = reported(proc.stdout)
    assert sorted(lines) == list(range(1, 9))
    assert "INCOMPLETE — ds/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in lines[4]
    assert "% of elements missing" in lines[4]
    assert "INCOMPLETE — " in lines[5] and "truncated" in lines[5]
    for step in (1, 2, 3, 6, 7, 8):
        assert lines[step].startswith(f"step {step}: complete, ") and "INCOMPLETE" not in lines[step]
    assert proc.stdout.splitlines()[-1] == summary(run, complete=6, incomplete=2), proc.stdout
    after = lr.snapshot(run)
    assert set(after) - set(before) == {WATCH_STATE} and all(after[k] == v for k, v in before.items())
    # restarted: nothing reported again, and nothing broken newly found: exit 0
    again = run_cli("watch", run, "--once", check=0)
    assert reported(again.stdout) == {} and again.stdout.splitlines()[-1] == summary(run, 0, 0), again.stdout
    # the negative control: without its state a watcher reports everything again
    os.unlink(run / WATCH_STATE)
    assert sorted(reported(run_cli("watch", run, "--once", check=1).stdout)) == list(range(1, 9))


def test_list_and_prune_ignore_the_state_file(run):
    listed = run_cli("list", run, "--json", check=1).stdout       # 1: global_step4 and 5 incomplete
    run_cli("watch", run, "--once", check=1)
    assert (run / WATCH_STATE).exists()
    assert json.loads(run_cli("list", run, "--json", check=1).stdout) == json.loads(listed)
    run_cli("prune", run, "--keep-last", "1", "--delete-incomplete", "--yes", check=0)
    assert (run / WATCH_STATE).exists() and sorted(p.name for p in (run / "ds").iterdir() if p.is_dir()) == \
        ["global_step8"]


def test_policy_deletes_only_what_it_validated_and_keeps_the_prune_invariants(run):
    """`latest` names global_step6: 7 and 8 are newer, so their saves have not finished (not validated, not
    counted); keep-last 1 keeps 6 (also what latest names), deletes 1-3 and, with --delete-incomplete, 4-5."""
    (run / "ds" / "latest").write_text("global_step6")
    lr.age(run / "ds" / "latest")
    proc = run_cli("watch", run, "--once", "--keep-last", "1", "--delete-incomplete", check=1)
    assert sorted(reported(proc.stdout)) == [1, 2, 3, 4, 5, 6]
    assert "step 7: in progress — newer than ds/global_step6, named by ds/latest" in proc.stdout
    assert sorted(p.name for p in (run / "ds").iterdir() if p.is_dir()) == \
        ["global_step6", "global_step7", "global_step8"]
    # the negative control: once latest moved, 7 and 8 are validated and the policy reaches them
    (run / "ds" / "latest").write_text("global_step8")
    lr.age(run / "ds" / "latest")
    proc = run_cli("watch", run, "--once", "--keep-last", "1", "--delete-incomplete", check=0)
    assert sorted(reported(proc.stdout)) == [7, 8]
    assert sorted(p.name for p in (run / "ds").iterdir() if p.is_dir()) == ["global_step8"]


def test_the_policy_waits_for_a_first_validated_checkpoint(tmp_path):
    """Saves all still landing (just written): nothing for --keep-best to rank yet, which is not a policy that
    cannot be evaluated — no error, exit 0; once they are old enough, the same run is ranked (the best and the
    newest kept)."""
    run = tmp_path / "run"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), run)
    metrics = tmp_path / "loss.json"
    metrics.write_text(json.dumps({"2": 0.5, "3": 0.7}))
    args = ("watch", run, "--once", "--keep-best", "1", "--metric", "loss", "--metrics", metrics)
    for p in run.rglob("*"):
        os.utime(p)         # written now: in progress for --recent seconds
    proc = run_cli(*args, "--recent", "3600", check=0)
    assert proc.stderr == "" and proc.stdout.splitlines()[-1] == summary(run, 0, 0, waiting=2), proc.stdout
    lr.age(run)
    proc = run_cli(*args, check=0)
    assert "deleted" not in proc.stderr and sorted(reported(proc.stdout)) == [2, 3]
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["global_step2", "global_step3"]   # best, newest


def test_restart_from_the_state_file_validates_nothing_again(run, monkeypatch):
    """With --checksums each new complete checkpoint is validated again (the sha256 sums where a manifest is
    there: `reshard convert` output); a restarted watcher reads its state and validates and reports nothing it
    did; a checkpoint whose files changed under its name is new, and a flipped byte fails its sums."""
    run_cli("convert", fixture_dir("z2_fp32_dp2"), run / "conv", "--to", "dp=3", check=0)
    lr.age(run / "conv")
    calls = []
    real = watching.validate
    monkeypatch.setattr(watching, "validate", lambda catalog, **kw: calls.append(catalog.root) or real(catalog, **kw))
    first = reshard.Watcher(run, checksums=True).poll()
    assert len(first.reported) == 9 and len(calls) == 7        # every complete one
    [converted] = [e for e in first.reported if e.checksums]
    assert converted.name.startswith("conv/") and converted.complete
    calls.clear()
    restarted = reshard.Watcher(run, checksums=True).poll()
    assert restarted.reported == () and calls == []
    shutil.rmtree(run / "ds" / "global_step2")
    shutil.copytree(fixture_dir("z2_fp32_dp2") / "global_step2", run / "ds" / "global_step2")
    lr.age(run / "ds" / "global_step2", 1800)
    victim = next(p for p in sorted((run / converted.name).iterdir()) if p.stat().st_size > 1000)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    lr.age(victim, 1800)
    again = {e.name: e for e in reshard.Watcher(run, checksums=True).poll().reported}
    assert sorted(again) == sorted(["ds/global_step2", converted.name]) and len(calls) == 2
    assert again["ds/global_step2"].complete and not again[converted.name].complete
    assert "blake3 differs" in again[converted.name].why
    # the negative control: the coverage proof alone (what `list` runs) does not see a flipped byte
    assert {r.name: r.status for r in reshard.list_checkpoints(run).checkpoints}[converted.name] == "complete"


def test_a_checkpoint_still_being_written_is_not_reported_until_it_is_whole(tmp_path):
    """A tag folder with rank 1's optimizer file still growing: while it grows it is in progress (the settle
    look), however old its files look; it is reported once, complete, when the writer is done — never broken."""
    run = tmp_path / "run"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), run)
    tag = run / "global_step3"
    optim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    whole = optim.read_bytes()
    optim.write_bytes(whole[:len(whole) // 4])
    lr.age(run)
    done = threading.Event()

    def writer():       # appends the rest in pieces, keeping the file's mtime old: only sizes betray it
        at = len(whole) // 4
        while not done.is_set():
            time.sleep(0.05)
            with open(optim, "ab") as f:
                f.write(whole[at:at + 64])
            at = min(at + 64, len(whole) - 64)
            lr.age(optim)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        watcher = reshard.Watcher(run, recent=0, settle=0.5)
        growing = watcher.poll()
        assert [r.name for r in growing.waiting] == ["global_step3"] and "changed within" in growing.waiting[0].why
        assert all(e.name != "global_step3" for e in growing.reported)
    finally:
        done.set()
        thread.join()
    optim.write_bytes(whole)
    lr.age(tag)     # only the tag: a new mtime elsewhere would be a checkpoint saved again, and reported again
    finished = watcher.poll()
    assert [(e.name, e.status) for e in finished.reported] == [("global_step3", "complete")]
    watcher.close()
    # the negative control: the same cut file, not growing, is reported broken
    optim.write_bytes(whole[:len(whole) // 4])
    lr.age(tag)
    broken = reshard.Watcher(tmp_path / "run", recent=0, settle=0.5).poll()
    assert [(e.name, e.status) for e in broken.reported] == [("global_step3", "incomplete")]


def test_a_checkpoint_changed_while_validated_is_retried_not_reported_broken(run, monkeypatch):
    """A writer cuts a file of global_step8 while the watcher validates it (--checksums): the look after the
    validation sees the change, and the checkpoint is retried next pass, not reported; meanwhile the policy
    (keep-last 1) counts it in progress: global_step7, the newest the watcher validated, is what it keeps."""
    real = watching.validate
    target = run / "ds" / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    whole = target.read_bytes()

    def validate_while_written(catalog, **kw):
        if catalog.root.endswith("global_step8"):
            target.write_bytes(whole[:100])     # the trainer still at work
        return real(catalog, **kw)
    monkeypatch.setattr(watching, "validate", validate_while_written)
    first = reshard.Watcher(run, reshard.Policy(keep_last=1), checksums=True, recent=0, settle=0).poll()
    assert "ds/global_step8" not in [e.name for e in first.reported]
    assert sorted(first.removed) == ["ds/global_step1", "ds/global_step2", "ds/global_step3", "ds/global_step6"]
    assert [r.why for r in first.waiting if r.name == "ds/global_step8"] == ["its files changed while it was validated"]
    monkeypatch.setattr(watching, "validate", real)
    target.write_bytes(whole)
    lr.age(target.parent)
    second = reshard.Watcher(run, reshard.Policy(keep_last=1), checksums=True, recent=0, settle=0).poll()
    assert [(e.name, e.status) for e in second.reported] == [("ds/global_step8", "complete")]
    assert second.removed == ("ds/global_step7",)


def test_a_checkpoint_the_trainer_removes_while_it_is_validated_is_not_reported(run, monkeypatch):
    """The trainer's own rotation deletes global_step1 while the watcher validates it: that pass ends quietly
    (what it reported is kept), the next one goes on with the run as it is."""
    real = watching.validate

    def validate_while_rotated(catalog, **kw):
        if catalog.root.endswith("global_step1"):
            shutil.rmtree(catalog.root)
        return real(catalog, **kw)
    monkeypatch.setattr(watching, "validate", validate_while_rotated)
    watcher = reshard.Watcher(run, checksums=True)
    assert watcher.poll().reported == ()
    monkeypatch.setattr(watching, "validate", real)
    assert [e.step for e in watcher.poll().reported] == [2, 3, 4, 5, 6, 7, 8]


def test_exec_runs_once_per_good_checkpoint(run, tmp_path):
    log = tmp_path / "exec.log"
    command = f'echo "$RESHARD_STEP $RESHARD_CHECKPOINT {{}}" >> {log}'
    run_cli("watch", run, "--once", "--exec", command, check=1)
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["1", "2", "3", "6", "7", "8"]     # not 4 and 5, broken
    for line in lines:
        step, env_path, arg_path = line.split()
        assert env_path == arg_path == str(run / "ds" / f"global_step{step}")
    run_cli("watch", run, "--once", "--exec", command, check=0)
    assert log.read_text().splitlines() == lines        # restarted: nothing run twice
    # a failing command: one line naming the checkpoint, --once exits 1
    shutil.copytree(fixture_dir("z2_fp32_dp2") / "global_step2", run / "ds" / "global_step9")
    lr.age(run / "ds" / "global_step9")
    (run / "ds" / "latest").write_text("global_step9")
    lr.age(run / "ds" / "latest")
    failed = run_cli("watch", run, "--once", "--exec", "exit 3", check=1)
    assert failed.stderr.strip().splitlines()[-1] == f"reshard: {run / 'ds' / 'global_step9'}: --exec exited 3"


def test_hf_trainer_run_a_policy_it_cannot_evaluate_is_said_once_and_deletes_nothing(tmp_path):
    """A Trainer run whose save_steps (2) and eval_steps (3) do not line up: --keep-best cannot rank
    checkpoint-2, so nothing is deleted (one line, --once exits 1); a restarted watcher with --keep-last 1 alone
    deletes what prune would, keeping the newest and the trainer's best_model_checkpoint."""
    hf_dir, state = lr.hf_run(tmp_path)
    proc = run_cli("watch", tmp_path, "--once", "--keep-last", "1", "--keep-best", "1", "--metric", "eval_loss",
                   check=1)
    lines = reported(proc.stdout)
    assert sorted(lines) == [2, 4, 6, 8] and all(": complete, " in line for line in lines.values()), proc.stdout
    [logged] = [r["eval_loss"] for r in state.log_history if r.get("step") == 6 and "eval_loss" in r]
    assert f"eval_loss {logged:g}" in lines[6] and "eval_loss" not in lines[2]
    assert proc.stderr.count("\n") == 1 and "checkpoint-2: records no 'eval_loss'" in proc.stderr
    assert sorted(os.listdir(hf_dir)) == [f"checkpoint-{n}" for n in (2, 4, 6, 8)]
    again = run_cli("watch", tmp_path, "--once", "--keep-last", "1", check=0)
    assert reported(again.stdout) == {}
    best = {os.path.basename(state.best_model_checkpoint)} if state.best_model_checkpoint else set()
    kept = {"checkpoint-8"} | best
    assert sorted(os.listdir(hf_dir)) == sorted(kept)


def _dcp_run(tmp_path):
    """A DCP save loop of 4 steps; steps 3 and 4 kept aside (outside the run) to land later."""
    root = tmp_path / "src"
    dcp = lr.dcp_loop(root, [1, 2, 3, 4])
    aside = tmp_path / "aside"
    aside.mkdir()
    for step in (3, 4):
        (dcp / f"step-{step}").rename(aside / f"step-{step}")
    return dcp, aside


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def _same(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_best_is_replaced_only_when_the_best_changes(tmp_path):
    dcp, aside = _dcp_run(tmp_path)
    metrics = tmp_path / "loss.json"
    metrics.write_text(json.dumps({"loss": {"1": 0.5, "2": 0.7, "3": 0.9, "4": 0.1}}))
    refs = {}
    for step, where in ((1, dcp), (2, dcp), (3, aside), (4, aside)):
        refs[step] = tmp_path / f"ref-{step}.safetensors"
        run_cli("export", where / f"step-{step}", refs[step], check=0)
    assert not _same(_tensors(refs[1]), _tensors(refs[4]))      # the steps tell apart (the control)
    best = tmp_path / "best" / "model.safetensors"
    args = ("watch", dcp, "--once", "--metric", "loss", "--metrics", metrics, "--export-best", best)
    out = run_cli(*args, check=0).stdout
    assert f"best loss 0.5: step 1 exported to {best}" in out
    assert _same(_tensors(best), _tensors(refs[1]))
    first = os.stat(best)
    (aside / "step-3").rename(dcp / "step-3")           # worse: the export stays as it is
    out = run_cli(*args, check=0).stdout
    assert "step 3: complete" in out and "exported" not in out
    assert (os.stat(best).st_ino, os.stat(best).st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    (aside / "step-4").rename(dcp / "step-4")           # better: replaced (a new file renamed over it)
    out = run_cli(*args, check=0).stdout
    assert "best loss 0.1: step 4 exported" in out and os.stat(best).st_ino != first.st_ino
    assert _same(_tensors(best), _tensors(refs[4]))
    assert sorted(p.name for p in best.parent.iterdir() if p.name.startswith(".")) == []     # nothing left beside


def _best_run(run, tmp_path):
    """The DeepSpeed run with global_step1-3 only (4-8 set aside, `latest` naming 3), global_step1 holding other
    weights than the rest (the fixture's global_step2); a loss falling to 0.5 at step 1, then rising, and 0.2 at
    step 6; a reference export of steps 1 and 6 (6's weights are 3's)."""
    ds = run / "ds"
    aside = tmp_path / "aside"
    aside.mkdir()
    for step in range(4, 9):
        (ds / f"global_step{step}").rename(aside / f"global_step{step}")
    shutil.rmtree(ds / "global_step1")
    lr.copy_tag("z2_fp32_dp2", "global_step2", ds, "global_step1")
    (ds / "latest").write_text("global_step3")
    lr.age(run)
    metrics = tmp_path / "loss.json"
    metrics.write_text(json.dumps({"loss": {"1": 0.5, "2": 0.8, "3": 1.0, "6": 0.2}}))
    refs = {step: tmp_path / f"ref-{step}.safetensors" for step in (1, 6)}
    run_cli("export", ds / "global_step1", refs[1], check=0)
    run_cli("export", aside / "global_step6", refs[6], check=0)
    assert not _same(_tensors(refs[1]), _tensors(refs[6]))      # the steps tell apart (the control)
    return ds, aside, metrics, refs


def _land(ds, aside, step):
    """Checkpoint `step`, set aside, saved now: moved back, `latest` naming it."""
    (aside / f"global_step{step}").rename(ds / f"global_step{step}")
    (ds / "latest").write_text(f"global_step{step}")
    lr.age(ds / f"global_step{step}")
    lr.age(ds / "latest")


def test_export_best_is_never_replaced_by_a_worse_one_after_retention_deleted_the_best(run, tmp_path):
    """Issue 24.3, --keep-last 1 --metric loss, each pass a new process (cron's --once): pass 1 exports step 1
    (loss 0.5) and deletes steps 1-2; pass 2 sees only step 3 (loss 1.0), worse than what the export holds (its
    score remembered in the watch state): the export stays step 1's, untouched. The negative control: step 6
    (loss 0.2), better, replaces it."""
    ds, aside, metrics, refs = _best_run(run, tmp_path)
    best = tmp_path / "best.safetensors"
    args = ("watch", run, "--once", "--keep-last", "1", "--metric", "loss", "--metrics", metrics,
            "--export-best", best)
    out = run_cli(*args, check=0).stdout
    assert f"best loss 0.5: step 1 exported to {best}" in out
    assert sorted(p.name for p in ds.iterdir() if p.is_dir()) == ["global_step3"]
    assert _same(_tensors(best), _tensors(refs[1]))
    first, written = os.stat(best), best.read_bytes()
    proc = run_cli(*args, check=0)
    assert "exported" not in proc.stdout and proc.stderr == ""
    assert best.read_bytes() == written and (os.stat(best).st_ino, os.stat(best).st_mtime_ns) == \
        (first.st_ino, first.st_mtime_ns)
    state = json.loads((run / WATCH_STATE).read_text())["best"]
    assert (state["name"], state["step"], state["value"], state["metric"], state["mode"]) == \
        ("ds/global_step1", 1, 0.5, "loss", "min")
    _land(ds, aside, 6)
    out = run_cli(*args, check=0).stdout
    assert f"best loss 0.2: step 6 exported to {best}" in out
    assert _same(_tensors(best), _tensors(refs[6])) and os.stat(best).st_ino != first.st_ino


def test_a_removed_or_changed_export_is_said_and_written_again(run, tmp_path):
    """The export removed while its checkpoint is there: written again from it (a line says so, exit 0). Changed
    by someone after retention deleted it: the best checkpoint left is written, worse, which is an error line
    (exit 1) naming what was lost; from then on that one is the export to beat."""
    ds, aside, metrics, refs = _best_run(run, tmp_path)
    best = tmp_path / "best.safetensors"
    args = ("watch", run, "--once", "--metric", "loss", "--metrics", metrics, "--export-best", best)
    run_cli(*args, check=0)
    best.unlink()
    proc = run_cli(*args, check=0)
    assert f"{best}: removed since step 1 (loss 0.5) was exported to it: written again from it" in proc.stdout
    assert _same(_tensors(best), _tensors(refs[1])) and proc.stderr == ""
    run_cli(*args, "--keep-last", "1", check=0)        # retention deletes steps 1-2; the export stays
    assert sorted(p.name for p in ds.iterdir() if p.is_dir()) == ["global_step3"]
    assert _same(_tensors(best), _tensors(refs[1]))
    best.write_bytes(b"someone else's file")
    proc = run_cli(*args, check=1)
    assert proc.stderr == f"reshard: {best}: changed since step 1 (loss 0.5) was exported to it, which is " \
                          "deleted: the best checkpoint left is written, a worse one\n"
    assert f"best loss 1: step 3 exported to {best}" in proc.stdout
    assert not _same(_tensors(best), _tensors(refs[1]))
    assert "exported" not in run_cli(*args, check=0).stdout     # said once; step 3 is now what is held


def test_lightning_run_export_best_is_the_callbacks_best(tmp_path):
    out, scores, best_path = lr.lightning_run(tmp_path)
    best = tmp_path / "best.safetensors"
    proc = run_cli("watch", out, "--once", "--keep-best", "1", "--metric", "val_loss", "--export-best", best,
                   check=0)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == len(scores) and all(" val_loss " in line for line in lines)
    from reshard.lifecycle.run_layout import step_of
    newest = max(scores, key=step_of)
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == \
        sorted({os.path.basename(best_path), os.path.basename(newest)})      # the best, and the newest complete
    ref = tmp_path / "ref.safetensors"
    run_cli("export", best_path, ref, check=0)
    assert _same(_tensors(best), _tensors(ref))


class Watching:
    """`reshard watch ARGS` in a subprocess, its output in files under `folder` (a pipe nobody reads could fill
    and stall it); `until` waits for a line, `stop` sends a signal and waits for the exit."""

    def __init__(self, folder, *args):
        self.out, self.err = folder / "watch.out", folder / "watch.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "reshard", "watch", *map(str, args)], stdout=out,
                                         stderr=err, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})

    def until(self, text: str) -> str:
        """Its output once a line holds `text` (fails after TIMEOUT, or when it ended without one)."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            out = self.out.read_text()
            if any(text in line for line in out.splitlines()):
                return out
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} from the watcher:\n{self.out.read_text()}{self.err.read_text()}")

    def stop(self, signum=signal.SIGTERM) -> tuple:
        """(exit status, stdout, stderr) after `signum`."""
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=TIMEOUT)
        return code, self.out.read_text(), self.err.read_text()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:    # a failed test: never leave it running
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_watcher_cleanly_with_exit_0(run, tmp_path, signum):
    with Watching(tmp_path, run, "--interval", "0.2") as watcher:
        watcher.until("step 8:")
        code, out, err = watcher.stop(signum)
    assert code == 0, err
    assert f"stopped ({signal.Signals(signum).name})" in out and "Traceback" not in err
    state = json.loads((run / WATCH_STATE).read_text())     # whole JSON, and what it had reported
    assert sorted(state["seen"]) == [f"ds/global_step{n}" for n in range(1, 9)]


def test_one_watcher_per_directory(run, tmp_path):
    with Watching(tmp_path, run, "--interval", "0.2") as first:
        first.until("step 8:")
        second = run_cli("watch", run, "--once", check=1)
        assert second.stderr == f"reshard: {run}: another reshard watch is watching it (lock " \
                                f"{run / '.reshard-watch.lock'} is held)\n" and second.stdout == ""
        code, _, _ = first.stop()
    assert code == 0
    # the negative control: once the first has stopped, the next one watches (and has nothing new to report)
    assert run_cli("watch", run, "--once", check=0).stdout.splitlines()[-1] == summary(run, 0, 0)
    with reshard.Watcher(run) as api:       # the API lets go at the end of a `with`, or when dropped
        assert api.poll().reported == ()
    for _ in range(2):
        done = reshard.Watcher(run).poll()      # not inside the assert: pytest keeps what an assert evaluated
        assert done.reported == ()


def test_bad_input_one_line_and_the_exit_code(run, tmp_path):
    cases = [((tmp_path / "nowhere", "--once"), 1, "not a directory"),
             ((run, "--once", "--export-best", tmp_path / "x.bin", "--metric", "m"), 2, "one .safetensors file"),
             ((run, "--once", "--export-best", tmp_path / "x.safetensors"), 2, "--export-best needs --metric"),
             ((run, "--once", "--export-best", run / "x.safetensors", "--metric", "m"), 2, "must be outside"),
             ((run, "--once", "--keep-best", "2"), 2, "--keep-best needs --metric"),
             ((run, "--interval", "0"), 2, "not a positive number of seconds")]
    before = lr.snapshot(run)
    for args, code, words in cases:
        proc = run_cli("watch", *args, check=code)
        last = proc.stderr.strip().splitlines()[-1]
        assert words in last and "Traceback" not in proc.stderr and not proc.stdout, proc.stderr
        if code == 1:
            assert proc.stderr.count("\n") == 1      # one line (argparse's usage errors add the usage above it)
    assert lr.snapshot(run) == before
    (run / WATCH_STATE).write_text("{not json")
    proc = run_cli("watch", run, "--once", check=1)
    assert proc.stderr.startswith(f"reshard: {run / WATCH_STATE}: not a reshard watch state")
    assert (run / WATCH_STATE).read_text() == "{not json"


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A DeepSpeed ZeRO-3 run (2 ranks under torchrun) saving each of 8 steps, step 3 saved from rank 0 only and
    step 5 truncated, with `reshard watch` started beside it before the first save; the watcher is stopped by
    SIGTERM once the directory holds what its policy keeps."""
    from tests.helpers.torchrun import run_torchrun
    tmp = tmp_path_factory.mktemp("live")
    run = tmp / "run"
    run.mkdir()
    with Watching(tmp, run, "--keep-last", "2", "--keep-best", "2", "--metric", "eval_loss", "--delete-incomplete",
                  "--interval", "0.5", "--recent", "2") as watcher:
        saved = run_torchrun("lifecycle_deepspeed.py", 2, {"mode": "train", "dir": str(run), "steps": 8,
                                                           "rank0_only": [3], "truncate": [5]}, tmp, "train")
        whole = [t for t in saved if t not in ("global_step3", "global_step5")]
        best = sorted(whole, key=lambda t: (saved[t]["eval_loss"], -int(t[len("global_step"):])))[:2]
        expected = sorted({*best, "global_step7", "global_step8"})
        watcher.until("step 8:")
        deadline = time.monotonic() + TIMEOUT
        while tags(run) != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        code, out, err = watcher.stop()
    return {"run": run, "tmp": tmp, "saved": saved, "expected": expected, "out": out, "err": err, "code": code}


def tags(run) -> list:
    return sorted(p.name for p in run.iterdir() if p.is_dir())


@pytest.mark.engine
def test_watch_beside_a_live_deepspeed_run_reports_each_save_and_flags_the_broken(live_run):
    assert live_run["code"] == 0 and "reshard:" not in live_run["err"] and "Traceback" not in live_run["err"], \
        live_run["err"]
    lines = reported(live_run["out"])
    assert sorted(lines) == list(range(1, 9))
    assert "INCOMPLETE — global_step3/" in lines[3] and "% of elements missing" in lines[3]
    assert "INCOMPLETE — global_step5/" in lines[5]
    saved = live_run["saved"]
    assert len({v["sum"] for v in saved.values()}) == 8       # each step's weights tell it apart (the control)
    for step in (1, 2, 4, 6, 7, 8):
        assert lines[step].startswith(f"step {step}: complete, ")
        assert f"eval_loss {saved[f'global_step{step}']['eval_loss']:g}" in lines[step]
    assert "stopped (SIGTERM)" in live_run["out"]


@pytest.mark.engine
def test_watch_beside_a_live_deepspeed_run_leaves_what_the_policy_keeps_and_the_engine_loads_latest(live_run):
    from tests.helpers.torchrun import run_torchrun
    run = live_run["run"]
    assert tags(run) == live_run["expected"]
    assert (run / "latest").read_text() == "global_step8" and (run / WATCH_STATE).exists()
    loaded = run_torchrun("lifecycle_deepspeed.py", 2, {"mode": "load", "dir": str(run), "tags": [None]},
                          live_run["tmp"], "load")
    assert loaded["None"] == {"loaded": True, "global_steps": 8, "sum": live_run["saved"]["global_step8"]["sum"]}
