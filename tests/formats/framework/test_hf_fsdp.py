"""HF Trainer + FSDP, read whole: fixtures/hf_fsdp_{sharded,full}_dp2/checkpoint-3 are what the real Trainer wrote
with FSDP at 2 processes (tools/fixture_hf_fsdp.py: transformers 5.21, accelerate 1.16, torch 2.13; FSDP on CPU through
the test-only shim tests/helpers/cpu_fsdp.py). The truth is read from the same files with torch's own tools,
independently of reshard: `dcp_to_torch_save` of pytorch_model_fsdp_0/ and optimizer_0/, `torch.load` of the full state
dict's files. The export is loaded by `from_pretrained`; negative controls: a missing `.distcp`, a missing `.metadata`,
one changed element found by `diff`.
"""
import json
import os
import shutil

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.helpers.fsdp_steps import config, one_step_behind_is_carried_or_refused
from tests.helpers.fsdp_truths import STATES, consolidated
from tests.helpers.repo import REPO

SHARDED = REPO / "fixtures" / "hf_fsdp_sharded_dp2" / "checkpoint-3"
FULL = REPO / "fixtures" / "hf_fsdp_full_dp2" / "checkpoint-3"
TRAINER = {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"}
TOKENIZER = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    """The sharded save as torch's dcp_to_torch_save consolidates it."""
    return consolidated(SHARDED, tmp_path_factory.mktemp("truth"))


def test_inspect_names_the_framework_and_backend():
    assert set(os.listdir(SHARDED)) == TRAINER | {"pytorch_model_fsdp_0", "optimizer_0"}
    info = json.loads(run_cli("inspect", SHARDED, "--json", check=0).stdout)
    assert info["format"] == "fsdp" and info["problems"] == 0
    assert info["framework"]["title"] == "HF Trainer + FSDP (sharded state dict), dp=2"
    assert {f["path"] for f in info["framework"]["files"]} == TRAINER
    full = json.loads(run_cli("inspect", FULL, "--json", check=0).stdout)
    assert full["framework"]["title"] == "HF Trainer + FSDP (full state dict), dp=2"
    assert run_cli("inspect", SHARDED, check=0).stdout.count("beside the FSDP (sharded state dict) save") == 1


@pytest.mark.parametrize("folder", [SHARDED, FULL], ids=["sharded", "full"])
def test_validate_proves_model_and_optimizer_complete(folder):
    out = run_cli("validate", folder, "--deep", "--json", check=0).stdout
    report = json.loads(out)
    assert report["ok"] and report["problems"] == [] and report["missing_elements"] == 0
    info = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)
    # every parameter trainable: the optimizer's keys met the model's, 21 of them in the Trainer's two groups
    assert (info["trainable"], info["frozen"], info["buffers"]) == (21, 0, 0)
    assert info["optimizer_states"] == list(STATES) and info["step"] == 3
    assert [g["params"] for g in info["param_groups"]] == [16, 5]


def test_a_missing_distcp_or_metadata_is_named(tmp_path):
    broken = tmp_path / "checkpoint-3"
    shutil.copytree(SHARDED, broken)
    (broken / "optimizer_0" / "__1_0.distcp").unlink()
    proc = run_cli("validate", broken)
    assert proc.returncode != 0
    assert f"{broken / 'optimizer_0' / '__1_0.distcp'}: missing (named in .metadata)" in proc.stdout + proc.stderr
    (broken / "pytorch_model_fsdp_0" / ".metadata").unlink()
    proc = run_cli("inspect", broken)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert str(broken / "pytorch_model_fsdp_0" / ".metadata") in proc.stderr and "missing" in proc.stderr


def test_sharded_export_is_loaded_by_from_pretrained_and_equals_torchs_reading(truth, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    model_truth, optim_truth = truth
    run_cli("export", SHARDED, tmp_path / "hf", "--with-optimizer", "--quiet", check=0)
    assert "config.json" not in os.listdir(tmp_path / "hf")     # the save has none: the user gives it
    config().save_pretrained(tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    state = model.state_dict()
    assert set(state) == set(model_truth)
    assert all(torch.equal(state[k], model_truth[k]) for k in model_truth)
    for name in STATES:
        exported = load_file(str(tmp_path / "hf" / f"optimizer-{name}.safetensors"))
        assert set(exported) == set(optim_truth["state"])
        assert all(torch.equal(exported[k], optim_truth["state"][k][name]) for k in exported)
    meta = json.loads((tmp_path / "hf" / "optimizer.json").read_text())
    assert [g["params"] for g in meta["param_groups"]] == [g["params"] for g in optim_truth["param_groups"]]
    assert {float(s["step"]) for s in optim_truth["state"].values()} == {g["step"] for g in meta["param_groups"]} \
        == {3.0}


def test_full_export_is_loaded_by_from_pretrained_with_its_config_and_tokenizer(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run_cli("export", FULL, tmp_path / "hf", "--with-optimizer", "--quiet", check=0)
    assert {"config.json", "generation_config.json", *TOKENIZER} <= set(os.listdir(tmp_path / "hf"))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("t1 t2")["input_ids"] == [1, 2]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    weights = torch.load(FULL / "pytorch_model_fsdp.bin")
    optimizer = torch.load(FULL / "optimizer.bin")
    state = model.state_dict()
    assert set(state) == set(weights) and all(torch.equal(state[k], weights[k]) for k in weights)
    for name in STATES:
        exported = load_file(str(tmp_path / "hf" / f"optimizer-{name}.safetensors"))
        assert set(exported) == set(optimizer["state"])
        assert all(torch.equal(exported[k], optimizer["state"][k][name]) for k in exported)


def test_diff_finds_the_runs_equal_and_one_changed_element(truth, tmp_path):
    """The sharded and the full run trained the same model on the same data: equal, moments and scheduler too;
    one element changed in torch's own consolidation of the sharded save is found."""
    from safetensors.torch import save_file
    proc = run_cli("diff", SHARDED, FULL, check=0)
    assert "no difference: 63 tensors" in proc.stdout
    changed = {k: v.clone() for k, v in truth[0].items()}
    changed["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(changed, str(tmp_path / "changed.safetensors"))
    proc = run_cli("diff", SHARDED, tmp_path / "changed.safetensors")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "model.layers.1.mlp.up_proj.weight (weight): max abs diff 0.001 at element 53" in proc.stdout   # [3, 5]
    assert "DIFFERENT: 1 difference" in proc.stdout


def test_per_parameter_steps_and_param_groups_are_carried_or_refused(truth, tmp_path):
    """One parameter's Adam step behind the others (torch's own torch_save_to_dcp rewrites optimizer_0/): the FSDP
    layout at 3 processes carries every parameter's own step and the param groups exactly (read back with
    dcp_to_torch_save); DeepSpeed, which keeps one step per group, refuses in one line naming the file."""
    source = tmp_path / "checkpoint-3"
    shutil.copytree(SHARDED, source)
    one_step_behind_is_carried_or_refused(
        source, truth[1], "lm_head.weight", "param group 0: optimizer step differs between parameters (3 at "
        "model.embed_tokens.weight vs 2 at lm_head.weight); a DeepSpeed checkpoint keeps one per group, so it is not "
        "written", tmp_path)


