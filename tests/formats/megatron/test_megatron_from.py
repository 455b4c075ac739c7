"""Megatron torch_dist output of a DeepSpeed checkpoint of megatron-core's GPTModel (`convert --format megatron
--names megatron-core-modules --to tp=..,args=FILE`), proven by megatron-core 0.16.1 itself.

The source (fixtures/megatron_deepspeed/mcore_deepspeed_z1_dp2, tools/fixture_megatron_deepspeed.py) is the fixtures'
GPTModel trained by the real DeepSpeed engine (ZeRO-1, bf16, dp=2), saved under the module's own names; its truth is
the live engine's weights, fp32 masters and both Adam moments at save time. Each conversion is loaded by
`dist_checkpointing.load` into Megatron's GPTModel and optimizer built at the target topology
(tests/scripts/megatron_load.py, shared with tests/formats/megatron/test_megatron_convert.py's launch): every tensor and
the step bit for bit, one more step runs.

Negative controls: a changed element is found in what Megatron loaded; arguments that contradict the checkpoint (a
layer count, a hidden size, a beta) are refused in one line naming the argument; without the names rule file, or
without args=, the conversion is refused in one line and nothing is written.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

import reshard
from reshard.commands.convert import make_plan
from reshard.errors import ReshardError
from reshard.execution.executor import execute
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.megatron_saves import change_one_element, degrees, objects

CHANGED = "decoder.layers.1.mlp.linear_fc2.weight"      # the element the negative control changes (its exp_avg)

SOURCE = FIXTURES / "megatron_deepspeed" / "mcore_deepspeed_z1_dp2"
ARGS = SOURCE / "megatron_args.json"
NAMES = "megatron-core-modules"
# --to (args= added): every optimizer sharding, tp, pp and dp changed
CONVERSIONS = ["tp=1,pp=1,dp=2", "tp=1,pp=2,dp=1,sharding=plain", "tp=2,pp=1,dp=1,sharding=fully_reshardable"]
UNIVERSAL = "tp=2,pp=1,dp=1"     # the universal checkpoint of the same run, to Megatron (dp_reshardable)


def _convert(to: str, dst, args=ARGS) -> None:
    plan = make_plan(reshard.open_checkpoint(str(SOURCE / "checkpoint")), f"{to},args={args}", fmt="megatron",
                     names=NAMES)
    execute(plan, str(dst), progress=False)


@shares("megatron_load.py")
def megatron_load_jobs(out):
    """Each conversion and the changed one: 2 ranks, in tests/formats/megatron/test_megatron_convert.py's launch."""
    jobs = []
    truth = str(SOURCE / "truth.safetensors")
    for index, to in enumerate(CONVERSIONS):
        dst = out / f"from-deepspeed-{index}"
        _convert(to, dst)
        cut = degrees(to)
        jobs.append({"label": to, "save": str(dst), "tp": cut["tp"], "pp": cut["pp"], "truth": truth})
    # the same run by way of reshard's universal checkpoint of it: universal -> Megatron
    execute(make_plan(reshard.open_checkpoint(str(SOURCE / "checkpoint")), "dp=1", fmt="universal"),
            str(out / "universal"), progress=False)
    plan = make_plan(reshard.open_checkpoint(str(out / "universal")), f"{UNIVERSAL},args={ARGS}", fmt="megatron",
                     names=NAMES)
    execute(plan, str(out / "from-universal"), progress=False)
    cut = degrees(UNIVERSAL)
    jobs.append({"label": "universal", "save": str(out / "from-universal"), "tp": cut["tp"], "pp": cut["pp"],
                 "truth": truth})
    changed = out / "from-deepspeed-changed" / "save"
    _convert(CONVERSIONS[0], changed)
    change_one_element(changed, CHANGED)
    jobs.append({"label": "changed", "save": str(changed), "tp": 1, "pp": 1, "truth": truth})
    return [(2, None, job) for job in jobs]


