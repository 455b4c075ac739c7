"""Tensor AND pipeline parallel together: the real tp2 x pp2 x dp2 save of Megatron-style TP layers in a
PipelineModule (tools/fixture_megatron_pipe.py, 8 ranks), read with reshard/layouts/tp-rules/megatron-gpt.json.

Without the engine: converted to tp1.pp2.dp2, tp2.pp1.dp2, tp1.pp1.dp4 every tensor equals the engine's truth,
`validate --deep` finds nothing, and converting back to tp2.pp2.dp2 gives DeepSpeed's own files (tensor bytes
equal but padding, pickles equal as trees). With the engine (tests/scripts/engine_tp_pp_resume.py under torchrun): the
unmodified PipelineEngine over the same layers resumes each conversion with the truth bit for bit and trains on;
the same engine then loads the fixture itself through reshard.deepspeed_engine.load_checkpoint, bit for bit again.
"""
import math
import os
from pathlib import Path

import pytest
import torch

import reshard
from reshard.commands.convert import make_plan
from reshard.errors import ReshardError
from reshard.execution.executor import execute
from reshard.formats import target_layout
from reshard.formats.deepspeed import topology as ds
from tests.helpers.cli import run_cli
from tests.helpers.deepspeed_files import assert_same_files, covered_elements
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES, fixture_dir, tag_dir, truth_tensors
from tests.helpers.repo import REPO

NAME = "megatron_pipe_tp2_pp2_z1_fp32_dp2"
RULES = REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json"
TARGETS = ["tp=1,pp=2,dp=2", "tp=2,pp=1,dp=2", "tp=1,pp=1,dp=4"]


def _open(path):
    return reshard.open_checkpoint(path, layout_rules=str(RULES))


def _convert(src, dst, to):
    execute(make_plan(_open(src), to), str(dst), progress=False)
    return _open(dst)


def _layer_files(path):
    return sorted(n for n in os.listdir(tag_dir(path)) if n.startswith("layer_"))


def test_the_3d_save_holds_deepspeeds_file_names():
    names = sorted(os.listdir(tag_dir(fixture_dir(NAME))))
    assert _layer_files(fixture_dir(NAME)) == [f"layer_{i:02d}-model_{t:02d}-model_states.pt"
                                               for i in range(6) for t in range(2)]
    assert [n for n in names if n.startswith("mp_rank")] == [f"mp_rank_{r:02d}_model_states.pt" for r in range(4)]
    assert len([n for n in names if n.endswith("optim_states.pt")]) == 8
    catalog = _open(fixture_dir(NAME))
    assert (catalog.layout.tp, catalog.layout.pp, catalog.layout.dp) == (2, 2, 2)
    # mp rank = stage * tp + tp rank: stage 1's TP rank 1 (mp_rank_03) trains the final norm, stage 0 does not
    stages = catalog.notes.stages
    assert stages["4.final_layernorm.weight"] == [1] and stages["2.mlp.dense_h_to_4h.weight"] == [0]


@pytest.mark.parametrize("to", TARGETS)
def test_converts_to_the_truth_and_back_to_deepspeeds_own_files(to, tmp_path):
    out = _convert(fixture_dir(NAME), tmp_path / "out", to)
    target = target_layout(_open(fixture_dir(NAME)).layout, to, "deepspeed")
    assert (out.layout.tp, out.layout.pp, out.layout.dp, ds.of(out.layout).zero) == (target.tp, target.pp, target.dp, 1)
    report = reshard.validate(out, deep=True)
    assert report.ok, report.problems
    truth = truth_tensors(NAME)
    assert set(out.tensors) == {(k.split("/", 1)[1], k.split("/", 1)[0]) for k in truth}
    for key, expected in truth.items():
        state, name = key.split("/", 1)
        assert torch.equal(reshard.full_tensor(out, name, state), expected), key
    suffix = (lambda t: f"-model_{t:02d}") if target.tp > 1 else (lambda t: "")
    assert _layer_files(tmp_path / "out") == sorted(f"layer_{i:02d}{suffix(t)}-model_states.pt"
                                                    for i in range(6) for t in range(target.tp))
    _convert(tmp_path / "out", tmp_path / "back", "tp=2,pp=2,dp=2,partition=uniform")
    assert_same_files(tag_dir(fixture_dir(NAME)), tag_dir(tmp_path / "back"),
                      covered_elements(_open(fixture_dir(NAME))))


def test_cli_convert_and_export(tmp_path):
    run_cli("convert", fixture_dir(NAME), tmp_path / "tp1", "--to", "tp=1,pp=2", "--layout-rules", RULES, check=0)
    run_cli("export", tmp_path / "tp1", tmp_path / "m.safetensors", "--quiet", check=0)
    from safetensors.torch import load_file
    exported, truth = load_file(str(tmp_path / "m.safetensors")), truth_tensors(NAME)
    assert set(exported) == {k[5:] for k in truth if k.startswith("fp32/")}
    assert all(torch.equal(v, truth[f"fp32/{k}"]) for k, v in exported.items())
    # back up to tp=2: how the layers are cut is in the rule file only
    proc = run_cli("convert", tmp_path / "tp1", tmp_path / "tp2", "--to", "tp=2,pp=2", check=1)
    assert "--layout-rules" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    run_cli("convert", tmp_path / "tp1", tmp_path / "tp2", "--to", "tp=2,pp=2", "--layout-rules", RULES, check=0)
    assert_same_files(tag_dir(fixture_dir(NAME)), tag_dir(tmp_path / "tp2"),
                      covered_elements(_open(fixture_dir(NAME))))


