"""Accelerate + FSDP, read whole, in both of the state dicts Accelerate's save_state writes with FSDP2 at 2 processes,
in one launch on the same data (tools/fixture_accelerate_fsdp.py: accelerate 1.16, transformers 5.21, torch 2.13; FSDP
on CPU through the test-only shim tests/helpers/cpu_fsdp.py): fixtures/accelerate_fsdp_sharded_dp2/state (the sharded
state dict) and fixtures/accelerate_fsdp_full_dp2/state (FULL_STATE_DICT). The truth is read from the same files with
torch's own tools, independently of reshard (dcp_to_torch_save of the sharded folders, torch.load of the full files);
the export is loaded by `from_pretrained`. Negative controls: a process's missing random_states, a pickle naming a
global off the allow-list, one changed element found by `diff`.
"""
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.helpers.fsdp_steps import config, one_step_behind_is_carried_or_refused
from tests.helpers.fsdp_truths import STATES, consolidated
from tests.helpers.repo import REPO

SOURCE = REPO / "fixtures" / "accelerate_fsdp_sharded_dp2" / "state"
FULL = REPO / "fixtures" / "accelerate_fsdp_full_dp2" / "state"
ACCELERATE = {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"}


@dataclass(frozen=True)
class Form:
    """One state dict of the run: its folder, what is particular to its files, and the tensor one test changes."""
    folder: Path
    state_dict: str                 # as `inspect` names it: "sharded" or "full"
    own_files: frozenset[str]       # FSDP's files beside Accelerate's
    missing_process: int            # whose random_states the negative control removes
    hostile: tuple[str, str]        # (the pickle replaced by one naming os.system, the key it is put under)
    changed: tuple[str, tuple[int, int], str]   # (tensor, index, `diff`'s line for it)


SHARDED_FORM = Form(SOURCE, "sharded", frozenset({"pytorch_model_fsdp_0", "optimizer_0"}), 1,
                    ("scheduler.bin", "last_epoch"),
                    ("model.layers.0.self_attn.q_proj.weight", (2, 7), "max abs diff 0.000999998 at element 39"))
FULL_FORM = Form(FULL, "full", frozenset({"pytorch_model_fsdp.bin", "optimizer.bin"}), 0, ("optimizer.bin", "state"),
                 ("model.layers.1.mlp.up_proj.weight", (3, 5), "max abs diff 0.001 at element 53"))


@pytest.fixture(scope="module", params=[SHARDED_FORM, FULL_FORM], ids=lambda form: form.state_dict)
def form(request) -> Form:
    return request.param


@pytest.fixture(scope="module")
def truth(form, tmp_path_factory):
    """The save as torch reads it: (model state dict, optimizer state dict)."""
    if form.state_dict == "sharded":
        return consolidated(form.folder, tmp_path_factory.mktemp("truth"))
    return torch.load(form.folder / "pytorch_model_fsdp.bin"), torch.load(form.folder / "optimizer.bin")


def test_inspect_names_accelerate_and_fsdp(form):
    assert set(os.listdir(form.folder)) == ACCELERATE | form.own_files
    info = json.loads(run_cli("inspect", form.folder, "--json", check=0).stdout)
    assert info["problems"] == 0
    assert info["framework"]["title"] == f"Accelerate + FSDP ({form.state_dict} state dict), dp=2"
    assert info["framework"]["backend"] == f"FSDP ({form.state_dict} state dict)"
    assert {f["path"] for f in info["framework"]["files"]} == ACCELERATE


def test_the_sharded_state_dict_is_read_as_fsdp():
    assert json.loads(run_cli("inspect", SOURCE, "--json", check=0).stdout)["format"] == "fsdp"


def test_validate_proves_model_and_optimizer_complete(form, truth):
    report = json.loads(run_cli("validate", form.folder, "--deep", "--json", check=0).stdout)
    assert report["ok"] and report["problems"] == [] and report["missing_elements"] == 0
    info = json.loads(run_cli("inspect", form.folder, "--json", check=0).stdout)
    # the optimizer's keys met the model's: every parameter trainable, in the run's two groups
    assert (info["trainable"], info["frozen"], info["buffers"]) == (21, 0, 0)
    assert info["optimizer_states"] == list(STATES) and info["step"] == 3
    assert [g["params"] for g in info["param_groups"]] == [len(g["params"]) for g in truth[1]["param_groups"]] \
        == [16, 5]


def test_export_is_loaded_by_from_pretrained_and_equals_torchs_reading(form, truth, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    model_truth, optim_truth = truth
    run_cli("export", form.folder, tmp_path / "hf", "--with-optimizer", "--quiet", check=0)
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


def test_the_two_state_dicts_and_deepspeeds_layout_are_equal(tmp_path):
    """The same run saved with either state dict: equal, moments too; converted to Accelerate's DeepSpeed layout:
    equal."""
    assert "no difference: 63 tensors" in run_cli("diff", SOURCE, FULL, check=0).stdout
    run_cli("convert", SOURCE, tmp_path / "ds", "--format", "deepspeed", "--to", "dp=3,zero=2", "--quiet", check=0)
    assert "no difference: 63 tensors" in run_cli("diff", SOURCE, tmp_path / "ds", check=0).stdout


def test_diff_finds_one_changed_element(form, truth, tmp_path):
    """One element changed in torch's own reading of the weights is found."""
    from safetensors.torch import save_file
    name, index, line = form.changed
    changed = {k: v.clone() for k, v in truth[0].items()}
    changed[name][index] += 1e-3
    save_file(changed, str(tmp_path / "changed.safetensors"))
    proc = run_cli("diff", form.folder, tmp_path / "changed.safetensors")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{name} (weight): {line}" in proc.stdout
    assert "DIFFERENT: 1 difference" in proc.stdout


def test_side_files_are_checked_and_pickles_go_through_the_allow_list(form, tmp_path):
    import os as os_module
    broken = tmp_path / "state"
    shutil.copytree(form.folder, broken)
    missing = f"random_states_{form.missing_process}.pkl"
    (broken / missing).unlink()
    proc = run_cli("validate", broken)
    assert proc.returncode != 0
    assert f"{broken / missing}: missing (RNG states and the accelerator's step of process {form.missing_process} " \
        "of a 2-process run)" in proc.stdout

    class Hostile:
        def __reduce__(self):
            return (os_module.system, ("echo unpickled",))
    file, key = form.hostile
    torch.save({key: Hostile(), "param_groups": []}, broken / file)
    proc = run_cli("inspect", broken)
    assert proc.returncode != 0 and "unpickled" not in proc.stdout and proc.stderr.strip().splitlines() == [
        f"reshard: {broken / file}: refusing to unpickle global posix.system (not on reshard's "
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