@pytest.fixture(scope="module")
def loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(megatron_load_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("to", CONVERSIONS)
def test_megatron_loads_the_deepspeed_run_as_the_engine_held_it_and_trains_on(to, loaded):
    result = loaded[to]
    assert result["loaded"] and result["error"] is None, result
    assert result["problems"] == [], result["problems"]      # weights, masters, moments bit for bit
    step = json.loads((SOURCE / "truth.json").read_text())["step"]
    assert result["step"] == step and result["group_step"] == ([] if "plain" in to else step)
    assert result["losses"] and all(math.isfinite(x) for x in result["losses"])
    assert result["moved"] and result["step_after"] == [step[0] + 1]


@pytest.mark.engine
def test_megatron_loads_the_runs_universal_checkpoint_as_the_engine_held_it(loaded):
    """DeepSpeed -> universal (reshard) -> Megatron: the universal checkpoint holds the same tensors, and the same
    arguments file gives the common state."""
    result = loaded["universal"]
    assert result["loaded"] and result["error"] is None and result["problems"] == [], result
    assert result["moved"] and result["step_after"] == [json.loads((SOURCE / "truth.json").read_text())["step"][0] + 1]


@pytest.mark.engine
def test_a_changed_element_is_found_in_what_megatron_loaded(loaded):
    result = loaded["changed"]
    assert result["loaded"] and result["problems"] == [f"exp_avg/{CHANGED}: differs from the truth"], result


# -- what is written and refused (no engine)

def test_the_common_state_is_the_users_arguments_and_the_runs_counters(tmp_path):
    """common.pt holds the given arguments at the target's degrees, the iteration and samples DeepSpeed recorded,
    the given scheduler state, megatron-core's two default param groups with the engine's hyper-parameters; the
    layers' extra-state objects are the ones megatron-core's own save of the same GPTModel holds."""
    import torch
    _convert("tp=2,pp=1,dp=1", tmp_path / "out")
    common = torch.load(tmp_path / "out" / "iter_0000003" / "common.pt", weights_only=False)
    given = json.loads(ARGS.read_text())
    args = vars(common["args"])
    assert {k: args[k] for k in given["args"]} == given["args"]
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"], args["data_parallel_size"]) == \
        (2, 1, 1)
    assert args["iteration"] == common["iteration"] == 3 and args["consumed_train_samples"] == 12
    assert args["no_save_rng"] and args["ckpt_format"] == "torch_dist"
    assert common["opt_param_scheduler"] == given["opt_param_scheduler"] and common["checkpoint_version"] == 3.0
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    megatrons = {k for k in objects(FIXTURES / "megatron_core" / "mcore_dp_reshardable_tp2_dp2" / "save")
                 if "._extra_state/" in k}
    ours = objects(tmp_path / "out")
    assert {k for k in ours if "._extra_state/" in k} == megatrons and all(ours[k] == [None] for k in megatrons)
    groups = [v for k, v in ours.items() if k.endswith(".optimizer/shard_0_1")][0][0]["param_groups"]
    assert [(g["wd_mult"], g["weight_decay"], g["betas"], g["step"]) for g in groups] == \
        [(1.0, 0.01, (0.9, 0.95), 3.0), (0.0, 0.0, (0.9, 0.95), 3.0)]


@pytest.mark.parametrize("change, words", [
    (("args", "num_layers", 3), "args.num_layers = 3: the checkpoint holds 2 layers"),
    (("args", "hidden_size", 32), "args.padded_vocab_size, args.hidden_size make embedding.word_embeddings.weight"),
    (("args", "adam_beta2", 0.999), "args.adam_beta2 = 0.999: the checkpoint's param group 0 holds 0.95"),
    (("args", "swiglu", False), "args.ffn_hidden_size, args.swiglu make decoder.layers.0.mlp.linear_fc1.weight"),
    (("args", "lr", None), "args.lr is not given"),
    (("args", "transformer_impl", None), "args.transformer_impl is not given"),
    (("opt_param_scheduler", "num_steps", None), "opt_param_scheduler.num_steps is not given"),
    (("iteration", None, 7), "iteration = 7: the checkpoint's is 3"),
    (("args", "iteration", 5), "args.iteration = 5: the checkpoint's is 3"),
    (("args", "consumed_train_samples", 99), "args.consumed_train_samples = 99: the checkpoint's is 12"),
])
def test_arguments_that_contradict_the_checkpoint_are_refused_in_one_line(tmp_path, change, words):
    data = json.loads(ARGS.read_text())
    part, key, value = change
    if key is None:
        data[part] = value
    elif value is None:
        del data[part][key]
    else:
        data[part][key] = value
    path = tmp_path / "args.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ReshardError) as refused:
        _convert("tp=2", tmp_path / "out", path)
    assert words in str(refused.value) and str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_without_the_names_or_the_arguments_it_is_refused_in_one_line(tmp_path):
    source = SOURCE / "checkpoint"
    for extra, words, status in ((["--to", f"tp=2,args={ARGS}"], "--names megatron-core-modules brings them back", 1),
                                 (["--names", NAMES, "--to", "tp=2"], "args=FILE", 2),
                                 (["--names", NAMES, "--to", f"tp=2,args={tmp_path / 'none.json'}"], "cannot be read",
                                  2)):
        refused = run_cli("convert", source, tmp_path / "x", "--format", "megatron", *extra, check=None)
        assert refused.returncode == status and words in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("rule, words", [
    ({"match": "(a)\\.(b)", "name": "x.\\1", "join": ["\\1.c", "\\1.d"]}, "only renames can be undone"),
    ({"match": "a.*\\.(b)", "name": "x.\\1"}, "outside a group"),
    ({"match": "(a)\\.(b)", "name": "x.\\1"}, "leaves out a group"),
    ({"match": "((a)b)\\.c", "name": "x.\\1"}, "a capturing group inside another"),
])
def test_a_names_rule_that_cannot_be_undone_is_refused_in_one_line(tmp_path, rule, words):
    from reshard.rules import module_names
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"kind": "reshard.module-names", "version": 1, "description": "t", "rules": [rule]}))
    with pytest.raises(ReshardError) as refused:
        module_names.inverted(module_names.load(str(path)))
    assert words in str(refused.value) and str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_the_shipped_names_undone_give_torch_dist_keys_and_come_back():
    from reshard.rules import module_names
    forward = module_names.load(NAMES)
    back = module_names.inverted(forward)
    for name, key in (("decoder.layers.1.input_layernorm.weight", "decoder.layers.1.self_attention.linear_qkv."
                       "layer_norm_weight"), ("decoder.layers.0.pre_mlp_layernorm.bias",
                                              "decoder.layers.0.mlp.linear_fc1.layer_norm_bias"),
                      ("output_layer.weight", "output_layer.weight")):
        assert back.rename(name) == key and forward.rename(key) == name


@pytest.mark.parametrize("fmt", ["deepspeed", "universal", "dcp"])
def test_the_deepspeed_run_converts_to_the_other_formats_past_its_empty_extra_states(tmp_path, fmt):
    """Its module state dict holds megatron-core's layers' `_extra_state: None` entries, which no writer places:
    each writer leaves them out (once a KeyError traceback), and the output holds every tensor as the source."""
    source = str(SOURCE / "checkpoint")
    assert any(n.endswith("._extra_state") for n in reshard.open_checkpoint(source).order)
    execute(make_plan(reshard.open_checkpoint(source), "dp=1", fmt=fmt), str(tmp_path / fmt), progress=False)
    diff = run_cli("diff", source, tmp_path / fmt, check=0)
    assert diff.returncode == 0 and "no difference" in diff.stdout
