"""validate: complete fixtures pass; each kind of damage is caught, named, and exits 1."""
import json
import shutil

import pytest
import torch

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.damage import ODD_STEP, set_step
from tests.helpers.fixtures import copy_fixture, fixture_dir, tag_dir


def test_every_fixture_is_complete(fixture_name):
    report = reshard.validate(reshard.open_checkpoint(fixture_dir(fixture_name)), deep=True)
    assert report.ok, report.problems
    assert report.missing_elements == 0 and report.duplicate_elements == 0 and report.elements > 0


def _problems(save, deep=False):
    proc = run_cli("validate", save, *(["--deep"] if deep else []))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    *problems, summary = proc.stdout.strip().splitlines()
    assert summary.startswith("NOT complete")
    return problems, summary


def test_missing_rank_file(tmp_path):
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    victim = tag_dir(save) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    problems, _ = _problems(save)
    assert any(str(victim) in p and "missing" in p for p in problems)


def test_a_gap_names_no_file_that_holds_the_rest(tmp_path):
    """The elements a missing rank file held are missing from the checkpoint: a gap line names the checkpoint, not
    a neighbouring rank's file that holds the tensor's other elements."""
    save = copy_fixture("z2_fp32_dp4", tmp_path)
    victim = tag_dir(save) / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    victim.unlink()
    problems, _ = _problems(save)
    gaps = [p for p in problems if "elements missing" in p]
    assert gaps and all(p.startswith(f"{tag_dir(save)}: ") for p in gaps), gaps
    assert [p for p in problems if "zero_pp_rank_" in p] == [f"{victim}: missing (expected for data-parallel rank 2)"]


