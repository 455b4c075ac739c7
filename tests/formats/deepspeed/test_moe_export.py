"""MoE export in the Hugging Face layout (issue #16): AutoEP's packed experts written as Mixtral's one tensor per
expert by the rule file reshard/layouts/export-names/mixtral-autoep-hf.json (reshard/rules/export_names.py), loaded
by transformers' own from_pretrained: every weight is the engine's fp32 master bit for bit, and the probe's logits are
the engine's. Without the rule file from_pretrained does not find the experts (the negative control).
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from fixture_moe import mixtral_config, probe
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, truth_tensors
from tests.helpers.repo import REPO

NAMES = REPO / "reshard" / "layouts" / "export-names" / "mixtral-autoep-hf.json"
AUTOEP = ["autoep2_z1_fp32", "autoep2_z2_fp32_dp2", "autoep2_z2_bf16", "autoep2_z3_fp32_dp2"]


def _pretrained(name, out, *names):
    from transformers import MixtralForCausalLM
    run_cli("export", fixture_dir(name), out, *names, "--dtype", "fp32", "--quiet", check=0)     # the fp32 masters
    mixtral_config().save_pretrained(out)       # (the checkpoint holds no config.json)
    return MixtralForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("name", AUTOEP)
def test_from_pretrained_loads_the_export_with_the_engines_weights_and_logits(name, tmp_path):
    model = _pretrained(name, tmp_path / "hf", "--names", "mixtral-autoep-hf")     # shipped: found by name
    truth, loaded = truth_tensors(name), model.state_dict()
    master = {k.removeprefix("fp32/"): v for k, v in truth.items() if k.startswith("fp32/")}
    compared = 0
    for layer in range(mixtral_config().num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        packed = {w: master.pop(f"{prefix}.experts.{w}") for w in ("w1", "w2", "w3")}
        # transformers folds Mixtral's per-expert w1 (gate) and w3 (up) into gate_up_proj, w2 into down_proj
        assert torch.equal(loaded[f"{prefix}.experts.gate_up_proj"], torch.cat([packed["w1"], packed["w3"]], dim=1))
        assert torch.equal(loaded[f"{prefix}.experts.down_proj"], packed["w2"])
        assert torch.equal(loaded[f"{prefix}.gate.weight"], master.pop(f"{prefix}.router.gate.weight"))
        compared += 4
    for key, value in master.items():
        assert torch.equal(loaded[key], value), key
        compared += 1
    assert compared == sum(1 for k in truth if k.startswith("fp32/"))
    keys = load_file(str(tmp_path / "hf" / "model.safetensors"))     # (one shard at this size)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys and not any(".mlp." in k for k in keys)
    if "bf16" not in name:          # a bf16 engine's logits are of its bf16 weights
        with torch.no_grad():
            logits = model(input_ids=probe()).logits.float()
        assert torch.allclose(logits, truth["logits"], rtol=0, atol=1e-5), (logits - truth["logits"]).abs().max()


def test_without_the_rule_file_from_pretrained_misses_the_experts(tmp_path):
    model = _pretrained("autoep2_z1_fp32", tmp_path / "plain")
    with torch.no_grad():
        logits = model(input_ids=probe()).logits.float()
    assert not torch.allclose(logits, truth_tensors("autoep2_z1_fp32")["logits"], rtol=0, atol=1e-3)


def _rules(tmp_path, rules, kind="reshard.export-names"):
    path = tmp_path / "names.json"
    path.write_text(json.dumps({"kind": kind, "version": 1, "rules": rules}))
    return path


@pytest.mark.parametrize("rules, kind, needle", [
    ([], "reshard.tp-rules", "not an export-names file"),
    ([{"match": "(.*)experts\\.(w[123])", "name": "x{index}", "split": 1}], None, '"split" can only be 0'),
    ([{"match": "(.*)experts\\.(w[123])", "name": "\\1.\\2"}, ], None, None),
    ([{"match": ".*experts\\.w[123]", "name": "one.{index}", "split": 0}], None, "two tensors would be exported as"),
    ([{"match": ".*embed_tokens.*", "name": "x"}], None, None),
    ([{"match": ".*", "name": "everything"}], None, "two tensors would be exported as everything"),
    ([{"match": "(", "name": "x"}], None, "bad regular expression"),
    ([{"match": ".*", "name": "x{index}"}], None, "only a split does"),
])
def test_a_bad_rule_file_is_one_line_and_writes_nothing(tmp_path, rules, kind, needle):
    path = _rules(tmp_path, rules, kind or "reshard.export-names")
    out = tmp_path / "out"
    proc = run_cli("export", fixture_dir("autoep2_z1_fp32"), out, "--names", path)
    if needle is None:          # a plain rename is fine
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 1 and needle in proc.stderr and str(path) in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_names_go_with_the_weights_only(tmp_path):
    proc = run_cli("export", fixture_dir("autoep2_z1_fp32"), tmp_path / "out", "--names", NAMES, "--with-optimizer",
                   check=2)
    assert "export names apply to the weights" in proc.stderr and not (tmp_path / "out").exists()


def test_a_tied_tensor_is_renamed_with_its_holder_and_never_split(tmp_path):
    """The tie of a fixture with tied weights survives a rename; splitting the holder is refused."""
    name = "z2_fp32_frozen_tied_dp2"
    tied = json.loads(run_cli("inspect", fixture_dir(name), "--json", check=0).stdout)["aliases"]
    alias, holder = next(iter(tied.items()))
    path = _rules(tmp_path, [{"match": "(.*)", "name": "renamed.\\1"}])
    run_cli("export", fixture_dir(name), tmp_path / "m.safetensors", "--names", path, "--quiet", check=0)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["tied"]) == {f"renamed.{alias}": f"renamed.{holder}"}
        assert f"renamed.{holder}" in f.keys() and f"renamed.{alias}" not in f.keys()
    split = _rules(tmp_path, [{"match": holder.replace(".", "\\."), "name": "h.{index}", "split": 0}])
    proc = run_cli("export", fixture_dir(name), tmp_path / "s.safetensors", "--names", split, check=1)
    assert f"{alias} is tied to {holder}" in proc.stderr
