"""A training framework's files around a DeepSpeed save (HF Trainer's checkpoint-N/): what becomes of each at
another world size (carried, rewritten, dropped), the per-process policy, and that none is ever unpickled.

The folders here are a real DeepSpeed save (a fixture) with the Trainer's files beside `latest`; the files'
contents are arbitrary bytes (a hostile pickle for training_args.bin), since reshard only copies them. The
real Trainer's folder and its resume are tests/formats/framework/test_hf_trainer_deepspeed.py's.
"""
import hashlib
import json
import os
import shutil

import pytest

from reshard.errors import ReshardError
from reshard.formats.framework import (
    CARRIED,
    COPIED,
    COPY_RANK0,
    DROPPED,
    FAIL,
    FRESH,
    NONE,
    REWRITTEN,
    Framework,
    FrameworkFile,
)
from reshard.formats.framework.hf_trainer import RNG
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir
from tests.helpers.trainer_folders import hf_folder


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def framework(world, names):
    files = tuple(FrameworkFile(n, RNG.what if RNG.rank_of(n) is not None else "state", 10, RNG.rank_of(n),
                                RNG if RNG.rank_of(n) is not None else None) for n in names)
    return Framework("HF Trainer", "/ckpt", files, (RNG,), world=world)


def table(dispositions) -> dict:
    return {(d.source, d.target): d.action for d in dispositions}


# -- the policy, on the typed description ---------------------------------------------------------------------

def test_two_processes_to_one_renames_rank0_and_drops_rank1():
    f = framework(2, ["rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"])
    assert table(f.dispositions(1)) == {("rng_state_0.pth", "rng_state.pth"): REWRITTEN,
                                        ("rng_state_1.pth", None): DROPPED,
                                        ("trainer_state.json", "trainer_state.json"): CARRIED}


def test_one_process_to_two_renames_and_gives_the_new_process_nothing_by_default():
    f = framework(1, ["rng_state.pth", "scheduler.pt"])
    assert table(f.dispositions(2)) == {("rng_state.pth", "rng_state_0.pth"): REWRITTEN,
                                        (None, "rng_state_1.pth"): NONE,
                                        ("scheduler.pt", "scheduler.pt"): CARRIED}
    assert table(f.dispositions(2, COPY_RANK0))[("rng_state.pth", "rng_state_1.pth")] == COPIED


def test_two_processes_to_three_keeps_both_and_the_policy_decides_the_third():
    f = framework(2, ["rng_state_0.pth", "rng_state_1.pth"])
    assert table(f.dispositions(3, FRESH)) == {("rng_state_0.pth", "rng_state_0.pth"): CARRIED,
                                               ("rng_state_1.pth", "rng_state_1.pth"): CARRIED,
                                               (None, "rng_state_2.pth"): NONE}
    assert table(f.dispositions(3, COPY_RANK0))[("rng_state_0.pth", "rng_state_2.pth")] == COPIED
    with pytest.raises(ReshardError, match=r"rng_state_0\.pth: process 2 of 3 would have no RNG states"):
        f.dispositions(3, FAIL)
    assert table(f.dispositions(2, FAIL)) == {("rng_state_0.pth", "rng_state_0.pth"): CARRIED,
                                              ("rng_state_1.pth", "rng_state_1.pth"): CARRIED}


def test_a_run_that_saved_no_rng_state_gets_none_at_any_size():
    f = framework(2, ["trainer_state.json"])
    assert table(f.dispositions(3, FAIL)) == {("trainer_state.json", "trainer_state.json"): CARRIED}
    assert f.missing() == []


def test_a_missing_process_file_is_a_problem_naming_it():
    assert list(map(str, framework(2, ["rng_state_0.pth"]).missing())) == [
        "/ckpt/rng_state_1.pth: missing (RNG states of process 1 of a 2-process run)"]
    assert framework(2, ["rng_state_0.pth"]).missing()[0].file == "/ckpt/rng_state_1.pth"
    assert framework(1, ["rng_state.pth"]).missing() == []


# -- convert and plan on a folder ------------------------------------------------------------------------------

