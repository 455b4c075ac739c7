"""Accelerate + FSDP, read whole: fixtures/accelerate_fsdp_sharded_dp2/state is what the real Accelerate save_state
wrote with FSDP2's sharded state dict at 2 processes (tools/fixture_accelerate_fsdp.py: accelerate 1.16, transformers
5.21, torch 2.13; FSDP on CPU through the test-only shim tests/helpers/cpu_fsdp.py). The truth is read from the same
files with torch's own dcp_to_torch_save, independently of reshard; the export is loaded by `from_pretrained`. Negative
controls: a process's missing random_states, a scheduler.bin naming a global off the allow-list, one changed element
found by `diff`.
"""
import json
import os
import shutil

import pytest
import torch

from tests.formats.framework.test_hf_fsdp import STATES, config, consolidated, one_step_behind_is_carried_or_refused
from tests.helpers.cli import run_cli
from tests.helpers.repo import REPO

SOURCE = REPO / "fixtures" / "accelerate_fsdp_sharded_dp2" / "state"
ACCELERATE = {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"}


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    """The save as torch's dcp_to_torch_save consolidates it: (model state dict, optimizer state dict)."""
    return consolidated(SOURCE, tmp_path_factory.mktemp("truth"))


def test_inspect_names_accelerate_and_fsdp():
    assert set(os.listdir(SOURCE)) == ACCELERATE | {"pytorch_model_fsdp_0", "optimizer_0"}
    info = json.loads(run_cli("inspect", SOURCE, "--json", check=0).stdout)
    assert info["format"] == "fsdp" and info["problems"] == 0
    assert info["framework"]["title"] == "Accelerate + FSDP (sharded state dict), dp=2"
    assert info["framework"]["backend"] == "FSDP (sharded state dict)"
    assert {f["path"] for f in info["framework"]["files"]} == ACCELERATE


def test_validate_proves_model_and_optimizer_complete(truth):
    report = json.loads(run_cli("validate", SOURCE, "--deep", "--json", check=0).stdout)
    assert report["ok"] and report["problems"] == [] and report["missing_elements"] == 0
    info = json.loads(run_cli("inspect", SOURCE, "--json", check=0).stdout)
    # the optimizer's keys met the model's: every parameter trainable, in the run's two groups
    assert (info["trainable"], info["frozen"], info["buffers"]) == (21, 0, 0)
    assert info["optimizer_states"] == list(STATES) and info["step"] == 3
    assert [g["params"] for g in info["param_groups"]] == [len(g["params"]) for g in truth[1]["param_groups"]] \
        == [16, 5]


def test_export_is_loaded_by_from_pretrained_and_equals_torchs_reading(truth, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    model_truth, optim_truth = truth
    run_cli("export", SOURCE, tmp_path / "hf", "--with-optimizer", "--quiet", check=0)
    config().save_pretrained(tmp_path / "hf")       # Accelerate's save_state writes no config: the user gives it
    state = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(state) == set(model_truth) and all(torch.equal(state[k], model_truth[k]) for k in model_truth)
    for name in STATES:
        exported = load_file(str(tmp_path / "hf" / f"optimizer-{name}.safetensors"))
        assert set(exported) == set(optim_truth["state"])
        assert all(torch.equal(exported[k], optim_truth["state"][k][name]) for k in exported)
    meta = json.loads((tmp_path / "hf" / "optimizer.json").read_text())
    assert [g["params"] for g in meta["param_groups"]] == [g["params"] for g in optim_truth["param_groups"]]
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.01, 0.0]


def test_diff_against_deepspeed_and_one_changed_element(truth, tmp_path):
    """The folder converted to Accelerate's DeepSpeed layout is equal to it; one element changed in
    torch's own consolidation is found."""
    from safetensors.torch import save_file
    run_cli("convert", SOURCE, tmp_path / "ds", "--format", "deepspeed", "--to", "dp=3,zero=2", "--quiet", check=0)
    assert "no difference: 63 tensors" in run_cli("diff", SOURCE, tmp_path / "ds", check=0).stdout
    changed = {k: v.clone() for k, v in truth[0].items()}
    changed["model.layers.0.self_attn.q_proj.weight"][2, 7] += 1e-3
    save_file(changed, str(tmp_path / "changed.safetensors"))
    proc = run_cli("diff", SOURCE, tmp_path / "changed.safetensors")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "model.layers.0.self_attn.q_proj.weight (weight): max abs diff 0.000999998 at element 39" in proc.stdout
    assert "DIFFERENT: 1 difference" in proc.stdout


def test_side_files_are_checked_and_pickles_go_through_the_allow_list(tmp_path):
    import os as os_module
    broken = tmp_path / "state"
    shutil.copytree(SOURCE, broken)
    (broken / "random_states_1.pkl").unlink()
    proc = run_cli("validate", broken)
    assert proc.returncode != 0
    assert f"{broken / 'random_states_1.pkl'}: missing (RNG states and the accelerator's step of process 1 of a " \
        "2-process run)" in proc.stdout

    class Hostile:
        def __reduce__(self):
            return (os_module.system, ("echo unpickled",))
    torch.save({"last_epoch": Hostile()}, broken / "scheduler.bin")
    proc = run_cli("inspect", broken)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        f"reshard: {broken / 'scheduler.bin'}: refusing to unpickle global posix.system (not on reshard's "
        "allow-list; nothing was executed)"]


def test_per_parameter_steps_and_param_groups_are_carried_or_refused(truth, tmp_path):
    """One parameter's Adam step behind the others (torch's own torch_save_to_dcp rewrites optimizer_0/): Accelerate's
    FSDP layout at 3 processes carries every parameter's own step and both param groups exactly (read back with
    dcp_to_torch_save); Accelerate's DeepSpeed layout, one step per group, is refused in one line naming the file."""
    source = tmp_path / "state"
    shutil.copytree(SOURCE, source)
    fsdp3 = one_step_behind_is_carried_or_refused(
        source, truth[1], "model.norm.weight", "param group 1: optimizer step differs between parameters (3 at "
        "model.layers.0.input_layernorm.weight vs 2 at model.norm.weight); a DeepSpeed checkpoint keeps one per "
        "group, so it is not written", tmp_path)
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"} <= \
        set(os.listdir(fsdp3))
