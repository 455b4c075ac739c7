"""Tensor- and pipeline-parallel DeepSpeed checkpoints (real fixtures: AutoTP Llama tp=2 x dp=2, PipelineModule
pp=2 x dp=2): read as full tensors bit for bit, inspected, validated, exported; broken copies reported."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

import reshard
from reshard.core.placement import Shard, regions
from reshard.errors import ReshardError
from reshard.formats.deepspeed import topology as ds
from reshard.formats.deepspeed.tp_geometry import Geometry, Piece, Rule, Split, from_rule, trim_rows
from reshard.reading.source_bytes import full_tensor
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES, PARALLEL_FIXTURES, fixture_dir, truth_json, truth_tensors
from tests.helpers.repo import REPO

AUTOTP = [n for n in PARALLEL_FIXTURES if truth_json(n)["kind"] == "autotp"]
PIPE = [n for n in PARALLEL_FIXTURES if truth_json(n)["kind"] == "pipe"]
MEGATRON = [n for n in PARALLEL_FIXTURES if truth_json(n)["kind"] == "megatron"]
# tensor AND pipeline parallel: Megatron-style TP layers in a PipelineModule (tools/fixture_megatron_pipe.py)
MEGATRON_PIPE = [n for n in PARALLEL_FIXTURES if truth_json(n)["kind"] == "megatron_pipe"]
LAYOUTS = REPO / "reshard" / "layouts" / "tp-rules"
# The Megatron-style (mpu) run publishes no universal_checkpoint_info: only a rule file says how it was cut.
RULES = {name: LAYOUTS / "megatron-gpt.json" for name in MEGATRON + MEGATRON_PIPE}


def _open(name, save=None):
    return reshard.open_checkpoint(save or fixture_dir(name), layout_rules=RULES.get(name))


def _rules_args(name):
    return ["--layout-rules", RULES[name]] if name in RULES else []


def _degrees(name):
    return {"pipe": (1, 2), "megatron_pipe": (2, 2)}.get(truth_json(name)["kind"], (2, 1))


def test_the_parallel_fixtures_are_there():
    assert {"autotp2_z1_fp32_dp2", "autotp2_z1_bf16_tied_dp2", "autotp2_z2_fp32_tied_dp2",
            "autotp2_z1_fp32_uneven_dp2"} <= set(AUTOTP)
    assert PIPE == ["pipe2_tiedhead_z1_fp32_dp2", "pipe2_z1_fp32_dp2"] and MEGATRON == ["megatron_tp2_z1_fp32_dp2"]
    assert MEGATRON_PIPE == ["megatron_pipe_tp2_pp2_z1_fp32_dp2"]


def _assert_equals_truth(catalog, name):
    """Every tensor of the engine's truth, bit for bit, and nothing else in the catalog."""
    truth = truth_tensors(name)
    seen = set()
    for key, expected in truth.items():
        state, pname = key.split("/", 1)
        got = full_tensor(catalog, pname, state)
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert torch.equal(got, expected), key
        seen.add((catalog.aliases.get(pname, pname), state))
    assert set(catalog.tensors) == seen


@pytest.mark.parametrize("name", PARALLEL_FIXTURES)
def test_full_tensors_equal_the_engine_truth(name):
    catalog = _open(name)
    meta = truth_json(name)
    assert catalog.layout.world_size == meta["world_size"] and ds.of(catalog.layout).zero == meta["zero_stage"]
    assert (catalog.layout.tp, catalog.layout.pp) == _degrees(name)
    assert catalog.contents().step == meta["step"] and catalog.training.global_steps == meta["global_steps"]
    assert sorted(p for p, i in catalog.params.items() if i.kind == "trainable") == sorted(meta["trainable"])
    _assert_equals_truth(catalog, name)
    report = reshard.validate(catalog)
    assert report.ok, report.problems