@pytest.mark.parametrize("dp, rng", [(1, {"rng_state.pth": 0}), (2, {"rng_state_0.pth": 0, "rng_state_1.pth": 1}),
                                     (3, {"rng_state_0.pth": 0, "rng_state_1.pth": 1})])
def test_convert_writes_the_whole_folder_the_trainer_writes_at_the_target_size(tmp_path, dp, rng):
    src = hf_folder(tmp_path)
    before = {n: sha(src / n) for n in os.listdir(src) if (src / n).is_file()}
    out = tmp_path / "out" / "checkpoint-3"
    proc = run_cli("convert", src, out, "--to", f"dp={dp}", check=0)
    names = set(os.listdir(out))
    shared = {"trainer_state.json", "scheduler.pt", "training_args.bin", "config.json"}
    assert shared | set(rng) | {"latest", "global_step3", "zero_to_fp32.py", "zero_to_torch.py",
                                "reshard-manifest.json"} == names
    for name in shared:
        assert sha(out / name) == before[name], name          # byte for byte (the hostile pickle too)
    for name, rank in rng.items():
        assert sha(out / name) == before[f"rng_state_{rank}.pth"], name
    assert {n: sha(src / n) for n in before} == before          # the source untouched
    for name in shared:
        assert name in proc.stdout
    run_cli("validate", out, "--checksums", check=0)
    assert f"HF Trainer + DeepSpeed ZeRO-2, dp={dp}" in run_cli("inspect", out, check=0).stdout


def test_copy_rank0_gives_a_new_process_rank0s_bytes(tmp_path):
    src = hf_folder(tmp_path)
    out = tmp_path / "out"
    run_cli("convert", src, out, "--to", "dp=3", "--new-rank-state", "copy-rank0", "--quiet", check=0)
    assert sha(out / "rng_state_2.pth") == sha(src / "rng_state_0.pth")


def test_fail_policy_refuses_in_one_line_and_writes_nothing(tmp_path):
    src = hf_folder(tmp_path)
    out = tmp_path / "out"
    for command in (["plan", src], ["convert", src, out]):
        proc = run_cli(*command, "--to", "dp=3", "--new-rank-state", "fail", check=1)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"reshard: {src / 'rng_state_0.pth'}: process 2 of 3"), \
            proc.stderr
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    run_cli("convert", src, out, "--to", "dp=2", "--new-rank-state", "fail", "--quiet", check=0)


def test_plan_lists_every_framework_file_the_policy_and_the_batch_setting(tmp_path):
    src = hf_folder(tmp_path)
    (src / "notes.txt").write_text("the user's own file")
    text = run_cli("plan", src, "--to", "dp=1", check=0).stdout
    for name, action in [("trainer_state.json", "carried"), ("scheduler.pt", "carried"),
                         ("training_args.bin", "carried"), ("config.json", "carried"), ("notes.txt", "carried"),
                         ("rng_state_0.pth -> rng_state.pth", "rewritten"), ("rng_state_1.pth", "dropped")]:
        assert any(line.split() and line.strip().startswith(name) and f"{action}:" in line
                   for line in text.splitlines()), (name, text)
    assert "--new-rank-state fresh" in text
    assert "exact reproducibility across world sizes is impossible" in text
    advice = next(line for line in text.splitlines() if line.startswith("advice"))
    assert "gradient_accumulation_steps 1 -> 2" in advice and "TrainingArguments" in advice
    summary = json.loads(run_cli("plan", src, "--to", "dp=3", "--json", check=0).stdout)
    files = {(f["source"], f["target"]): f["action"] for f in summary["framework"]["files"]}
    assert files[(None, "rng_state_2.pth")] == NONE and summary["framework"]["new_rank_state"] == "fresh"
    assert "no whole gradient_accumulation_steps (micro batch 2) or micro batch size keeps 4 at dp=3" in \
        summary["advice"]       # 2 per process x 2 processes: no setting keeps it at 3


def test_another_output_format_carries_no_framework_file(tmp_path):
    src = hf_folder(tmp_path)
    summary = json.loads(run_cli("plan", src, "--format", "dcp", "--json", check=0).stdout)
    assert {f["action"] for f in summary["framework"]["files"]} == {DROPPED}
    assert not any(f["path"] == "trainer_state.json" for f in summary["files"])


