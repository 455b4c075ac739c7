"""A Hugging Face Llama folder imported as the weights-only megatron-core torch_dist save a fine-tune starts from
(`convert hf/ save/ --format megatron --names megatron-core-llama --to tp=T,pp=P`: the export rule file read
backwards, Megatron-LM's args from config.json), proven by megatron-core 0.16.1 and transformers 5.21.0.

The sources are LlamaForCausalLM models made here by transformers with random weights (no download): fp32 in one
model.safetensors, bf16 in shards with model.safetensors.index.json, and fp32 with a tied embedding and a vocabulary of
63 tokens (padded to 64 rows at tp=2). Each conversion is loaded by `dist_checkpointing.load` into megatron-core's
GPTModel built at the target tp and pp (tests/scripts/megatron_import.py, run by tests/scripts/megatron_load.py in the
launches tests/formats/megatron/test_megatron_convert.py shares), whose logits of fixed tokens, through Megatron's
pipeline schedule, equal transformers' forward of the source folder (fp32: within 1e-5; bf16: within BF16_BOUND, what
the two frameworks' bf16 arithmetic differs by), and one training step with a fresh optimizer runs and moves the
weights. The round trip HF -> Megatron -> `export --names megatron-core-llama` gives the source's tensors bit for bit.

Negative controls: the same rule file with q/k/v concatenated instead of interleaved by query group, or with gate and
up swapped, converts and loads, and its logits differ; the export of a changed element differs from the source; a
config that contradicts the rule file (another activation, another RoPE type) or the tensors (a layer count) is refused
in one line, nothing written.
"""
from __future__ import annotations

import json
import math

import pytest

import reshard
from reshard.errors import ReshardError
from reshard.formats.hf import model as hf_model
from reshard.formats.megatron.pickles import METADATA_ALLOWED
from reshard.formats.megatron.reader import common_state
from reshard.rules.files import shipped
from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.engine_launches import shares
from tests.helpers.hf_sources import (
    FP32_BOUND,
    LLAMA_NAMES,
    LLAMA_SOURCES,
    SEQ,
    TOKENS,
    logits_delta,
    make_llama,
    megatron_import,
)
from tests.helpers.megatron_saves import degrees
from tests.helpers.property_sources import tree_bytes

# (source, --to): every topology the issue names, each precision and the tied, padded vocabulary
CONVERSIONS = [("fp32", "tp=2,pp=1"), ("fp32", "tp=1,pp=2"), ("fp32", "tp=2,pp=2"), ("bf16-sharded", "tp=2,pp=1"),
               ("bf16-sharded", "tp=2,pp=2"), ("fp32-tied-63", "tp=2,pp=1"), ("fp32-tied-63", "tp=2,pp=2")]
BF16_BOUND = 0.1    # bf16 arithmetic of two frameworks (measured: 0.078; each test records its max_abs_delta)
# (the element the round trip's negative control changes: Megatron's name, the exported name)
CHANGED = ("decoder.layers.1.mlp.linear_fc2.weight", "model.layers.1.mlp.down_proj.weight")
def reference_logits(folder):
    import torch
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


def rules_with(tmp, name: str, change) -> str:
    """The shipped rule file with `change` made to its rules: a negative control's."""
    spec = json.loads(open(shipped("reshard.export-names")[LLAMA_NAMES]).read())
    change(spec["rules"])
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _concatenated(rules) -> None:
    qkv = next(r for r in rules if "linear_qkv\\.weight" in r["match"])
    del qkv["rows"]["groups"]       # q, k, v as three blocks one after another


def _swapped(rules) -> None:
    fc1 = next(r for r in rules if "linear_fc1\\.weight" in r["match"])
    fc1["rows"]["parts"].reverse()


