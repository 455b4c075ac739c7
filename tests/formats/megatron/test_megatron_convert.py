"""Megatron torch_dist output (`convert` of a Megatron save to another tp, pp, dp or optimizer sharding), proven by
megatron-core 0.16.1 itself: each conversion of the fixtures (fixtures/megatron_core/, real saves) is loaded by
`dist_checkpointing.load` into Megatron's GPTModel and optimizer built at the target topology
(tests/scripts/megatron_load.py, 2 ranks, one launch for every job; 4 for a mixture of experts at ep=4 or with
expert-data-parallel ranks), and the live model's weights, fp32 masters, both Adam moments and the step are
the truth taken from the live run at save time, bit for bit; one more training step runs. Sources of every layout
the reader reads: 0.16's, and the saves 0.16 cannot load itself (0.15's fully_sharded_model_space, 0.19's, the legacy
torch format's); a mixture of experts' (mcore_moe_*: ep=2 -> 1, 1 -> 2, 4, and dp=4 at ep=2).

Negative controls: Megatron's own load of the dp_reshardable fixture at another tp fails (what makes the writer
necessary), and of the MoE fixture at another ep; a conversion with one element changed loads, and the comparison
names that tensor.

DeepSpeed output of a Megatron save (`--format deepspeed --names megatron-core-modules`) is resumed by the real
DeepSpeed engine around megatron-core's own GPTModel (tests/scripts/megatron_deepspeed_load.py): masters, moments,
weights bit for bit, one more step; without the names the engine's load fails.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

import reshard
from reshard.commands.convert import make_plan
from reshard.errors import ReshardError, UsageError
from reshard.execution.executor import execute
from reshard.formats.dcp import metadata as dcp_metadata
from reshard.formats.megatron.pickles import METADATA_ALLOWED
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES, fixture_dir
from tests.helpers.megatron_saves import change_one_element, degrees, objects

ROOT = FIXTURES / "megatron_core"
# (fixture, --to): tp, pp and dp changed, every optimizer sharding written, from every sharding read
CONVERSIONS = [
    ("mcore_dp_reshardable_tp2_dp2", "tp=1,pp=2,dp=1"),                          # dp_reshardable, tp 2->1, pp 1->2
    ("mcore_dp_reshardable_tp2_pp2_dp2", "tp=1,pp=1,dp=2"),                      # tp and pp to 1
    ("mcore_fully_reshardable_tp2_dp2", "tp=1,pp=2,dp=1"),                       # fully_reshardable kept
    ("mcore_plain_tp2_pp2", "tp=1,pp=1,dp=2,sharding=dp_reshardable"),           # plain -> distributed, dp 1->2
    ("mcore_dp_reshardable_tp2_dp2", "tp=2,pp=1,dp=1,sharding=plain"),           # distributed -> plain, RNG kept
    ("mcore_dp_reshardable_tp2_pp2_dp2", "tp=1,pp=2,dp=1,sharding=fully_reshardable"),
    ("mcore_plain_tp2_pp2", "tp=2,pp=1,dp=1"),                                   # plain stays plain
    # other layouts -> torch_dist as 0.16 writes it (0.16 cannot load 0.15's nor 0.19's saves, nor the legacy format)
    ("mcore_legacy_plain_tp2_pp2", "tp=1,pp=1,dp=2,sharding=dp_reshardable"),    # legacy, plain -> distributed
    ("mcore_legacy_distributed_tp2_dp2", "tp=1,pp=2,dp=1"),                      # legacy distrib_optim.pt
    ("mcore_dp_reshardable_tp2_dp2_v019", "tp=1,pp=1,dp=2"),                     # 0.19: the common state in DCP
    ("mcore_dp_reshardable_tp2_dp2_v019", "tp=2,pp=1,dp=1,sharding=fully_reshardable"),   # its RNG state kept, asked
    ("mcore_fully_sharded_model_space_tp2_dp2_v015", "tp=1,pp=1,dp=2,sharding=dp_reshardable"),   # 0.15
    # a mixture of experts (4 per layer), ep=2 -> ep=1 (the experts then dense params: one buffer, one optimizer)
    ("mcore_moe_dp_reshardable_ep2_dp2", "tp=1,pp=1,dp=2,ep=1"),
    ("mcore_moe_fully_reshardable_ep2_dp2", "tp=1,pp=1,dp=2,ep=1"),
    ("mcore_moe_dp_reshardable_ep2_dp2", "tp=1,pp=1,dp=2,ep=2,sharding=fully_reshardable"),
]
MOE_BACK = ("mcore_moe_dp_reshardable_ep2_dp2", "tp=1,pp=1,dp=2,ep=1", "tp=1,pp=1,dp=2,ep=2")   # ep 1 -> 2
# loaded by 4 ranks (a launch of its own): ep=4 (one expert per rank), and ep=2 with two expert-data-parallel ranks
MOE_WIDE = [("mcore_moe_dp_reshardable_ep2_dp2", "tp=1,pp=1,dp=4,ep=4"),
            ("mcore_moe_dp_reshardable_ep2_dp2", "tp=1,pp=1,dp=4,ep=2")]
CHANGED = "decoder.layers.1.mlp.linear_fc2.weight"      # the element the negative control changes (its exp_avg)
MOE_CHANGED = "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight"


def _ids():
    return [f"{name.removeprefix('mcore_')}-{to}" for name, to in CONVERSIONS + MOE_WIDE]


def _experts(name: str, degrees: dict) -> dict:
    """A mixture of experts' job keys for tests/scripts/megatron_load.py (its model built with the
    experts, at the ep)."""
    info = json.loads((ROOT / name / "truth.json").read_text())
    return {"ep": degrees.get("ep", info["ep"]), "experts": info["experts"]} if "ep" in info else {}


def _convert(name: str, to: str, dst) -> None:
    execute(make_plan(reshard.open_checkpoint(str(ROOT / name / "save")), to), str(dst), progress=False)


@shares("megatron_load.py")
def megatron_load_jobs(out):
    """Every conversion, the changed one and Megatron's own load of a dp_reshardable save at another tp (and ep): 2
    ranks; MOE_WIDE's conversions: 4."""
    jobs = []
    for index, (name, to) in enumerate(CONVERSIONS):
        dst = out / f"conversion-{index}"
        _convert(name, to, dst)
        cut = degrees(to)
        jobs.append({"label": f"{name}:{to}", "save": str(dst), "tp": cut["tp"], "pp": cut["pp"],
                     "truth": str(ROOT / name / "truth.safetensors"), **_experts(name, cut)})
    name, first, back = MOE_BACK        # ep 2 -> 1 -> 2: a conversion's output as the source
    _convert(name, first, out / "moe-ep1")
    execute(make_plan(reshard.open_checkpoint(str(out / "moe-ep1")), back), str(out / "moe-back"), progress=False)
    jobs.append({"label": "moe ep1 -> ep2", "save": str(out / "moe-back"), "tp": 1, "pp": 1,
                 "truth": str(ROOT / name / "truth.safetensors"), **_experts(name, degrees(back))})
    name, to = CONVERSIONS[0]
    changed = out / "changed" / "save"
    _convert(name, to, changed)
    change_one_element(changed, CHANGED)
    jobs.append({"label": "changed", "save": str(changed), "tp": 1, "pp": 2,
                 "truth": str(ROOT / name / "truth.safetensors")})
    jobs.append({"label": "megatron itself", "save": str(ROOT / name / "save"), "tp": 1, "pp": 1,
                 "truth": str(ROOT / name / "truth.safetensors")})
    moe = MOE_BACK[0]
    changed = out / "moe-changed" / "save"     # one expert's element, in the dense buffer at ep=1
    _convert(moe, MOE_BACK[1], changed)
    change_one_element(changed, MOE_CHANGED)
    jobs.append({"label": "moe changed", "save": str(changed), "tp": 1, "pp": 1,
                 "truth": str(ROOT / moe / "truth.safetensors"), **_experts(moe, degrees(MOE_BACK[1]))})
    jobs.append({"label": "megatron itself at another ep", "save": str(ROOT / moe / "save"), "tp": 1, "pp": 1,
                 "truth": str(ROOT / moe / "truth.safetensors"), "ep": 1, "experts": 4})
    wide = []
    for index, (name, to) in enumerate(MOE_WIDE):
        dst = out / f"wide-{index}"
        _convert(name, to, dst)
        wide.append({"label": f"{name}:{to}", "save": str(dst), "tp": 1, "pp": 1,
                     "truth": str(ROOT / name / "truth.safetensors"), **_experts(name, degrees(to))})
    return [(2, None, job) for job in jobs] + [(4, None, job) for job in wide]