def test_a_tied_copy_that_differs_is_found_now_or_by_validate_deep(tmp_path, monkeypatch):
    import shutil

    from reshard.formats.deepspeed import parallel
    save = tmp_path / "save"
    shutil.copytree(fixture_dir(NAME), save)
    path = tag_dir(save) / "layer_05-model_01-model_states.pt"     # TP rank 1's output use of the tied embedding
    sd = torch.load(path, weights_only=False)
    sd["word_embeddings.weight"][2, 5] += 1.0
    torch.save(sd, path)
    words = "tied_modules.embed.word_embeddings.weight (module): replicated, but layer_05-model_01-model_states.pt"
    assert any(words in p for p in _open(save).problems)             # small: compared when read
    monkeypatch.setattr(parallel, "REPLICA_CHECK_BYTES", 0)           # as if it were big
    catalog = _open(save)
    assert not catalog.problems and reshard.validate(catalog).ok
    problems = reshard.validate(catalog, deep=True).problems
    # TP rank 1 holds rows 20..39: its shard element (2, 5) is full element 22 * 8 + 5
    assert len(problems) == 1 and words in problems[0] and "(tensor-parallel rank 1)" in problems[0] \
        and "first at element 181" in problems[0], problems


def test_refusals(tmp_path):
    source = _open(fixture_dir(NAME))
    for to, words in [("tp=3,pp=2", "does not divide into"), ("tp=2,pp=2,zero=2", "ZeRO stage 1 only"),
                      ("tp=2,pp=7", "pp=7 but the model has 6 layers")]:
        with pytest.raises(ReshardError, match=words) as e:
            make_plan(source, to)
        assert "\n" not in str(e.value)
    with pytest.raises(ReshardError, match="--layout-rules"):        # the reader needs the rules too
        reshard.open_checkpoint(fixture_dir(NAME))


# ----------------------------------------------------------------------------------------------- engine

ENGINE_TARGETS = ["tp=1,pp=2,dp=2", "tp=2,pp=1,dp=2", "tp=1,pp=1,dp=4", "tp=2,pp=2,dp=1"]


def _corrupt(save):
    """Negative control: one exp_avg element of one optimizer file changed, in a checkpoint that still loads
    (stage 0 at dp=2: 1008 elements, dp rank 1's partition from 504; its element 100 is layer 2's, not tied)."""
    path = next(tag_dir(save).glob("zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    sd = torch.load(path, weights_only=False)
    sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][100] += 1.0
    torch.save(sd, path)


@shares("engine_tp_pp_resume.py")
def tp_pp_resume_jobs(out):
    """Each conversion (with the fixture itself loaded directly) and the control: (world, None, job)."""
    jobs = []
    for to in ENGINE_TARGETS + ["control"]:
        spec = "tp=1,pp=2,dp=2" if to == "control" else to
        target = target_layout(_open(fixture_dir(NAME)).layout, spec, "deepspeed")
        dst = out / to.replace(",", "-")
        execute(make_plan(_open(fixture_dir(NAME)), target.topology()), str(dst), progress=False)
        if to == "control":
            _corrupt(dst)
        job = {"checkpoint": str(dst), "tp": target.tp, "pp": target.pp, "dp": target.dp, "to": to,
               "fixtures": str(FIXTURES), "fixture": NAME, "resave": str(dst) + "-resaved"}
        if to != "control":     # and the fixture itself, through reshard.deepspeed_engine.load_checkpoint (issue #15)
            job.update(source=str(fixture_dir(NAME)), rules=str(RULES))
        jobs.append((target.world_size, None, job))
    return jobs


@pytest.fixture(scope="module")
def resumed(engine_launches):
    return {result["to"]: result for result in engine_launches.results(tp_pp_resume_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("to", ENGINE_TARGETS)
def test_the_pipeline_engine_resumes_the_conversion_bit_exactly(resumed, to):
    result = resumed[to]
    assert result["checked"] == len(truth_tensors(NAME)), result
    assert result["problems"] == [], "\n".join(result["problems"])
    assert math.isfinite(result["loss_after"]) and result["steps_after"] == 4     # one more train_batch ran
    # the engine's own save of the state it resumed has our files' names (the model axis: -model_TT or none)
    ours, theirs = tag_dir(Path(result["checkpoint"])), tag_dir(Path(result["resave"]))
    assert sorted(os.listdir(theirs)) == sorted(os.listdir(ours))


@pytest.mark.engine
def test_the_resume_check_sees_a_changed_optimizer_element(resumed):
    problems = resumed["control"]["problems"]
    assert len(problems) == 1 and problems[0].startswith("exp_avg/") and "differs from the saved engine's value" \
        in problems[0], problems
