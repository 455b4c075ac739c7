"""A Hugging Face Llama folder into torchtitan: `convert hf/ step-0/ --format torchtitan --names torchtitan-llama
--to dp=N` writes the weights-only step folder (the model's state dict under torchtitan's FQNs, what
`checkpoint.last_save_model_only` writes) that torchtitan 0.3.0 starts a run from: `CheckpointManager.load()` with
`checkpoint.initial_load_path` naming it (tests/scripts/torchtitan_load.py, 2 ranks, torchtitan's own Llama 3 under
its FSDP2 wrapping).

The source is transformers' own LlamaForCausalLM of torchtitan_cpu's model shape (random weights, fp32). Proofs:
torchtitan's forward of the loaded model on fixed tokens equals transformers' forward of the source (fp32, 1e-5);
torchtitan saves what it loaded (its own last-step model-only save) and `export --names torchtitan-llama` of that
save is the source folder bit for bit; at head size 8 (where the reordering is not its own inverse) the step folder
holds what torchtitan's own Llama3StateDictAdapter.from_hf makes of the source; a sharded bf16 folder is written in
bf16 and exports back as it was (reshard's diff). Negative controls: the rule file with
its strided (rotary) rules dropped imports a model whose logits differ; one changed weight in the step folder comes
back as exactly that tensor differing from the source; a split rule, a block its stride does not divide, a config
without the head size, and a tied model (its lm_head not in the folder) are refused in one line with nothing written.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.engine_launches import shares

CHANGED = "layers.1.attention.qkv_linear.wk.weight"      # the weight the negative control changes
TOKENS = [[3, 17, 42, 5, 9, 60, 11, 0], [1, 2, 63, 33, 8, 25, 47, 12]]


def hf_llama(folder, dim: int | None = None, heads: int | None = None, tied: bool = False, bf16: bool = False) -> str:
    """transformers' Llama of torchtitan_cpu's shape (another width and head count where given; its output layer
    its embedding where `tied`), every weight drawn at random (seed 0; norms too), saved by save_pretrained as fp32
    safetensors (bf16 in shards of 8KB where `bf16`): the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchtitan_cpu as tt
    dim, heads = dim or tt.DIM, heads or tt.HEADS
    config = LlamaConfig(hidden_size=dim, intermediate_size=tt.HIDDEN, num_hidden_layers=tt.LAYERS,
                         num_attention_heads=heads, num_key_value_heads=tt.KV_HEADS, head_dim=dim // heads,
                         vocab_size=tt.VOCAB, rms_norm_eps=tt.NORM_EPS, rope_theta=tt.ROPE_THETA,
                         max_position_embeddings=4 * tt.SEQ, tie_word_embeddings=tied, attention_bias=False,
                         mlp_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    if bf16:
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="8KB")
    else:
        model.save_pretrained(folder)
    return str(folder)


def plain_rules(tmp_path) -> str:
    """The shipped torchtitan-llama rules without their strided (rotary) reordering: the negative control's."""
    shipped = os.path.join(reshard.__path__[0], "layouts", "export-names", "torchtitan-llama.json")
    rules = json.loads(open(shipped).read())
    for rule in rules["rules"]:
        rule.pop("strided", None)
    (tmp_path / "plain.json").write_text(json.dumps(rules))
    return str(tmp_path / "plain.json")


def _import(source, dst, names: str = "torchtitan-llama", dp: int = 2) -> None:
    run_cli("convert", source, dst, "--format", "torchtitan", "--names", names, "--to", f"dp={dp}", "--quiet",
            check=0)


def _state(folder) -> dict:
    """A DCP folder as torch's own dcp_to_torch_save reads it (no reshard)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=False)


def test_the_step_folder_is_the_model_state_dict_alone_as_torchtitans_own_adapter_makes_it(tmp_path):
    """Head size 8: each head's q and k rows taken back from Hugging Face's halves to torchtitan's interleaved pairs
    (the inverse of the export's reordering, which is not its own inverse at this size)."""
    import torch
    from safetensors.torch import load_file

    import torchtitan_cpu
    torchtitan_cpu.install()
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    source = hf_llama(tmp_path / "hf", dim=32, heads=4)
    _import(source, tmp_path / "run" / "step-0", dp=3)
    state = _state(tmp_path / "run" / "step-0")
    expected = Llama3StateDictAdapter(torchtitan_cpu.model_config(False, dim=32, heads=4), None).from_hf(
        load_file(os.path.join(source, "model.safetensors")))
    assert set(state) == set(expected)      # the model's FQNs, nothing beside them
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], expected[k]) for k in expected)
    # the control: without the strided rules, q and k are torchtitan's names over Hugging Face's row order
    _import(source, tmp_path / "plain" / "step-0", names=plain_rules(tmp_path), dp=3)
    plain = _state(tmp_path / "plain" / "step-0")
    differ = sorted(k for k in expected if not torch.equal(plain[k], expected[k]))
    assert differ == [f"layers.{i}.attention.qkv_linear.{w}.weight" for i in (0, 1) for w in ("wk", "wq")], differ