@pytest.fixture(scope="module")
def loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(megatron_load_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("name, to", CONVERSIONS + MOE_WIDE, ids=_ids())
def test_megatron_loads_the_conversion_as_the_truth_and_trains_on(name, to, loaded):
    result = loaded[f"{name}:{to}"]
    assert result["loaded"] and result["error"] is None, result
    assert result["problems"] == [], result["problems"]      # every weight, master and moment bit for bit
    step = json.loads((ROOT / name / "truth.json").read_text())["step"]
    plain = "sharding=plain" in to or ("plain" in name and "sharding=" not in to)
    assert result["step"] == step and result["group_step"] == ([] if plain else step)
    assert result["losses"] and all(math.isfinite(x) for x in result["losses"])
    assert result["moved"] and result["step_after"] == [step[0] + 1]


@pytest.mark.engine
def test_a_changed_expert_element_is_found_in_what_megatron_loaded(loaded):
    result = loaded["moe changed"]
    assert result["loaded"] and result["problems"] == [f"exp_avg/{MOE_CHANGED}: differs from the truth"], result


@pytest.mark.engine
def test_megatron_loads_an_ep1_conversion_converted_back_to_ep2(loaded):
    result = loaded["moe ep1 -> ep2"]
    assert result["loaded"] and result["problems"] == [], result
    assert result["step"] == [3.0] and result["moved"] and result["step_after"] == [4.0]


@pytest.mark.engine
def test_megatron_itself_cannot_load_dp_reshardable_at_another_ep(loaded):
    """Its experts' optimizer is chained to the dense one only at ep > 1: at ep=1 it asks for unchained buckets."""
    result = loaded["megatron itself at another ep"]
    assert not result["loaded"]
    assert "KeyError" in result["error"] and "bucket_idx_0.param from model not in state dict" in result["error"]


@pytest.mark.engine
def test_megatron_itself_cannot_load_dp_reshardable_at_another_tp(loaded):
    result = loaded["megatron itself"]
    assert not result["loaded"]
    assert "Global shape mismatch" in result["error"] and "bucket_idx_0.param" in result["error"], result["error"]


@pytest.mark.engine
def test_a_changed_element_is_found_in_what_megatron_loaded(loaded):
    result = loaded["changed"]
    assert result["loaded"] and result["problems"] == [f"exp_avg/{CHANGED}: differs from the truth"], result


# (fixture, --to) written as DeepSpeed for an engine around megatron-core's GPTModel (tp=1, pp=1, dp=2)
DEEPSPEED = [("mcore_fully_reshardable_tp2_dp2", "dp=2,tp=1,pp=1,zero=1")]


@shares("megatron_deepspeed_load.py")
def deepspeed_load_jobs(out):
    """Each DeepSpeed conversion under the module's names, and one without them (the control): 2 ranks."""
    jobs = []
    for index, (name, to) in enumerate([*DEEPSPEED, DEEPSPEED[0]]):
        names = "megatron-core-modules" if index < len(DEEPSPEED) else None
        dst = out / f"deepspeed-{index}"
        plan = make_plan(reshard.open_checkpoint(str(ROOT / name / "save")), to, fmt="deepspeed", names=names)
        execute(plan, str(dst), progress=False)
        jobs.append({"label": f"{name}:{to}" if names else "without names", "checkpoint": str(dst),
                     "truth": str(ROOT / name / "truth.safetensors"), "zero": int(to.rsplit("zero=", 1)[1])})
    return [(2, None, job) for job in jobs]


@pytest.fixture(scope="module")
def resumed(engine_launches):
    return {r["label"]: r for r in engine_launches.results(deepspeed_load_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("name, to", DEEPSPEED, ids=[t for _, t in DEEPSPEED])
def test_deepspeed_resumes_megatrons_model_from_the_conversion(name, to, resumed):
    result = resumed[f"{name}:{to}"]
    assert result["error"] is None and result["problems"] == [], result
    step = json.loads((ROOT / name / "truth.json").read_text())["step"][0]
    assert result["step"] == step and result["step_after"] == step + 1
    assert result["moved"] and all(math.isfinite(x) for x in result["losses"])


@pytest.mark.engine
def test_deepspeed_output_without_the_modules_names_does_not_load(resumed):
    error = resumed["without names"]["error"] or ""
    assert "Missing key" in error and "input_layernorm" in error, error


# -- reshard's own checks of the output (no engine)

def test_the_output_reads_back_equal_and_names_the_target(tmp_path):
    name, to = CONVERSIONS[3]
    _convert(name, to, tmp_path / "out")
    info = reshard.inspect(reshard.open_checkpoint(str(tmp_path / "out")))
    assert (info.topology.tp, info.topology.pp, info.topology.dp) == (1, 1, 2)
    assert info.options["sharding"] == "dp_reshardable" and info.tag == "iter_0000003" and info.problems == 0
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "3"
    diff = run_cli("diff", ROOT / name / "save", tmp_path / "out", check=0)
    assert "no difference" in diff.stdout


def test_what_megatron_cannot_take_is_refused_in_one_line(tmp_path):
    save = reshard.open_checkpoint(str(ROOT / "mcore_dp_reshardable_tp2_dp2" / "save"))
    for to, words in (("tp=3", "tp=3"), ("pp=3", "pipeline stages"), ("sharding=zero", "sharding is")):
        with pytest.raises((ReshardError, UsageError)) as refused:
            make_plan(save, to)
        assert words in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UsageError, match="iter_NNNNNNN"):
        make_plan(save, "tp=1", tag_out="step3")
    # Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp: a target tp whose padding
    # the saved rows do not tell (64 rows at 16 x 2 are a vocabulary of 33 to 64 tokens: 48 or 64 rows at 16 x 1)
    # asks for the tokenizer's size (re-padding itself: tests/formats/megatron/test_megatron_mlm.py)
    import torch
    padded = shutil.copytree(ROOT / "mcore_dp_reshardable_tp2_dp2" / "save", tmp_path / "padded")
    common = torch.load(padded / "iter_0000003" / "common.pt", weights_only=False)
    common["args"].make_vocab_size_divisible_by = 16
    torch.save(common, padded / "iter_0000003" / "common.pt")
    padded_save = reshard.open_checkpoint(str(padded))
    with pytest.raises(ReshardError, match=r"tp = 16, which for the 64 rows saved depends on") as refused:
        make_plan(padded_save, "tp=1,dp=2")
    assert "\n" not in str(refused.value)
    execute(make_plan(padded_save, "tp=1,dp=2,vocab=40"), str(tmp_path / "cut"), progress=False)   # (the control)
    assert reshard.open_checkpoint(str(tmp_path / "cut")).tensors[("output_layer.weight", "exp_avg")].shape == \
        (48, 16)
    deepspeed = run_cli("convert", fixture_dir("z2_fp32_dp2"), tmp_path / "x", "--format", "megatron", "--to", "dp=1")
    assert deepspeed.returncode == 2 and "does not hold: give the run's Megatron-LM arguments" in deepspeed.stderr
    assert len(deepspeed.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_round_trip_through_tp1_writes_megatrons_own_keys_and_chunks(tmp_path):
    """tp=2·pp=2·dp=2 -> tp=1 -> tp=2·pp=2·dp=2 again: every tensor key, global shape and chunk box of megatron-core's
    own save (its dp_reshardable buckets' per-rank cuts included), and the same elements; only the RNG state is left
    out, as it is on any change of tp or pp."""
    name = "mcore_dp_reshardable_tp2_pp2_dp2"
    _convert(name, "tp=1", tmp_path / "tp1")
    execute(make_plan(reshard.open_checkpoint(str(tmp_path / "tp1")), "tp=2,pp=2,dp=2"), str(tmp_path / "back"),
            progress=False)
    original, back = (dcp_metadata.read(str(folder / "iter_0000003" / ".metadata"), METADATA_ALLOWED)
                      for folder in (ROOT / name / "save", tmp_path / "back"))

    def boxes(meta):
        return {key: (tuple(entry.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks))
                if isinstance(entry, dcp_metadata.TensorStorageMetadata) else None
                for key, entry in meta.state_dict_metadata.items()}
    ours, megatrons = boxes(back), boxes(original)
    assert {k for k in megatrons if k not in ours} == {f"rng_state/shard_{p}.{t}_2.2" for p in (0, 1) for t in (0, 1)}
    assert ours == {k: v for k, v in megatrons.items() if not k.startswith("rng_state/")}
    assert "no difference" in run_cli("diff", ROOT / name / "save", tmp_path / "back", check=0).stdout


def test_the_sparse_scale_simulation_reads_as_what_it_lays_out(tmp_path):
    """tools/bench_megatron_sparse.py at a small scale (4 layers, tp=2·pp=2·dp=2): the sparse save it writes with
    reshard's writer reads back complete at that topology, dp_reshardable buckets checked against its stored counts,
    and plans to another one (the 70B-shaped figures in docs/performance.md come from the same tool)."""
    import bench_megatron_sparse  # (tools/ is on the path: conftest)
    files, apparent = bench_megatron_sparse.make(str(tmp_path / "save"), 2, 2, 2, 4)
    assert files == 12 and apparent > 5 * 10**10
    report = reshard.validate(reshard.open_checkpoint(str(tmp_path / "save")))
    assert not report.problems and report.missing_elements == 0 and report.duplicate_elements == 0
    info = reshard.inspect(reshard.open_checkpoint(str(tmp_path / "save")))
    assert (info.topology.tp, info.topology.pp, info.topology.dp) == (2, 2, 2)
    assert info.options["sharding"] == "dp_reshardable" and info.parameters == 4 * 6 + 3
    plan = make_plan(reshard.open_checkpoint(str(tmp_path / "save")), "tp=1,pp=4,dp=2")
    assert plan.output is not None and plan.output.topology.startswith("dp=2,tp=1,pp=4")


def test_a_legacy_source_writes_the_objects_megatron_writes_for_the_same_run(tmp_path):
    """Legacy -> torch_dist: the layers' `_extra_state` values of the rank files (None, the local spec's) become the
    objects megatron-core 0.16's own torch_dist save of the same run holds ([None] per layer and module, under the
    same keys), the output layer's left out as GPTModel's sharded state dict leaves it out; every other object and
    key as the conversion of that torch_dist save writes it. The legacy RNG lists are not written: args say so."""
    import torch
    to = "tp=1,pp=2,dp=1"
    _convert("mcore_legacy_distributed_tp2_dp2", to, tmp_path / "legacy")
    _convert("mcore_dp_reshardable_tp2_dp2", to, tmp_path / "torch_dist")
    ours, same_run = objects(tmp_path / "legacy"), objects(tmp_path / "torch_dist")
    megatrons = {k: v for k, v in objects(ROOT / "mcore_dp_reshardable_tp2_dp2" / "save").items()
                 if "._extra_state/" in k}
    assert megatrons and all(v == [None] for v in megatrons.values())
    assert {k: v for k, v in ours.items() if "._extra_state/" in k} == megatrons
    assert ours.keys() == same_run.keys() and all(not k.startswith("rng_state/") for k in ours)
    for key in ours:
        if "._extra_state/" not in key:
            assert repr(ours[key]) == repr(same_run[key]), key
    common = torch.load(tmp_path / "legacy" / "iter_0000003" / "common.pt", weights_only=False)
    reference = torch.load(tmp_path / "torch_dist" / "iter_0000003" / "common.pt", weights_only=False)
    assert common["content_metadata"] == reference["content_metadata"]
    assert vars(common["args"]) == vars(reference["args"]) and common["args"].ckpt_format == "torch_dist"
    assert common["args"].no_save_rng and common.keys() == reference.keys()


def test_a_legacy_extra_state_that_holds_a_value_is_refused_in_one_line(tmp_path):
    """Only empty extra states (the local spec's None) are known: one holding something (Transformer Engine's FP8
    metadata) is refused naming the file, nothing written."""
    import torch
    save = tmp_path / "save"
    shutil.copytree(ROOT / "mcore_legacy_plain_tp2_pp2" / "save", save)
    path = save / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"] = {"fp8_meta": 1}
    torch.save(state, path)
    refused = run_cli("convert", save, tmp_path / "out", "--to", "tp=1,pp=1,dp=2")
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "mp_rank_00_001" in refused.stderr and "linear_fc1._extra_state holds a dict" in refused.stderr
    assert not (tmp_path / "out").exists()