def test_pipeline_names_are_the_pipeline_modules_and_the_tied_weight_appears_once():
    name = "pipe2_z1_fp32_dp2"
    catalog = reshard.open_checkpoint(fixture_dir(name))
    module_keys = sorted(k.split("/", 1)[1] for k in truth_tensors(name) if k.startswith("module/"))
    assert sorted(catalog.order) == module_keys            # the PipelineModule's state_dict keys
    assert catalog.params["tied_modules.emb.rb"].kind == "buffer"
    assert catalog.param_groups[0]["params"].count("tied_modules.emb.weight") == 1
    # both stages train the tied weight; the catalog reads stage 0's copy
    fp32 = catalog.tensors[("tied_modules.emb.weight", "fp32")]
    assert {os.path.basename(f.storage.file) for f in fp32.fragments} <= {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def test_uneven_heads_are_read_as_saved():
    catalog = reshard.open_checkpoint(fixture_dir("autotp2_z1_fp32_uneven_dp2"))
    split = catalog.notes.tp_splits["model.layers.0.self_attn.k_proj.weight"]   # 3 kv heads over 2 ranks: 2 + 1
    assert split.full_shape == (12, 24) and [p.shape for r in (0, 1) for p in split.pieces[r]] == [(8, 24), (4, 24)]


def test_a_dim1_shard_is_one_fragment_whatever_its_rows():
    catalog = reshard.open_checkpoint(fixture_dir("autotp2_z1_fp32_dp2"))
    o_proj = catalog.tensors[("model.layers.0.self_attn.o_proj.weight", "fp32")]    # row parallel (16, 16)
    assert len(o_proj.fragments) <= 4                      # one per rank, cut only by the dp partitions
    blocks = sorted({(b.at, b.shape) for f in o_proj.fragments for b in f.shard.blocks})
    assert blocks == [((0, 0), (16, 8)), ((0, 8), (16, 8))]
    q_proj = catalog.tensors[("model.layers.0.self_attn.q_proj.weight", "fp32")]    # column parallel
    assert len(q_proj.fragments) <= 4


@pytest.mark.parametrize("name", PARALLEL_FIXTURES)
def test_inspect_and_validate_commands(name):
    meta = truth_json(name)
    rules = _rules_args(name)
    info = json.loads(run_cli("inspect", fixture_dir(name), "--json", *rules, check=0).stdout)
    tp, pp = _degrees(name)
    assert info["topology"] == {"dp": 2, "tp": tp, "pp": pp, "world_size": meta["world_size"]}
    assert f"tp={tp} pp={pp}" in run_cli("inspect", fixture_dir(name), *rules, check=0).stdout
    out = run_cli("validate", fixture_dir(name), *rules, check=0).stdout
    assert out.startswith("complete")
    rows = {r["name"]: r for r in json.loads(run_cli("inspect", fixture_dir(name), "--params", "--json", *rules,
                                                     check=0).stdout)["parameter_table"]}
    if meta["kind"] == "megatron":
        layer = "language_model.encoder.layers.0."
        assert rows[layer + "mlp.dense_h_to_4h.weight"]["tensor_parallel"] == "4 boxes"     # [gate_r; up_r] x 2
        assert rows[layer + "self_attention.dense.weight"]["tensor_parallel"] == "split dim 1"
        assert rows["language_model.embedding.word_embeddings.weight"]["shape"] == [40, 8]    # padded, as trained
    elif meta["kind"] == "autotp":
        assert rows["model.layers.1.self_attn.o_proj.weight"]["tensor_parallel"] == "split dim 1"
        assert rows["model.layers.1.mlp.up_proj.weight"]["tensor_parallel"] == "split dim 0"
        assert rows["model.norm.weight"]["tensor_parallel"] == "replicated"
    elif meta["kind"] == "megatron_pipe":       # stage 0: layers 0-2, stage 1: layers 3-5
        assert rows["2.mlp.dense_h_to_4h.weight"]["tensor_parallel"] == "4 boxes"
        assert rows["3.self_attention.dense.weight"]["tensor_parallel"] == "split dim 1"
        assert rows["2.mlp.dense_h_to_4h.weight"]["stages"] == [0]
        assert rows["3.mlp.dense_h_to_4h.weight"]["stages"] == [1]
        word = rows["tied_modules.embed.word_embeddings.weight"]
        assert word["shape"] == [40, 8] and word["stages"] == [0, 1] and word["tensor_parallel"] == "split dim 0"
    else:      # the tied embedding is trained by both stages (in the tied-head model, by its head's on stage 1)
        last = "4.fc.weight" if name == "pipe2_tiedhead_z1_fp32_dp2" else "3.fc.weight"
        assert rows["tied_modules.emb.weight"]["stages"] == [0, 1] and rows[last]["stages"] == [1]


@pytest.mark.parametrize("name", PARALLEL_FIXTURES)
def test_export_is_the_truth_bit_for_bit(name, tmp_path):
    from safetensors.torch import load_file
    out = tmp_path / "model.safetensors"
    run_cli("export", fixture_dir(name), out, "--quiet", "--dtype", "fp32", *_rules_args(name), check=0)
    exported = load_file(str(out))
    truth = truth_tensors(name)
    catalog = _open(name)
    assert set(exported) == {k for k in catalog.order if k not in catalog.aliases}
    for key, value in exported.items():
        kind = catalog.params[key].kind
        expected = truth[f"fp32/{key}"] if kind == "trainable" else truth[f"module/{key}"]
        assert torch.equal(value, expected), key


@pytest.mark.parametrize("name", ["autotp2_z1_fp32_dp2", "autotp2_z2_fp32_tied_dp2", "autotp2_z1_fp32_uneven_dp2"])
def test_transformers_loads_the_export_and_gives_the_gathered_models_logits(name, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tmp_path / "hf"
    run_cli("export", fixture_dir(name), out, "--quiet", check=0)
    shutil.copy(FIXTURES / name / "hf_config" / "config.json", out / "config.json")
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    gathered = LlamaForCausalLM(LlamaConfig.from_pretrained(str(FIXTURES / name / "hf_config"))).eval()
    truth = truth_tensors(name)
    gathered.load_state_dict({k[len("module/"):]: v for k, v in truth.items() if k.startswith("module/")})
    probe = torch.arange(2 * 10).reshape(2, 10) % gathered.config.vocab_size
    with torch.no_grad():
        logits, expected = model(input_ids=probe).logits, gathered(input_ids=probe).logits
    assert torch.equal(logits, expected)
    # and the tensor-parallel engine's own logits, up to the order of its all-reduce sums
    engine_logits = torch.load(FIXTURES / name / "logits.pt")
    assert torch.allclose(logits, engine_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,spec,words", [("autotp2_z1_fp32_dp2", "dp=1,tp=4", "give it with --layout-rules"),
                                              ("z1_fp32_dp2", "dp=1,tp=2", "not an AutoTP run"),
                                              ("z1_fp32_dp2", "pp=2", "not a PipelineModule save")])
def test_convert_refuses_tensor_and_pipeline_parallel(name, spec, words, tmp_path):
    """What convert cannot write (tests/formats/deepspeed/test_tp_pp_convert.py covers what it can)."""
    proc = run_cli("convert", fixture_dir(name), tmp_path / "out", "--to", spec, check=1)
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- geometry from other sources

def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(fixture_dir(name), dst)
    return dst, dst / "global_step3"


def _rewrite(path, change):
    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def _strip_info(tag, keep_patterns=False):
    def change(sd):
        if keep_patterns:
            del sd["universal_checkpoint_info"]["affine_map"]
        else:
            del sd["universal_checkpoint_info"]
    for mp in (0, 1):
        _rewrite(tag / f"mp_rank_{mp:02d}_model_states.pt", change)


@pytest.mark.parametrize("name", ["autotp2_z1_fp32_dp2", "autotp2_z1_bf16_tied_dp2"])
def test_pattern_lists_without_affine_map_give_the_same_tensors(name, tmp_path):
    save, tag = _copy(name, tmp_path)
    _strip_info(tag, keep_patterns=True)
    _assert_equals_truth(reshard.open_checkpoint(save), name)


@pytest.mark.parametrize("name,rules", [("autotp2_z1_fp32_dp2", "llama-autotp.json"),
                                        ("autotp2_z1_fp32_uneven_dp2", "llama-autotp.json"),
                                        ("autotp2_z2_fp32_tied_dp2", "llama-autotp-tied.json")])
def test_unknown_geometry_is_refused_and_a_rule_file_gives_it(name, rules, tmp_path):
    save, tag = _copy(name, tmp_path)
    _strip_info(tag)
    proc = run_cli("inspect", save, check=1)
    assert "--layout-rules" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    _assert_equals_truth(reshard.open_checkpoint(save, layout_rules=str(LAYOUTS / rules)), name)
    run_cli("validate", save, "--layout-rules", LAYOUTS / rules, check=0)


def test_the_wrong_rule_file_is_caught_by_the_replica_check(tmp_path):
    save, tag = _copy("autotp2_z2_fp32_tied_dp2", tmp_path)
    _strip_info(tag)
    proc = run_cli("validate", save, "--layout-rules", LAYOUTS / "llama-autotp.json", check=1)
    assert "model.embed_tokens.weight" in proc.stdout and "differs from rank 0" in proc.stdout


def test_megatron_checkpoint_is_refused_without_rules_and_trimmed_with_a_vocab_size(tmp_path):
    name = MEGATRON[0]
    proc = run_cli("validate", fixture_dir(name), check=1)
    assert "without universal_checkpoint_info" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    rules = json.loads((LAYOUTS / "megatron-gpt.json").read_text())
    rules["original_vocab_size"] = 37                     # drop the 3 padding rows of the 40
    (tmp_path / "rules.json").write_text(json.dumps(rules))
    catalog = reshard.open_checkpoint(fixture_dir(name), layout_rules=str(tmp_path / "rules.json"))
    assert reshard.validate(catalog).ok
    truth = truth_tensors(name)
    for state in ("fp32", "module", "exp_avg", "exp_avg_sq"):
        key = "language_model.embedding.word_embeddings.weight"
        assert torch.equal(full_tensor(catalog, key, state), truth[f"{state}/{key}"][:37])


def test_megatron_rule_file_parses_and_refuses_unknown_names():
    geometry = Geometry.from_rule_file(str(LAYOUTS / "megatron-gpt.json"))
    qkv = geometry.split("language_model.encoder.layers.0.self_attention.query_key_value.weight",
                         {0: (24, 8), 1: (24, 8)}, 2)
    assert qkv.full_shape == (48, 8)
    swiglu = geometry.split("3.mlp.dense_h_to_4h.weight", {0: (16, 8), 1: (16, 8)}, 2)
    assert swiglu.full_shape == (32, 8) and [p.full_start for p in swiglu.pieces[1]] == [(8, 0), (24, 0)]
    with pytest.raises(ReshardError, match="rule file knows"):
        geometry.split("something.else", {0: (2,), 1: (2,)}, 2)


# ------------------------------------------------------------------------------------ geometry, synthetic

def _rebuild(split, shards):
    """The full tensor from shards through the boxes of Split.shard only (what the reader makes fragments of)."""
    full = np.full(split.full_shape, -1.0)
    for rank, values in shards.items():
        shard = split.shard(rank, values.shape) or Shard.whole(split.full_shape)
        for r in regions(shard, 0, values.size):
            full[tuple(slice(a, a + n) for a, n in zip(r.at, r.shape, strict=True))] = \
                values[tuple(slice(a, a + n) for a, n in zip(r.local, r.shape, strict=True))]
    return full


def test_fused_sub_params_and_vocab_padding_rebuild_exactly():
    rng = np.random.default_rng(0)
    gate, up = rng.normal(size=(8, 3)), rng.normal(size=(8, 3))
    shards = {r: np.concatenate([gate[4 * r:4 * r + 4], up[4 * r:4 * r + 4]]) for r in range(2)}
    split = from_rule("w", Rule("w", "sub_params", dim=0, sub_params=(2,), count_only=True),
                       {r: s.shape for r, s in shards.items()}, 2, "test")
    assert np.array_equal(_rebuild(split, shards), np.concatenate([gate, up]))

    q, k, v = rng.normal(size=(8, 2)), rng.normal(size=(4, 2)), rng.normal(size=(4, 2))   # GQA fused QKV
    shards = {r: np.concatenate([q[4 * r:4 * r + 4], k[2 * r:2 * r + 2], v[2 * r:2 * r + 2]]) for r in range(2)}
    split = from_rule("w", Rule("w", "sub_params", dim=0, sub_params=(8, 4, 4)), {0: (8, 2), 1: (8, 2)}, 2, "t")
    assert np.array_equal(_rebuild(split, shards), np.concatenate([q, k, v]))

    vocab = rng.normal(size=(10, 3))
    padded = np.concatenate([vocab, np.zeros((2, 3))])
    shards = {0: padded[:6], 1: padded[6:]}
    split = trim_rows(from_rule("e", Rule("e", "split", dim=0), {0: (6, 3), 1: (6, 3)}, 2, "t"), 10)
    assert split.full_shape == (10, 3) and np.array_equal(_rebuild(split, shards), vocab)

    cols = rng.normal(size=(3, 4, 6))          # a 3-d tensor cut along its last dim, unevenly
    shards = {0: cols[..., :4].copy(), 1: cols[..., 4:].copy()}
    split = from_rule("c", Rule("c", "split", dim=2), {0: (3, 4, 4), 1: (3, 4, 2)}, 2, "t")
    assert len(regions(split.shard(1, (3, 4, 2)), 0, 24)) == 1 and np.array_equal(_rebuild(split, shards), cols)


def test_replicated_pieces_are_read_from_their_first_holder():
    split = Split((4,), {0: [Piece((0,), (0,), (4,), (0, 1))], 1: [Piece((0,), (0,), (4,), (0, 1))]}, "t")
    assert split.shard(0, (4,)) is None and split.shard(1, (4,)).blocks == ()   # None: the whole tensor


# ------------------------------------------------------------------------------------------- broken copies

def test_missing_mp_rank_file_is_reported(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)
    os.remove(tag / "mp_rank_01_model_states.pt")
    proc = run_cli("validate", save, check=1)
    assert "mp_rank_01_model_states.pt: missing" in proc.stdout and "elements missing" in proc.stdout
    run_cli("export", save, tmp_path / "x.safetensors", check=1)
    assert not (tmp_path / "x.safetensors").exists()


def test_missing_optimizer_file_of_a_tp_rank_is_reported(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)
    os.remove(tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    proc = run_cli("validate", save, check=1)
    assert "zero_pp_rank_1_mp_rank_01_optim_states.pt: missing" in proc.stdout


def test_a_tp_rank_without_any_optimizer_file_is_reported(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)
    for dp in (0, 1):
        os.remove(tag / f"zero_pp_rank_{dp}_mp_rank_01_optim_states.pt")
    proc = run_cli("validate", save, check=1)
    assert ("no optimizer state file of model-parallel rank 1 could be read (expected "
            "zero_pp_rank_0_mp_rank_01_optim_states.pt, zero_pp_rank_1_mp_rank_01_optim_states.pt)") in proc.stdout
    assert "elements missing" in proc.stdout


def test_a_tp_rank_file_from_another_save_is_reported(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)
    _rewrite(tag / "mp_rank_01_model_states.pt", lambda sd: sd.update(global_steps=2))
    proc = run_cli("validate", save, check=1)
    assert "mp_rank_01_model_states.pt: mp_world_size 2, global_steps 2: not the same save" in proc.stdout


@pytest.mark.parametrize("gone", ["layer_03-model_states.pt", "mp_rank_01_model_states.pt"])
def test_missing_pipeline_files_are_reported(gone, tmp_path):
    save, tag = _copy("pipe2_z1_fp32_dp2", tmp_path)
    os.remove(tag / gone)
    proc = run_cli("validate", save, check=1)
    assert f"{gone}: missing" in proc.stdout


def test_a_tp_shard_of_the_wrong_shape_is_refused(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)
    key = "model.layers.1.self_attn.o_proj.weight"

    def change(sd):
        sd["param_shapes"][0][key] = torch.Size([16, 9])
    _rewrite(tag / "mp_rank_01_model_states.pt", change)
    proc = run_cli("inspect", save, check=1)
    assert key in proc.stderr and "[16, 9]" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_replicated_tensor_of_the_wrong_shape_is_refused_under_rules(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)
    _strip_info(tag)
    key = "model.norm.weight"

    def change(sd):
        sd["param_shapes"][0][key] = torch.Size([2, 8])
    _rewrite(tag / "mp_rank_01_model_states.pt", change)
    proc = run_cli("validate", save, "--layout-rules", LAYOUTS / "llama-autotp.json", check=1)
    assert key in proc.stderr and "shapes differ" in proc.stderr


def test_replicas_that_differ_are_reported(tmp_path):
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)

    def change(sd):
        sd["module"]["model.layers.0.input_layernorm.weight"][3] += 1.0
    _rewrite(tag / "mp_rank_01_model_states.pt", change)
    proc = run_cli("validate", save, check=1)
    lines = [line for line in proc.stdout.splitlines() if "differs" in line]
    assert len(lines) == 1 and "model.layers.0.input_layernorm.weight (module)" in lines[0]
    assert "rank 1 differs from rank 0" in lines[0] and "mp_rank_01_model_states.pt" in lines[0]


def test_tied_pipeline_copies_that_differ_are_reported(tmp_path):
    save, tag = _copy("pipe2_z1_fp32_dp2", tmp_path)

    def change(sd):
        sd["weight"][0, 0] += 1.0
    _rewrite(tag / "layer_04-model_states.pt", change)
    proc = run_cli("validate", save, check=1)
    assert ("layer_04-model_states.pt: tied_modules.emb.weight (module): replicated, but layer_04-model_states.pt "
            "differs from its first occurrence (first at element 0)") in proc.stdout


def test_big_replicas_are_compared_by_validate_deep(tmp_path, monkeypatch):
    from reshard.formats.deepspeed import parallel
    save, tag = _copy("autotp2_z1_fp32_dp2", tmp_path)

    def change(sd):
        sd["module"]["model.norm.weight"][5] += 1.0
    _rewrite(tag / "mp_rank_01_model_states.pt", change)
    monkeypatch.setattr(parallel, "REPLICA_CHECK_BYTES", 0)       # as if every replica were big
    catalog = reshard.open_checkpoint(save)
    assert not catalog.problems and catalog.replicas and not any(r.checked for r in catalog.replicas)
    assert reshard.validate(catalog).ok
    problems = reshard.validate(catalog, deep=True).problems
    assert len(problems) == 1 and "model.norm.weight (module): replicated, but tensor-parallel rank 1 differs " \
        "from rank 0 (first at element 5)" in problems[0]


@pytest.mark.parametrize("name,victim", [("pipe2_z1_fp32_dp2", "layer_02-model_states.pt"),
                                         ("autotp2_z1_fp32_dp2", "mp_rank_01_model_states.pt"),
                                         ("megatron_pipe_tp2_pp2_z1_fp32_dp2", "layer_03-model_01-model_states.pt")])
def test_a_hostile_pickle_in_a_layer_or_tp_rank_file_never_runs(name, victim, tmp_path):
    from make_hostile import Payload
    save, tag = _copy(name, tmp_path)
    canary = tmp_path / "canary"

    def change(sd):
        sd["evil"] = Payload(os.system, f"touch {canary}")
    _rewrite(tag / victim, change)
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    for command in (["inspect", save], ["validate", save], ["export", save, tmp_path / "x.safetensors"]):
        proc = run_cli(*command, *_rules_args(name), check=1)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and victim in lines[0] and "system" in lines[0], command
    assert not canary.exists() and not (tmp_path / "x.safetensors").exists()
    assert before == {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}


def test_pattern_lists_follow_deepspeeds_converter():
    """Prefix matching (re.match), its order, legacy sub-param counts, vocabulary padding dropped after any cut."""
    info = {"tp_replicated_parameter_patterns": [r"\d+\.input_layernorm", "shared"],
            "parameter_to_average_patterns": ["shared", "avg"],
            "parameter_with_row_parallelism_patterns": [r".*dense_4h_to_h\.weight"],
            "parameter_with_sub_params": [{"patterns": [r".*qkv"], "shape": [3, -1], "partition_dim": 0}],
            "vocabulary_parameter_patterns": [r".*word_embeddings"], "original_vocab_size": 37}
    geometry = Geometry.from_checkpoint(info, "test")

    def two(shape):
        return {0: shape, 1: shape}
    assert geometry.split("3.input_layernorm.weight", two((8,)), 2).pieces[1][0].holders == (0, 1)
    assert geometry.split("shared.bias", two((8,)), 2).full_shape == (8,)           # replicated wins over average
    with pytest.raises(ReshardError, match="averaged"):
        geometry.split("avg.weight", two((8,)), 2)
    assert geometry.split("1.dense_4h_to_h.weight", two((8, 6)), 2).full_shape == (8, 12)
    qkv = geometry.split("1.attn.qkv.weight", two((12, 8)), 2)                       # 3 equal sub-params
    assert qkv.full_shape == (24, 8) and [p.full_start[0] for p in qkv.pieces[1]] == [4, 12, 20]
    emb = geometry.split("tied_modules.embed.word_embeddings.weight", two((20, 8)), 2)
    assert emb.full_shape == (37, 8) and emb.pieces[1][0].shape == (17, 8)
    assert geometry.split("anything.else", two((4, 2)), 2).full_shape == (8, 2)      # the default: dim 0
