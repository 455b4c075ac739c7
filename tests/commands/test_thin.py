"""`reshard thin`: a full checkpoint replaced in place by its framework's weights-only form (issue 39, 3).

Runs are copies of the shipped fixtures laid out as DeepSpeed save dirs (tests/helpers/lifecycle_runs.py), and a real
transformers.Trainer run. The DeepSpeed engine loads the thinned tag folder with its own module-only load
(tests/scripts/engine_resume.py, shared launch); transformers' from_pretrained loads the thinned Trainer checkpoint.
Every proof has its negative control: a thinned file altered in one element.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import reshard
from reshard.core.catalog import TensorKey
from reshard.errors import ReshardError
from reshard.lifecycle import thinning
from tests.helpers.cli import run_cli
from tests.helpers.damage import alter_weight, write_in_zip
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.lifecycle_runs import age, ds_run, hf_run
from tests.helpers.repo import REPO


def rows(save):
    return {r["name"]: r for r in json.loads(run_cli("list", save, "--json").stdout)["checkpoints"]}


def thinned_listing(full, fixture):
    """The files of a thinned tag folder: ZeRO-1/2 its module files alone, ZeRO-3 every file (the optimizer's
    written again with the fp32 partitions alone); and the record."""
    zero3 = json.loads((FIXTURES / fixture / "truth.json").read_text())["zero_stage"] == 3
    return sorted([n for n in os.listdir(full) if zero3 or "optim_states" not in n] + ["reshard-thinned.json"])


@pytest.mark.parametrize("fixture", ["z1_bf16_dp2", "z2_fp32_dp2", "z3_bf16_dp2", "z3_fp32_dp2",
                                     "z3_fp32_frozen_tied_dp2", "z3_fp32_subgroup_dp2"])
def test_thin_deepspeed_tag_folder(tmp_path, fixture):
    save = ds_run(tmp_path, fixture)
    full = tmp_path / "copy" / "full"
    shutil.copytree(save / "global_step2", full)
    dry = run_cli("thin", save / "global_step2", check=0).stdout
    assert "dry run" in dry and "optim_states.pt" in dry
    assert sorted(os.listdir(save / "global_step2")) == sorted(os.listdir(full))     # nothing touched
    before = rows(save)["global_step2"]["bytes"]
    expected = thinning.thinned_bytes(str(save / "global_step2"))
    result = json.loads(run_cli("thin", save / "global_step2", "--yes", "--json", check=0).stdout)
    assert result["executed"] and result["bytes_before"] == before and result["bytes_after"] == expected
    thinned = save / "global_step2"
    assert sorted(os.listdir(thinned)) == thinned_listing(full, fixture)
    assert [n for n in os.listdir(save) if n.startswith(".")] == []         # no working names left
    listed = rows(save)
    assert listed["global_step2"]["status"] == "complete" and listed["global_step2"]["bytes"] == expected
    assert listed["global_step2"]["bytes_by_kind"]["optimizer"] == 0 < listed["global_step3"]["bytes_by_kind"][
        "optimizer"]
    assert "weights-only (thinned from a full deepspeed checkpoint on " in run_cli("inspect", thinned).stdout
    run_cli("validate", thinned, "--deep", check=0)
    # export: bit for bit what the full checkpoint exported (default dtype auto)
    exports = tmp_path / "exports"
    exports.mkdir()
    run_cli("export", full, exports / "full.safetensors", check=0)
    run_cli("export", thinned, exports / "thin.safetensors", check=0)
    assert (exports / "full.safetensors").read_bytes() == (exports / "thin.safetensors").read_bytes()
    report = reshard.diff(str(full), str(thinned))
    assert report.equal and any("only A holds optimizer state" in n for n in report.notes)
    refused = run_cli("convert", thinned, exports / "out", "--to", "dp=1", check=1)
    assert "no optimizer state (weights only)" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert not (exports / "out").exists()


def test_refusals_are_one_line(tmp_path):
    save = ds_run(tmp_path, "z1_bf16_dp2")
    for name, why in (("global_step3", "named by"), ):
        proc = run_cli("thin", save / name, "--yes", check=1)
        assert why in proc.stderr and len(proc.stderr.splitlines()) == 1
    (save / "latest").write_text("global_step1")        # global_step3 now the newest one nothing names
    assert "newest complete checkpoint" in run_cli("thin", save / "global_step3", check=1).stderr
    (save / "latest").write_text("global_step3")
    with open(save / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "r+b") as f:
        f.truncate(100)
    age(save)
    assert "only a complete checkpoint is thinned" in run_cli("thin", save / "global_step2", check=1).stderr
    moe = ds_run(tmp_path / "z3", "autoep2_z3_fp32_dp2")     # a ZeRO-3 mixture of experts: no form built
    refused = run_cli("thin", moe / "global_step2", check=1).stderr
    assert "ZeRO-3 mixture-of-experts" in refused and len(refused.splitlines()) == 1
    assert "--keep-masters" in run_cli("thin", save / "global_step1", "--keep-masters", check=1).stderr
    run_cli("thin", save / "global_step1", "--yes", check=0)
    assert "already weights-only" in run_cli("thin", save / "global_step1", check=1).stderr
    fp32 = ds_run(tmp_path / "fp32", "z2_fp32_dp2")     # fp32: the module files hold the masters themselves
    run_cli("thin", fp32 / "global_step1", "--keep-masters", "--yes", check=0)


@pytest.mark.parametrize("fixture, state, size", [("z1_bf16_dp2", "module", 2), ("z3_bf16_dp2", "fp32", 4)])
def test_an_altered_element_is_caught(tmp_path, fixture, state, size):
    """Negative controls: one element of the thinned weights file (ZeRO-1/2: the module file; ZeRO-3: an optimizer
    file's fp32 partition) changed, its zip CRC left stale (validate --deep reports it) or made to match (the
    comparison with the full checkpoint's weights reports it)."""
    save = ds_run(tmp_path, fixture)
    reshard.thin(str(save / "global_step2"), yes=True)
    pristine = tmp_path / "pristine"
    shutil.copytree(save / "global_step2", pristine)
    alter_weight(save / "global_step2", state, size, crc=False)
    assert "CRC" in run_cli("validate", save / "global_step2", "--deep", check=1).stdout
    shutil.rmtree(save / "global_step2")
    shutil.copytree(pristine, save / "global_step2")
    alter_weight(save / "global_step2", state, size)
    run_cli("validate", save / "global_step2", "--deep", check=0)
    report = reshard.diff(str(save / "global_step1"), str(save / "global_step2"))
    assert not report.equal and "l1.weight" in str(report.to_dict()), report.to_dict()


@shares("engine_resume.py")
def thin_jobs(out):
    """DeepSpeed's module-only load of thinned tag folders, and of one with an element altered (the control)."""
    jobs = []
    for fixture in ("z1_bf16_dp2", "z2_fp32_dp2"):
        save = ds_run(out, fixture)
        reshard.thin(str(save / "global_step2"), yes=True)
        stage = json.loads((FIXTURES / fixture / "truth.json").read_text())["zero_stage"]
        jobs.append((2, None, {"fixture": fixture, "checkpoint": str(save), "tag": "global_step2", "stage": stage,
                               "fixtures": str(FIXTURES), "module_only": True}))
    control = out / "control"
    shutil.copytree(out / "z1_bf16_dp2", control)
    catalog = reshard.open_checkpoint(str(control / "global_step2"))
    fragment = catalog.tensors[TensorKey("l1.weight", "module")].fragments[0]
    at = fragment.storage.offset + fragment.elem_offset * 2
    data = open(fragment.storage.file, "rb").read()[at:at + 2]
    write_in_zip(fragment.storage.file, at, bytes(b ^ 0x40 for b in data))
    jobs.append((2, None, {"fixture": "z1_bf16_dp2", "checkpoint": str(control), "tag": "global_step2", "stage": 1,
                           "fixtures": str(FIXTURES), "module_only": True, "control": True}))
    return jobs


def zero3_load_dir(out, fixture, name):
    """A ZeRO-3 save dir holding its thinned global_step2 alone, `latest` naming it: DeepSpeed 0.19.8's ZeRO-3
    module-only load reads the weights of the tag `latest` names (zero_to_fp32), whatever tag it is given."""
    save = ds_run(out / name, fixture)
    reshard.thin(str(save / "global_step2"), yes=True)
    for other in ("global_step1", "global_step3"):
        shutil.rmtree(save / other)
    (save / "latest").write_text("global_step2")
    return save


@shares("engine_resume.py")
def zero3_thin_jobs(out):
    """DeepSpeed's module-only load of thinned ZeRO-3 tag folders (bf16, fp32), and its controls: an element of the
    thinned fp32 partitions altered; the thinned tag asked for while `latest` names another step's weights (a copy
    with one element altered); and the load with load_optimizer_states=True, which takes no ZeRO-3 weights."""
    jobs = []
    for fixture in ("z3_bf16_dp2", "z3_fp32_dp2"):
        save = zero3_load_dir(out, fixture, "thinned")
        job = {"fixture": fixture, "checkpoint": str(save), "tag": "global_step2", "stage": 3,
               "fixtures": str(FIXTURES), "module_only": True}
        jobs.append((2, None, job))
    altered = zero3_load_dir(out, "z3_bf16_dp2", "altered")
    alter_weight(altered / "global_step2", "fp32", 4)
    jobs.append((2, None, {**jobs[0][2], "checkpoint": str(altered), "control": "altered"}))
    other = zero3_load_dir(out, "z3_bf16_dp2", "other")
    shutil.copytree(other / "global_step2", other / "global_step3")
    alter_weight(other / "global_step3", "fp32", 4)
    (other / "latest").write_text("global_step3")
    jobs.append((2, None, {**jobs[0][2], "checkpoint": str(other), "control": "latest names another"}))
    jobs.append((2, None, {**jobs[0][2], "load_optimizer_states": True, "control": "load_optimizer_states"}))
    return jobs


@pytest.mark.engine
def test_deepspeed_module_only_load_of_thinned(engine_launches):
    results = list(engine_launches.results(thin_jobs))
    assert len(results) == 3
    for result in results:
        if result.get("control"):
            assert any("l1.weight" in p for p in result["problems"]), result
        else:
            assert result["problems"] == [], result


@pytest.mark.engine
def test_deepspeed_module_only_load_of_thinned_zero3(engine_launches):
    """Every weight of the thinned ZeRO-3 save (bf16 and fp32, dp=2) loaded by the engine's module-only load is the
    full checkpoint's, bit for bit in the training dtype; each control differs in the altered weight alone, or, where
    the load takes nothing from the checkpoint, in every weight."""
    results = list(engine_launches.results(zero3_thin_jobs))
    assert [r.get("control") for r in results] == [None, None, "altered", "latest names another",
                                                   "load_optimizer_states"]
    for result in results[:2]:
        assert result["problems"] == [], result
    for result in results[2:4]:
        assert result["problems"] == ["module/l1.weight: differs from the full checkpoint's weights"], result
    trained = json.loads((FIXTURES / "z3_bf16_dp2" / "truth.json").read_text())["trainable"]
    assert len(results[4]["problems"]) == len(trained), results[4]


def test_hf_trainer_thin_loads_with_from_pretrained(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import GPT2LMHeadModel
    out, state = hf_run(tmp_path)
    best = os.path.basename(state.best_model_checkpoint)
    target = next(f"checkpoint-{s}" for s in (2, 4, 6) if f"checkpoint-{s}" != best)
    full = tmp_path / "full"
    shutil.copytree(out / target, full)
    assert "named by" in run_cli("thin", out / best, "--yes", check=1).stderr
    run_cli("thin", out / target, "--yes", check=0)
    thinned = out / target
    assert "optimizer.pt" not in os.listdir(thinned)
    assert {"trainer_state.json", "scheduler.pt", "config.json"} <= set(os.listdir(thinned))
    assert rows(out)[target]["status"] == "complete"
    a, b = (GPT2LMHeadModel.from_pretrained(p).state_dict() for p in (full, thinned))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights = load_file(thinned / "model.safetensors")      # the control: one element changed is seen
    name = next(iter(weights))
    weights[name].view(-1)[0] += 1
    save_file(weights, thinned / "model.safetensors", metadata={"format": "pt"})
    c = GPT2LMHeadModel.from_pretrained(thinned).state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_recover_before_the_swap_keeps_the_full_checkpoint(tmp_path):
    save = ds_run(tmp_path, "z1_bf16_dp2")
    subprocess.run([sys.executable, "-m", "reshard", "thin", str(save / "global_step2"), "--yes"], cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO), thinning.FAULT_AT: "journal"}, capture_output=True)
    assert thinning.recover(str(save)) == [str(save / "global_step2")]
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in os.listdir(save / "global_step2")
    with pytest.raises(ReshardError):
        reshard.thin(str(save / "global_step3"))