def test_a_plain_deepspeed_save_dir_has_no_framework(tmp_path):
    summary = json.loads(run_cli("plan", fixture_dir("z2_fp32_dp2"), "--to", "dp=3", "--json", check=0).stdout)
    assert "framework" not in summary


# -- inspect and validate ----------------------------------------------------------------------------------------

def test_inspect_names_the_framework_and_lists_its_files(tmp_path):
    src = hf_folder(tmp_path)
    text = run_cli("inspect", src, check=0).stdout
    assert "format        HF Trainer + DeepSpeed ZeRO-2, dp=2 (tag global_step3)" in text
    for name in ("trainer_state.json", "scheduler.pt", "training_args.bin", "config.json", "rng_state_1.pth"):
        assert f"    {name} " in text, name
    info = json.loads(run_cli("inspect", src, "--json", check=0).stdout)
    assert {f["path"]: f["rank"] for f in info["framework"]["files"]}["rng_state_1.pth"] == 1


def test_validate_names_a_missing_rng_state_of_a_two_process_run(tmp_path):
    src = hf_folder(tmp_path, ranks=(0,))
    proc = run_cli("validate", src, check=1)
    assert f"{src / 'rng_state_1.pth'}: missing (RNG states of process 1 of a 2-process run)" in proc.stdout
    proc = run_cli("convert", src, tmp_path / "out", "--to", "dp=1", check=1)
    assert "rng_state_1.pth: missing" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_export_of_the_folder_copies_config_and_tokenizer_beside_the_weights(tmp_path):
    src = hf_folder(tmp_path)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    out = tmp_path / "hf"
    run_cli("export", src, out, "--quiet", check=0)
    assert set(os.listdir(out)) == {"model.safetensors", "config.json", "tokenizer.json", "reshard-manifest.json"}
    for name in ("config.json", "tokenizer.json"):
        assert sha(out / name) == sha(src / name)
    run_cli("export", src, tmp_path / "one.safetensors", "--quiet", check=0)     # one file: nothing beside it
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint-3", "hf", "one.safetensors",
                                                   "one.safetensors.reshard-manifest.json"])


def test_accelerate_numbers_its_random_states_at_any_size(tmp_path):
    folder = tmp_path / "state"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), folder)
    for name in ("random_states_0.pkl", "random_states_1.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"):
        (folder / name).write_bytes(name.encode() * 3)
    summary = json.loads(run_cli("plan", folder, "--to", "dp=1", "--json", check=0).stdout)
    assert summary["framework"]["name"] == "Accelerate"
    assert {(f["source"], f["target"]): f["action"] for f in summary["framework"]["files"]} == {
        ("custom_checkpoint_0.pkl", "custom_checkpoint_0.pkl"): CARRIED, ("scheduler.bin", "scheduler.bin"): CARRIED,
        ("random_states_0.pkl", "random_states_0.pkl"): CARRIED, ("random_states_1.pkl", None): DROPPED}
    out = tmp_path / "dp3"
    run_cli("convert", folder, out, "--to", "dp=3", "--new-rank-state", "copy-rank0", "--quiet", check=0)
    assert sha(out / "random_states_2.pkl") == sha(folder / "random_states_0.pkl")
    assert sha(out / "scheduler.bin") == sha(folder / "scheduler.bin")
    assert "Accelerate + DeepSpeed ZeRO-2, dp=3" in run_cli("inspect", out, check=0).stdout


def test_convert_json_says_what_became_of_each_framework_file(tmp_path):
    src = hf_folder(tmp_path)
    written = json.loads(run_cli("convert", src, tmp_path / "out", "--to", "dp=1", "--json", check=0).stdout)
    files = {(f["source"], f["target"]): f["action"] for f in written["framework_files"]}
    assert files[("rng_state_0.pth", "rng_state.pth")] == REWRITTEN and files[("rng_state_1.pth", None)] == DROPPED
    assert {f["path"] for f in written["files"]} >= {str(tmp_path / "out" / "rng_state.pth")}