def test_zero3_with_only_rank0_saved_reports_the_missing_fraction(tmp_path):
    save = copy_fixture("z3_fp32_dp4", tmp_path)
    for path in tag_dir(save).glob("*zero_pp_rank_[123]_*"):
        path.unlink()
    report = reshard.validate(reshard.open_checkpoint(save))
    assert not report.ok
    # rank 0 holds a quarter of every partitioned tensor; buffers live in its model-states file
    assert 0.6 < report.missing_fraction < 0.76
    problems, summary = _problems(save)
    assert "elements missing" in summary and "%" in summary
    for rank in (1, 2, 3):
        assert any(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt: missing" in p for p in problems)
        assert any(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt: missing" in p for p in problems)


@pytest.mark.parametrize("keep", [0, 100, 0.5, -100])
def test_truncated_or_empty_file(tmp_path, keep):
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    victim = tag_dir(save) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    victim.write_bytes(data[:cut])
    problems, _ = _problems(save)
    expected = "empty" if cut == 0 else ""
    assert any(str(victim) in p and expected in p for p in problems), problems


def test_file_from_another_step_mixed_in(tmp_path):
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(save / "global_step2" / name, tag_dir(save) / name)
    problems, _ = _problems(save)
    assert any(name in p and "another save" in p for p in problems), problems


def test_zero3_model_states_from_another_step(tmp_path):
    save = copy_fixture("z3_fp32_dp2", tmp_path)
    victim = tag_dir(save) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    sd = torch.load(victim, weights_only=False)
    sd["global_steps"] = 2
    torch.save(sd, victim)
    problems, _ = _problems(save)
    first = victim.parent / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert any(p.startswith(f"{victim}: global_steps is 2 here, 3 in {first}") for p in problems), problems


@pytest.mark.parametrize("name", ["z2_fp32_dp2", "z3_fp32_dp2"])
def test_optimizer_partition_of_the_wrong_size(tmp_path, name):
    save = copy_fixture(name, tmp_path)
    victim = tag_dir(save) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(victim, weights_only=False)
    inner = sd["optimizer_state_dict"]
    state = inner["base_optimizer_state"]["state"][0] if "base_optimizer_state" in inner \
        else inner["optimizer_state_dict"]["state"][0]
    state["exp_avg"] = state["exp_avg"][:-3].clone()
    torch.save(sd, victim)
    problems, _ = _problems(save)
    assert any(str(victim) in p and "exp_avg" in p and "expected" in p for p in problems), problems


def test_deep_finds_nan(tmp_path):
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    victim = tag_dir(save) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = torch.load(victim, weights_only=False)
    sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"][5] = float("nan")
    torch.save(sd, victim)
    assert run_cli("validate", save).returncode == 0          # the geometry is fine
    problems, _ = _problems(save, deep=True)
    assert any(str(victim) in p and "NaN/Inf" in p for p in problems), problems


def test_deep_counts_bf16_nan_and_inf(tmp_path):
    """bf16 has no numpy dtype: its NaN and Inf are found by their exponent bits (a negative Inf, a NaN)."""
    save = copy_fixture("z1_bf16_dp2", tmp_path)
    victim = tag_dir(save) / "mp_rank_00_model_states.pt"
    sd = torch.load(victim, weights_only=False)
    name, weight = next((k, v) for k, v in sd["module"].items() if v.dtype == torch.bfloat16)
    weight.view(-1)[1] = float("nan")
    weight.view(-1)[-1] = float("-inf")
    torch.save(sd, victim)
    problems, _ = _problems(save, deep=True)
    assert any(str(victim) in p and name in p and "2 NaN/Inf" in p for p in problems), problems


def test_json_and_usage_errors(tmp_path):
    proc = run_cli("validate", fixture_dir("z2_fp32_dp2"), "--json", check=0)
    data = json.loads(proc.stdout)
    assert data["ok"] and data["problems"] == [] and data["missing_fraction"] == 0
    assert run_cli("validate").returncode == 2
    assert run_cli("validate", "--bogus", fixture_dir("z2_fp32_dp2")).returncode == 2
    proc = run_cli("validate", tmp_path / "nowhere", check=1)
    assert "nowhere" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("validate", fixture_dir("z2_fp32_dp2"), "--tag", "global_step9", check=1)
    assert "global_step9" in proc.stderr
    proc = run_cli("validate", fixture_dir("z2_fp32_dp2"), "--tag", "global_step2", check=0)


def test_checksums_without_a_manifest_are_unverified_not_a_problem(tmp_path):
    """A training save has no manifest: `--checksums` says the sums could not be verified, and the coverage
    verdict stands (complete: exit 0; a missing rank file: exit 1, for that). The negative control: a manifest
    with one wrong digest fails, exit 1, naming the file."""
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    places = f"{tag_dir(save)}/reshard-manifest.json or {save}/reshard-manifest.json"
    proc = run_cli("validate", save, "--checksums", check=0)
    assert proc.stdout.splitlines() == [f"checksums: not verified (no manifest: {places})",
                                        "complete; 34 logical tensors, 5,604 elements in 3 files"]
    data = json.loads(run_cli("validate", save, "--checksums", "--json", check=0).stdout)
    assert data["ok"] and data["problems"] == [] and not data["checksums_verified"]
    assert data["checksums_unverified"] == places
    (tag_dir(save) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    *problems, unverified, summary = run_cli("validate", save, "--checksums", check=1).stdout.splitlines()
    assert summary.startswith("NOT complete: ") and unverified.startswith("checksums: not verified")
    assert all("manifest" not in p for p in problems) and any("optim_states.pt: missing" in p for p in problems)

    out = tmp_path / "converted"
    run_cli("convert", fixture_dir("z2_fp32_dp2"), out, "--to", "dp=3", "--quiet", check=0)
    proc = run_cli("validate", out, "--checksums", check=0)
    assert "not verified" not in proc.stdout and "sizes and digests" in proc.stdout
    manifest = json.loads((out / "reshard-manifest.json").read_text())
    victim = "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    manifest["files"][victim]["blake3"] = "0" * 64
    (out / "reshard-manifest.json").write_text(json.dumps(manifest))
    *problems, summary = run_cli("validate", out, "--checksums", check=1).stdout.splitlines()
    assert summary.startswith("NOT complete: 1 problem") and "not verified" not in "".join(problems)
    assert [p for p in problems if victim in p and "blake3" in p] == problems


def test_a_manifest_written_with_sha256_still_verifies(tmp_path):
    """A checkpoint converted before BLAKE3 was the default: its manifest's entries are {"size", "sha256"} (the
    manifest of a conversion rewritten so, each sum computed by hashlib): validate --checksums verifies it by
    sha256; the control, one sum wrong, fails naming the file; an entry naming no digest is a problem too."""
    import hashlib
    out = tmp_path / "converted"
    run_cli("convert", fixture_dir("z2_fp32_dp2"), out, "--to", "dp=3", "--quiet", check=0)
    path = out / "reshard-manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {rel: {"size": entry["size"], "sha256": hashlib.sha256((out / rel).read_bytes()).hexdigest()}
                         for rel, entry in manifest["files"].items()}
    path.write_text(json.dumps(manifest))
    proc = run_cli("validate", out, "--checksums", check=0)
    assert "sizes and digests" in proc.stdout and proc.stdout.splitlines()[-1].startswith("complete")
    victim = "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    manifest["files"][victim]["sha256"] = hashlib.sha256(b"another file").hexdigest()
    path.write_text(json.dumps(manifest))
    *problems, summary = run_cli("validate", out, "--checksums", check=1).stdout.splitlines()
    assert summary.startswith("NOT complete: 1 problem")
    assert [p for p in problems if victim in p and "sha256 differs" in p] == problems
    del manifest["files"][victim]["sha256"]
    path.write_text(json.dumps(manifest))
    *problems, summary = run_cli("validate", out, "--checksums", check=1).stdout.splitlines()
    assert any(f"no digest for {victim}" in p for p in problems)


@pytest.mark.parametrize("name", ["z2_fp32_dp4", "z3_fp32_dp4"])
@pytest.mark.parametrize("rank", [0, 2])
def test_the_rank_whose_step_disagrees_is_the_one_named(tmp_path, name, rank):
    """One rank's step 3.0000002 among 4 ranks' 3: that rank's file is named, the only problem (rank 0's used to
    blame the three healthy ranks). The negative control: the untouched copy is complete."""
    save = copy_fixture(name, tmp_path)
    run_cli("validate", save, check=0)
    victim = tag_dir(save) / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    set_step(victim, 3.0000002)
    problems, _ = _problems(save)
    assert problems == [f"{victim}: {ODD_STEP}"]


def test_two_ranks_two_steps_both_are_named_with_their_values(tmp_path):
    """Two ranks disagreeing: nothing tells which is right, so both files are named, each with both values."""
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    first, second = (tag_dir(save) / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    set_step(second, 3.0000002)
    problems, _ = _problems(save)
    tail = "and no value is held by most files: which is right is not known (a file from another save?)"
    assert problems == [
        f"{first}: param group 0: optimizer step is 3.0 here, 3.000000238418579 in {second}, {tail}",
        f"{second}: param group 0: optimizer step is 3.000000238418579 here, 3.0 in {first}, {tail}"]
