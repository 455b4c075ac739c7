"""Accelerate + FSDP's full state dict, read whole: fixtures/accelerate_fsdp_full_dp2/state is what the real Accelerate
save_state wrote with FSDP2 and FULL_STATE_DICT at 2 processes, in the same launch and on the same data as
fixtures/accelerate_fsdp_sharded_dp2 (tools/fixture_accelerate_fsdp.py: accelerate 1.16, transformers 5.21, torch 2.13;
FSDP on CPU through the test-only shim tests/helpers/cpu_fsdp.py). The truth is torch.load of its two files,
independently of reshard; the export is loaded by `from_pretrained`. Negative controls: a process's missing
random_states, an optimizer.bin naming a global off the allow-list, one changed element found by `diff`.
"""
import json
import os
import shutil

import torch

from tests.formats.framework.test_accelerate_fsdp import SOURCE as SHARDED
from tests.formats.framework.test_hf_fsdp import STATES, config
from tests.helpers.cli import run_cli
from tests.helpers.repo import REPO

FULL = REPO / "fixtures" / "accelerate_fsdp_full_dp2" / "state"
ACCELERATE = {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"}


def test_inspect_names_accelerate_and_fsdp_full():
    assert set(os.listdir(FULL)) == ACCELERATE | {"pytorch_model_fsdp.bin", "optimizer.bin"}
    info = json.loads(run_cli("inspect", FULL, "--json", check=0).stdout)
    assert info["problems"] == 0
    assert info["framework"]["title"] == "Accelerate + FSDP (full state dict), dp=2"
    assert info["framework"]["backend"] == "FSDP (full state dict)"
    assert {f["path"] for f in info["framework"]["files"]} == ACCELERATE


def test_validate_proves_model_and_optimizer_complete():
    report = json.loads(run_cli("validate", FULL, "--deep", "--json", check=0).stdout)
    assert report["ok"] and report["problems"] == [] and report["missing_elements"] == 0
    info = json.loads(run_cli("inspect", FULL, "--json", check=0).stdout)
    # optimizer.bin's FQN keys met the model's: every parameter trainable, in the run's two groups
    assert (info["trainable"], info["frozen"], info["buffers"]) == (21, 0, 0)
    assert info["optimizer_states"] == list(STATES) and info["step"] == 3
    assert [g["params"] for g in info["param_groups"]] == [16, 5]


def test_export_is_loaded_by_from_pretrained_and_equals_torch_load(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    weights = torch.load(FULL / "pytorch_model_fsdp.bin")
    optimizer = torch.load(FULL / "optimizer.bin")
    run_cli("export", FULL, tmp_path / "hf", "--with-optimizer", "--quiet", check=0)
    config().save_pretrained(tmp_path / "hf")       # Accelerate's save_state writes no config: the user gives it
    state = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(state) == set(weights) and all(torch.equal(state[k], weights[k]) for k in weights)
    for name in STATES:
        exported = load_file(str(tmp_path / "hf" / f"optimizer-{name}.safetensors"))
        assert set(exported) == set(optimizer["state"])
        assert all(torch.equal(exported[k], optimizer["state"][k][name]) for k in exported)
    meta = json.loads((tmp_path / "hf" / "optimizer.json").read_text())
    assert [g["params"] for g in meta["param_groups"]] == [g["params"] for g in optimizer["param_groups"]]
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.01, 0.0]


def test_diff_equals_the_sharded_save_of_the_same_run_and_finds_one_changed_element(tmp_path):
    """The same run saved with the sharded state dict: equal, moments too; one element changed in torch.load's
    weights is found."""
    from safetensors.torch import save_file
    assert "no difference: 63 tensors" in run_cli("diff", SHARDED, FULL, check=0).stdout
    changed = torch.load(FULL / "pytorch_model_fsdp.bin")
    changed["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(changed, str(tmp_path / "changed.safetensors"))
    proc = run_cli("diff", FULL, tmp_path / "changed.safetensors")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "model.layers.1.mlp.up_proj.weight (weight): max abs diff 0.001 at element 53" in proc.stdout   # [3, 5]
    assert "DIFFERENT: 1 difference" in proc.stdout


def test_a_missing_process_file_is_named_and_pickles_go_through_the_allow_list(tmp_path):
    import os as os_module
    broken = tmp_path / "state"
    shutil.copytree(FULL, broken)
    (broken / "random_states_0.pkl").unlink()
    proc = run_cli("validate", broken)
    assert proc.returncode != 0
    assert f"{broken / 'random_states_0.pkl'}: missing (RNG states and the accelerator's step of process 0 of a " \
        "2-process run)" in proc.stdout

    class Hostile:
        def __reduce__(self):
            return (os_module.system, ("echo unpickled",))
    torch.save({"state": Hostile(), "param_groups": []}, broken / "optimizer.bin")
    proc = run_cli("inspect", broken)
    assert proc.returncode != 0 and "unpickled" not in proc.stdout and proc.stderr.strip().splitlines() == [
        f"reshard: {broken / 'optimizer.bin'}: refusing to unpickle global posix.system (not on reshard's "
        "allow-list; nothing was executed)"]