def test_a_sharded_bf16_folder_is_written_in_bf16_and_exports_back_bit_for_bit(tmp_path):
    import torch
    source = hf_llama(tmp_path / "hf", bf16=True)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    _import(source, tmp_path / "run" / "step-0", dp=4)
    state = _state(tmp_path / "run" / "step-0")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    run_cli("export", tmp_path / "run" / "step-0", tmp_path / "back", "--names", "torchtitan-llama", "--config",
            tmp_path / "hf" / "config.json", "--quiet", check=0)
    assert run_cli("diff", source, tmp_path / "back", check=0).stdout.startswith("no difference")
    # the control: a change in the step folder (damage's 4 bytes: two bf16 elements of layer 1's wk) is found
    change_dcp_element(tmp_path / "run" / "step-0", CHANGED, state="module")
    run_cli("export", tmp_path / "run" / "step-0", tmp_path / "changed", "--names", "torchtitan-llama", "--config",
            tmp_path / "hf" / "config.json", "--quiet", check=0)
    assert "model.layers.1.self_attn.k_proj.weight" in run_cli("diff", source, tmp_path / "changed", check=1).stdout


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.insert(0, {"match": "model\\.embed_tokens\\.weight", "name": "embed.{index}", "split": 0}),
     "rule 0: a split rule is not undone yet"),
    (lambda r: r[1].update(strided={"block": 3, "stride": 2}),
     "rule 1: blocks of 3 rows do not go by 2: the reordering cannot be undone"),
])
def test_a_rule_that_cannot_be_undone_is_refused_in_one_line_with_nothing_written(tmp_path, edit, message):
    shipped = os.path.join(reshard.__path__[0], "layouts", "export-names", "torchtitan-llama.json")
    rules = json.loads(open(shipped).read())
    edit(rules["rules"])
    (tmp_path / "bad.json").write_text(json.dumps(rules))
    source = hf_llama(tmp_path / "hf")
    proc = run_cli("convert", source, tmp_path / "out", "--format", "torchtitan", "--names", tmp_path / "bad.json",
                   "--to", "dp=2")
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_config_without_the_head_size_is_refused_in_one_line_with_nothing_written(tmp_path):
    source = hf_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    proc = run_cli("convert", source, tmp_path / "out", "--format", "torchtitan", "--names", "torchtitan-llama",
                   "--to", "dp=2")
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert "rule 1: its block is head_dim, which the model's config does not give as a whole number" in \
        proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_tied_model_is_refused_in_one_line_with_nothing_written(tmp_path):
    source = hf_llama(tmp_path / "hf", tied=True)
    proc = run_cli("convert", source, tmp_path / "out", "--format", "torchtitan", "--names", "torchtitan-llama",
                   "--to", "dp=2")
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert "tie_word_embeddings: a model whose output layer is its embedding is not written to torchtitan yet" in \
        proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@shares("torchtitan_load.py")
def titan_import_jobs(out):
    """The import at dp=2 and at dp=3 (loaded at 2 ranks: DCP's own resharding), the import without the rotary
    reordering, and the dp=2 import with one weight changed: each loaded by torchtitan, its forward of TOKENS, and
    saved again by torchtitan as its last step, model only."""
    source = hf_llama(out / "hf")
    folders = {"imported": 2, "imported at dp=3": 3, "plain": 2}
    jobs = []
    for label, dp in folders.items():
        _import(source, out / label / "step-0", names=plain_rules(out) if label == "plain" else "torchtitan-llama",
                dp=dp)
    changed = shutil.copytree(out / "imported" / "step-0", out / "changed" / "step-0")
    change_dcp_element(changed, CHANGED, state="module")
    for label in (*folders, "changed"):
        jobs.append((2, None, {"label": label, "model_only": True, "load": str(out / label / "step-0"),
                               "tokens": TOKENS, "save": str(out / label / "saved")}))
    return jobs


@pytest.fixture(scope="module")
def imported(engine_launches):
    """{label: result} of the jobs, and the source folder."""
    results = {r["label"]: r for r in engine_launches.results(titan_import_jobs)}
    return results, Path(results["imported"]["load"]).parents[1] / "hf"


def _hf_logits(folder):
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def _exported_back(saved: str, source: Path, out: Path) -> dict:
    """torchtitan's own save of what it loaded, exported back to Hugging Face's names by reshard."""
    from safetensors.torch import load_file
    run_cli("export", saved, out, "--names", "torchtitan-llama", "--config", source / "config.json", "--quiet",
            check=0)
    return load_file(out / "model.safetensors")


@pytest.mark.engine
@pytest.mark.parametrize("label", ["imported", "imported at dp=3"])
def test_torchtitan_loads_the_import_with_transformers_logits(imported, label):
    import torch
    results, source = imported
    result = results[label]
    assert result["loaded"] and result["error"] is None, result
    torch.testing.assert_close(torch.tensor(result["logits"]), _hf_logits(source), rtol=1e-5, atol=1e-5)


@pytest.mark.engine
def test_without_the_rotary_reordering_torchtitans_logits_differ(imported):
    import torch
    results, source = imported
    result = results["plain"]
    assert result["loaded"] and result["error"] is None, result
    assert not torch.allclose(torch.tensor(result["logits"]), _hf_logits(source), rtol=1e-5, atol=1e-5)


@pytest.mark.engine
def test_what_torchtitan_loaded_and_saved_exports_back_to_the_source_bit_for_bit(imported, tmp_path):
    import torch
    from safetensors.torch import load_file
    results, source = imported
    weights = load_file(source / "model.safetensors")
    for label in ("imported", "changed"):
        assert results[label]["loaded"] and results[label]["saved"], results[label]
    back = _exported_back(results["imported"]["saved"], source, tmp_path / "back")
    assert set(back) == set(weights) and all(torch.equal(back[k], weights[k]) for k in weights)
    changed = _exported_back(results["changed"]["saved"], source, tmp_path / "changed")
    differ = [k for k in weights if not torch.equal(changed[k], weights[k])]
    assert differ == ["model.layers.1.self_attn.k_proj.weight"], differ
