"""A Hugging Face Mixtral folder imported as the weights-only megatron-core torch_dist save a fine-tune starts from, its
experts expert-parallel (`convert mixtral/ save/ --format megatron --names megatron-core-mixtral --to
tp=T,pp=P,dp=D,ep=E`: the export rule file read backwards), proven by megatron-core 0.16.1 and transformers 5.21.0.

The source is a MixtralForCausalLM made here by transformers with random fp32 weights (4 experts, top 2, no download),
saved by save_pretrained under its per-expert names (w1, w2, w3), with router_aux_loss_coef 0.02, a training-time
loss weight that becomes Megatron's moe_aux_loss_coeff. Each conversion is loaded by `dist_checkpointing.load` into
megatron-core's GPTModel built as the MoE fixtures build it (SequentialMLP experts, allgather dispatcher) at the
target tp, pp and ep (tests/scripts/megatron_import.py, in the launches tests/formats/megatron/test_megatron_convert.py
shares), whose logits of fixed tokens equal transformers' forward of the source folder within 1e-5, and at tp=1 one
training step with a fresh optimizer runs and moves the weights (megatron-core trains a mixture of experts at tp > 1
with sequence parallelism only, which the local spec's torch norms refuse: Transformer Engine's are not on CPU). The
round trip HF -> Megatron (tp=2, pp=2, ep=2) -> `export --names megatron-core-mixtral` gives the source's tensors bit
for bit and its config's values.

Negative controls: each expert's w1 and w3 swapped (the rule file's fc1 parts reversed), or two experts of a layer
swapped in the source (its router kept), convert and load, and their logits differ; the export of a save with one
expert element changed differs from the source in that expert's tensor alone; an expert count that contradicts the
tensors, and an ep that does not divide the experts, are refused in one line, nothing written.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

from reshard.formats.megatron.pickles import METADATA_ALLOWED
from reshard.formats.megatron.reader import common_state
from reshard.rules.files import shipped
from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.engine_launches import shares
from tests.helpers.hf_sources import FP32_BOUND, SEQ, TOKENS, logits_delta, make_mixtral, megatron_import
from tests.helpers.megatron_saves import degrees

NAMES = "megatron-core-mixtral"
CONVERSIONS = ["tp=1,pp=1,dp=2,ep=2", "tp=2,pp=1,dp=2,ep=2", "tp=1,pp=2,dp=2,ep=2"]
CONTROL = "tp=1,pp=1,dp=2,ep=2"
# (the element the round trip's negative control changes: Megatron's name, the exported name)
CHANGED = ("decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight",
           "model.layers.1.block_sparse_moe.experts.3.w2.weight")


def experts_swapped(source, folder) -> None:
    """`source` with experts 0 and 1 of layer 0 exchanged (every weight of each), the router as it was: another
    model, whose outputs differ."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(source, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for w in ("w1", "w2", "w3"):
        a, b = (f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def reference_logits(folder):
    import torch
    import transformers
    model = transformers.MixtralForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


def w1_w3_swapped(tmp) -> str:
    spec = json.loads(open(shipped("reshard.export-names")[NAMES]).read())
    next(r for r in spec["rules"] if "experts" in r["match"] and "rows" in r)["rows"]["parts"].reverse()
    path = tmp / "w1-w3-swapped.json"
    path.write_text(json.dumps(spec))
    return str(path)


def job(label, save, to, source) -> tuple:
    import transformers
    config = transformers.AutoConfig.from_pretrained(str(source))
    cut = degrees(to)
    model = {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
             "groups": config.num_key_value_heads, "ffn": config.intermediate_size,
             "kv": config.hidden_size // config.num_attention_heads, "rows": config.vocab_size,
             "tokens": config.vocab_size, "seq": SEQ, "eps": config.rms_norm_eps,
             "rope_base": config.rope_parameters["rope_theta"], "tied": False,
             "experts": config.num_local_experts, "topk": config.num_experts_per_tok}
    return (cut["tp"] * cut["pp"] * cut["dp"], None,
            {"label": label, "import": True, "save": str(save), "tp": cut["tp"], "pp": cut["pp"], "ep": cut["ep"],
             "train": cut["tp"] == 1, "fp32": True, "model": model, "tokens": TOKENS,
             "logits": str(save) + "-logits.safetensors"})


@shares("megatron_load.py")
def import_moe_jobs(out):
    """Every conversion and the two negative controls (2 ranks; tp=2 or pp=2 with dp=2: 4)."""
    make_mixtral(out / "mixtral")
    jobs = []
    for index, to in enumerate(CONVERSIONS):
        megatron_import(out / "mixtral", out / f"import-{index}", to, NAMES)
        jobs.append(job(to, out / f"import-{index}", to, out / "mixtral"))
    megatron_import(out / "mixtral", out / "w1-w3", CONTROL, w1_w3_swapped(out))
    jobs.append(job("w1-w3", out / "w1-w3", CONTROL, out / "mixtral"))
    experts_swapped(out / "mixtral", out / "mixtral-swapped")
    megatron_import(out / "mixtral-swapped", out / "experts", CONTROL, NAMES)
    jobs.append(job("experts", out / "experts", CONTROL, out / "mixtral"))
    return jobs


@pytest.fixture(scope="module")
def loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(import_moe_jobs)}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "mixtral"
    make_mixtral(folder)
    return folder