def job(label, save, to, name, out) -> tuple:
    import transformers
    config = transformers.AutoConfig.from_pretrained(str(out / name))
    cut = degrees(to)
    tokens = config.vocab_size
    rows = -(-tokens // cut["tp"]) * cut["tp"]
    model = {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
             "groups": config.num_key_value_heads, "ffn": config.intermediate_size, "kv": config.head_dim,
             "rows": rows, "tokens": tokens, "seq": SEQ, "eps": config.rms_norm_eps,
             "rope_base": config.rope_parameters["rope_theta"], "tied": config.tie_word_embeddings}
    return (cut["tp"] * cut["pp"], None, {"label": label, "import": True, "save": str(save), "tp": cut["tp"],
                                          "pp": cut["pp"], "fp32": "float32" in str(config.dtype), "model": model,
                                          "tokens": TOKENS, "logits": str(save) + "-logits.safetensors"})


@shares("megatron_load.py")
def import_jobs(out):
    """Every conversion and the two negative controls (2 ranks; tp=2·pp=2: 4)."""
    for name in LLAMA_SOURCES:
        make_llama(out / name, name)
    jobs = []
    for index, (name, to) in enumerate(CONVERSIONS):
        megatron_import(out / name, out / f"import-{index}", to)
        jobs.append(job(f"{name}:{to}", out / f"import-{index}", to, name, out))
    for control, change in (("concatenated", _concatenated), ("swapped", _swapped)):
        megatron_import(out / "fp32", out / control, "tp=2,pp=1", rules_with(out, control, change))
        jobs.append(job(control, out / control, "tp=2,pp=1", "fp32", out))
    return jobs


@pytest.fixture(scope="module")
def loaded(engine_launches):
    results = engine_launches.results(import_jobs)
    return {r["label"]: r for r in results}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    for name in LLAMA_SOURCES:
        make_llama(out / name, name)
    return out


@pytest.mark.engine
@pytest.mark.parametrize("name, to", CONVERSIONS, ids=[f"{n}-{t}" for n, t in CONVERSIONS])
def test_megatron_loads_the_import_and_its_logits_are_transformers(name, to, loaded, sources, record_property):
    result = loaded[f"{name}:{to}"]
    assert result["problems"] == [], result
    delta = logits_delta(result, reference_logits(sources / name))
    record_property("max_abs_delta", delta)
    assert delta <= (FP32_BOUND if name.startswith("fp32") else BF16_BOUND), delta
    assert result["losses"] and all(math.isfinite(x) for x in result["losses"]) and result["moved"]


@pytest.mark.engine
@pytest.mark.parametrize("control", ["concatenated", "swapped"])
def test_q_k_v_concatenated_or_gate_up_swapped_load_and_give_other_logits(control, loaded, sources):
    # (the shapes fit: only the logits tell; beyond bf16's bound too)
    assert logits_delta(loaded[control], reference_logits(sources / "fp32")) > BF16_BOUND


@pytest.mark.parametrize("name", list(LLAMA_SOURCES))
def test_the_round_trip_through_megatron_gives_the_source_bit_for_bit(name, sources, tmp_path):
    import torch
    from safetensors.torch import load_file
    assert (sources / name / "model.safetensors.index.json").exists() == ("shard" in LLAMA_SOURCES[name])
    megatron_import(sources / name, tmp_path / "save", "tp=2,pp=2")
    run_cli("export", tmp_path / "save", tmp_path / "back", "--names", LLAMA_NAMES, "--quiet", check=0)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    source = _tensors(sources / name)
    assert set(back) == set(source)
    for key, tensor in source.items():
        # (a vocabulary padded for tp is exported padded, as Megatron trains it: the rows past it the last one)
        kept, added = back[key][:len(tensor)], back[key][len(tensor):]
        assert back[key].dtype == tensor.dtype and torch.equal(kept, tensor), key
        assert all(torch.equal(row, tensor[-1]) for row in added), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["tie_word_embeddings"] == LLAMA_SOURCES[name].get("tie_word_embeddings", False)
    # negative control: one element changed in the Megatron save, and the same comparison names that tensor
    change_dcp_element(tmp_path / "save" / "release", CHANGED[0], METADATA_ALLOWED, state="module")
    run_cli("export", tmp_path / "save", tmp_path / "changed", "--names", LLAMA_NAMES, "--quiet", check=0)
    changed = load_file(str(tmp_path / "changed" / "model.safetensors"))
    assert [k for k in source if not torch.equal(changed[k][:len(source[k])], source[k])] == [CHANGED[1]]


def _tensors(folder) -> dict:
    from safetensors.torch import load_file
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("name", list(LLAMA_SOURCES))
def test_the_import_builds_no_model_and_writes_what_the_models_order_would(name, sources, tmp_path, monkeypatch):
    """The CLI's import reads the folder without hf_model (transformers building the model class: seconds, the
    import's fixed cost), and its files are those of the import from the source read in the model's order, byte for
    byte. Negative controls: a plain read still asks hf_model (so the refusal below would be seen); a save with one
    element changed is told apart by the same comparison."""
    megatron_import(sources / name, tmp_path / "ordered", "tp=2,pp=2", model_order=True)

    def refused(folder):
        raise AssertionError(f"the model class was built for {folder}")
    monkeypatch.setattr(hf_model, "model_order", refused)
    with pytest.raises(AssertionError, match="the model class was built"):
        reshard.open_checkpoint(str(sources / name))
    run_cli("convert", sources / name, tmp_path / "cli", "--format", "megatron", "--names", LLAMA_NAMES, "--to",
            "tp=2,pp=2", "--quiet", check=0)
    ordered, cli = tree_bytes(str(tmp_path / "ordered")), tree_bytes(str(tmp_path / "cli"))
    assert sorted(ordered) == sorted(cli) and all(ordered[f] == cli[f] for f in ordered)
    change_dcp_element(tmp_path / "cli" / "release", CHANGED[0], METADATA_ALLOWED, state="module")
    changed = tree_bytes(str(tmp_path / "cli"))
    assert [f for f in ordered if ordered[f] != changed[f]] != []


def test_the_save_is_megatron_lms_release_folder_with_args_from_config(sources, tmp_path):
    megatron_import(sources / "fp32-tied-63", tmp_path / "save", "tp=2,pp=1")
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text() == "release"
    common = common_state(str(tmp_path / "save" / "release"))[0]
    args = vars(common["args"])
    assert (args["num_layers"], args["hidden_size"], args["num_query_groups"], args["kv_channels"]) == (4, 16, 2, 4)
    assert (args["vocab_size"], args["padded_vocab_size"]) == (63, 64)      # padded to a multiple of tp only
    assert args["untie_embeddings_and_output_weights"] is False and args["no_save_optim"] and args["no_save_rng"]
    assert "optimizer" not in common and common["iteration"] == 0


@pytest.mark.parametrize("key, value, says", [
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "llama3"}, "rope_parameters.rope_type = 'llama3'"),
    ("num_hidden_layers", 3, "args.num_layers = 3"),
])
def test_a_config_that_contradicts_the_rules_or_the_tensors_is_refused(key, value, says, sources, tmp_path):
    import shutil
    source = tmp_path / "hf"
    shutil.copytree(sources / "fp32", source)
    config = json.loads((source / "config.json").read_text())
    config[key] = value
    (source / "config.json").write_text(json.dumps(config))
    proc = run_cli("convert", source, tmp_path / "out", "--format", "megatron", "--names", LLAMA_NAMES, "--to", "tp=2")
    assert proc.returncode == 1 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReshardError):
        megatron_import(source, tmp_path / "out2", "tp=1")


def test_an_arguments_file_overrides_what_config_json_gives_and_is_checked(sources, tmp_path):
    given = tmp_path / "args.json"
    given.write_text(json.dumps({"args": {"make_vocab_size_divisible_by": 64, "seq_length": 4}}))
    megatron_import(sources / "fp32-tied-63", tmp_path / "save", f"tp=2,pp=1,args={given}")
    args = vars(common_state(str(tmp_path / "save" / "release"))[0]["args"])
    assert (args["vocab_size"], args["padded_vocab_size"], args["seq_length"]) == (63, 128, 4)   # 64 x tp rows
    given.write_text(json.dumps({"args": {"hidden_size": 32}}))
    proc = run_cli("convert", sources / "fp32", tmp_path / "out", "--format", "megatron", "--names", LLAMA_NAMES,
                   "--to", f"tp=2,args={given}")
    assert proc.returncode == 1 and "args.padded_vocab_size, args.hidden_size" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_without_the_names_the_import_is_refused_naming_them(sources, tmp_path):
    proc = run_cli("convert", sources / "fp32", tmp_path / "out", "--format", "megatron", "--to", "tp=2")
    assert proc.returncode == 2 and "--names megatron-core-llama" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