@pytest.mark.engine
@pytest.mark.parametrize("to", CONVERSIONS)
def test_megatron_loads_the_mixtral_import_at_ep2_and_its_logits_are_transformers(to, loaded, source,
                                                                                   record_property):
    result = loaded[to]
    assert result["problems"] == [], result
    delta = logits_delta(result, reference_logits(source))
    record_property("max_abs_delta", delta)
    assert delta <= FP32_BOUND, delta
    if degrees(to)["tp"] == 1:      # (megatron-core trains experts at tp > 1 with sequence parallelism alone)
        assert result["losses"] and all(math.isfinite(x) for x in result["losses"]) and result["moved"]


@pytest.mark.engine
@pytest.mark.parametrize("control", ["w1-w3", "experts"])
def test_w1_w3_or_two_experts_swapped_load_and_give_other_logits(control, loaded, source):
    assert logits_delta(loaded[control], reference_logits(source)) > 1e-3     # (the shapes fit: the logits tell)


def test_the_round_trip_through_megatron_gives_the_mixtral_bit_for_bit(source, tmp_path):
    import torch
    from safetensors.torch import load_file
    megatron_import(source, tmp_path / "save", "tp=2,pp=2,dp=2,ep=2", NAMES)
    run_cli("export", tmp_path / "save", tmp_path / "back", "--names", NAMES, "--quiet", check=0)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    given = load_file(str(source / "model.safetensors"))
    assert set(back) == set(given) and all(torch.equal(back[k], given[k]) for k in given)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    wanted = json.loads((source / "config.json").read_text())
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef",
                "rope_parameters", "num_key_value_heads", "vocab_size"):
        assert config[key] == wanted[key], key
    # negative control: one expert element changed in the Megatron save, and the same comparison names that tensor
    change_dcp_element(tmp_path / "save" / "release", CHANGED[0], METADATA_ALLOWED, state="module")
    run_cli("export", tmp_path / "save", tmp_path / "changed", "--names", NAMES, "--quiet", check=0)
    changed = load_file(str(tmp_path / "changed" / "model.safetensors"))
    assert [k for k in given if not torch.equal(changed[k], given[k])] == [CHANGED[1]]


def test_the_save_holds_the_experts_args_and_megatrons_expert_stacks(source, tmp_path):
    from reshard.formats.dcp import metadata as md
    megatron_import(source, tmp_path / "save", "tp=2,pp=1,dp=2,ep=2", NAMES)
    args = vars(common_state(str(tmp_path / "save" / "release"))[0]["args"])
    assert (args["num_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"], args["ffn_hidden_size"]) == \
        (4, 2, 16, 16)
    assert args["moe_aux_loss_coeff"] == 0.02 and args["expert_model_parallel_size"] == 2
    assert args["moe_grouped_gemm"] is False and args["no_save_optim"]
    meta = md.read(str(tmp_path / "save" / "release" / ".metadata"), METADATA_ALLOWED).state_dict_metadata
    fc1 = meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    # (layers, experts, [gate; up] rows, hidden); each tp rank's gate and up halves a chunk of one layer and expert
    assert tuple(fc1.size) == (2, 4, 32, 16) and len(fc1.chunks) == 2 * 4 * 2 * 2
    assert {tuple(c.sizes) for c in fc1.chunks} == {(1, 1, 8, 16)}
    assert not any(".mlp.linear_fc1.weight" in k or ".mlp.linear_fc1._extra_state" in k for k in meta)
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4" in meta


@pytest.mark.parametrize("change, to, says", [
    (("num_local_experts", 8), "tp=1,dp=2,ep=2", "args.num_experts"),
    (None, "tp=1,dp=3,ep=3", "ep=3 must divide"),
    (None, "tp=1,ep=2", "give dp, e.g. dp=2"),
])
def test_what_contradicts_the_experts_is_refused_in_one_line(change, to, says, source, tmp_path):
    given = tmp_path / "hf"
    shutil.copytree(source, given)
    if change is not None:
        config = json.loads((given / "config.json").read_text())
        config[change[0]] = change[1]
        (given / "config.json").write_text(json.dumps(config))
    proc = run_cli("convert", given, tmp_path / "out", "--format", "megatron", "--names", NAMES, "--to", to)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
