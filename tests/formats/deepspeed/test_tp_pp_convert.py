"""convert across tensor/pipeline-parallel degrees: AutoTP saves at tp=1, their own tp, or (re-cut with a rule
file and the key-value head count) a new tp > 1, from tp=1 too; PipelineModule saves at any pp the layers allow;
any dp.

Without the engine: complete outputs holding every tensor of the source, N -> M -> N identity of DeepSpeed's
own files at the source topology, `reshard diff` and exports finding nothing, DeepSpeed's stage partitions, the
refusals. With the engine
(tests/scripts/engine_tp_resume.py under torchrun): the unmodified engine resumes each output at its topology with
the fixture's truth bit for bit, runs one more step, and its own save of that state is our files again.
"""
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

import reshard
from reshard.commands.convert import make_plan
from reshard.errors import ReshardError
from reshard.execution.executor import execute
from reshard.formats import target_layout
from reshard.formats.deepspeed import pickles as deepspeed_pickles, topology as ds
from tests.helpers.cli import run_cli
from tests.helpers.deepspeed_files import assert_same_files, assert_same_tree, convert_and_open, covered_elements
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES, fixture_dir, tag_dir
from tests.helpers.repo import REPO
from tests.helpers.torchrun import run_torchrun

AUTOTP = ["autotp2_z1_fp32_dp2", "autotp2_z1_bf16_tied_dp2", "autotp2_z2_fp32_tied_dp2", "autotp2_z1_fp32_uneven_dp2"]
TARGETS = ["tp=1,dp=1", "tp=1,dp=2", "tp=1,dp=4", "tp=2,dp=1", "tp=2,dp=3", "tp=2,dp=2,zero=2", "tp=1,dp=2,zero=1",
           "tp=1,dp=3,zero=3"]
PIPE = "pipe2_z1_fp32_dp2"
TIED = "pipe2_tiedhead_z1_fp32_dp2"     # the embedding used again as the head, through a forward_fn (no layer file)
PIPE_TARGETS = ["pp=1,dp=4", "pp=1,dp=2", "pp=2,dp=1", "pp=2,dp=3", "pp=4,dp=1", "pp=5,dp=1"]


def _assert_same_tensors(a, b):
    if ds.of(b.layout).zero == 3 and ds.of(a.layout).zero != 3:     # ZeRO-3 keeps no 16-bit copy beside the fp32 master
        assert set(b.tensors) == {k for k in a.tensors if k[1] != "module" or a.params[k[0]].kind != "trainable"}
    else:
        assert set(a.tensors) == set(b.tensors)
    for name, state in b.tensors:
        assert torch.equal(reshard.full_tensor(a, name, state), reshard.full_tensor(b, name, state)), (name, state)


@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("name", AUTOTP)
def test_autotp_converts_to_a_complete_checkpoint(name, to, tmp_path):
    source = reshard.open_checkpoint(fixture_dir(name))
    out = convert_and_open(fixture_dir(name), tmp_path / "out", to)
    report = reshard.validate(out, deep=True)
    assert report.ok, report.problems
    target = target_layout(source.layout, to, "deepspeed")
    assert (out.layout.tp, out.layout.dp, ds.of(out.layout).zero) == (target.tp, target.dp, ds.of(target).zero)
    _assert_same_tensors(source, out)
    assert out.param_groups == source.param_groups and out.aliases == source.aliases
    assert out.training.global_steps == source.training.global_steps
    first = "zero_pp_rank_0_mp_rank_00_model_states.pt" if ds.of(target).zero == 3 else "mp_rank_00_model_states.pt"
    model0 = deepspeed_pickles.load(tag_dir(tmp_path / "out") / first)
    assert model0["mp_world_size"] == target.tp
    assert model0["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": target.tp}
    assert model0["ds_config"]["tensor_parallel"]["autotp_size"] == target.tp
    # without AutoTP the engine publishes no universal_checkpoint_info; at tp=2 each rank's own is carried
    assert ("universal_checkpoint_info" in model0) == (target.tp > 1)


@pytest.mark.parametrize("name", AUTOTP)
@pytest.mark.parametrize("dp", [1, 3])
def test_round_trip_through_another_dp_gives_back_deepspeeds_own_files(name, dp, tmp_path):
    convert_and_open(fixture_dir(name), tmp_path / "m", f"tp=2,dp={dp}")
    convert_and_open(tmp_path / "m", tmp_path / "n", "tp=2,dp=2")
    covered = covered_elements(reshard.open_checkpoint(fixture_dir(name)))
    assert_same_files(tag_dir(fixture_dir(name)), tag_dir(tmp_path / "n"), covered)


@pytest.mark.parametrize("name, to", [(AUTOTP[0], "tp=1,dp=4"), (AUTOTP[1], "tp=2,dp=1"), (PIPE, "pp=4,dp=1")])
def test_converted_checkpoint_exports_and_diffs_like_its_source(name, to, tmp_path):
    src = fixture_dir(name)
    run_cli("convert", src, tmp_path / "tp1", "--to", to)
    proc = run_cli("diff", src, tmp_path / "tp1", "--json", check=0)
    report = json.loads(proc.stdout)
    assert report["equal"] and not report["differences"], report
    run_cli("export", src, tmp_path / "a.safetensors")
    run_cli("export", tmp_path / "tp1", tmp_path / "b.safetensors")
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("via", ["tp=2,dp=1", "tp=2,dp=3,zero=2"])
def test_megatron_style_save_round_trips_through_its_rule_file(via, tmp_path):
    """A TP save without universal_checkpoint_info: the rule file gives the geometry both ways."""
    rules = str(REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json")
    name = "megatron_tp2_z1_fp32_dp2"
    source = reshard.open_checkpoint(fixture_dir(name), layout_rules=rules)
    execute(make_plan(source, via), str(tmp_path / "m"), progress=False)
    middle = reshard.open_checkpoint(tmp_path / "m", layout_rules=rules)
    assert reshard.validate(middle, deep=True).ok
    _assert_same_tensors(source, middle)
    execute(make_plan(middle, "tp=2,dp=2,zero=1"), str(tmp_path / "n"), progress=False)
    assert_same_files(tag_dir(fixture_dir(name)), tag_dir(tmp_path / "n"), covered_elements(source))
    whole = _convert_catalog(source, tmp_path / "tp1", "tp=1,dp=2")
    assert whole.layout.tp == 1 and reshard.validate(whole, deep=True).ok
    _assert_same_tensors(source, whole)


def _convert_catalog(catalog, dst, to):
    execute(make_plan(catalog, to), str(dst), progress=False)
    return reshard.open_checkpoint(dst)


@pytest.mark.parametrize("to", PIPE_TARGETS)
def test_pipeline_converts_to_a_complete_checkpoint(to, tmp_path):
    source = reshard.open_checkpoint(fixture_dir(PIPE))
    out = convert_and_open(fixture_dir(PIPE), tmp_path / "out", to)
    report = reshard.validate(out, deep=True)
    assert report.ok, report.problems
    target = target_layout(source.layout, to, "deepspeed")
    assert (out.layout.pp, out.layout.dp, ds.of(out.layout).zero) == (target.pp, target.dp, ds.of(target).zero)
    _assert_same_tensors(source, out)
    assert out.param_groups[0]["params"] == source.param_groups[0]["params"]
    # uniform partition of 5 layers (what the fixture's PipelineModule uses): [0, 3, 5] at pp=2 and so on;
    # the tied embedding (layers 0 and 4) is trained in the first and the last stage
    for layer in (1, 2, 3):
        expected = 0 if target.pp == 1 else \
            {2: [0, 0, 1], 4: [0, 1, 2], 5: [1, 2, 3]}[target.pp][layer - 1]
        assert out.notes.stages[f"{layer}.fc.weight" if layer != 2 else "2.weight"] == [expected]
    assert out.notes.stages["tied_modules.emb.weight"] == sorted({0, target.pp - 1})
    tag = tag_dir(tmp_path / "out")
    assert sorted(n for n in os.listdir(tag) if n.startswith("layer_")) == \
        [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    assert all(deepspeed_pickles.load(tag / f"mp_rank_{s:02d}_model_states.pt")["module"] is None
               for s in range(target.pp))


@pytest.mark.parametrize("name, via, back", [(PIPE, via, "pp=2,dp=2,partition=uniform")
                                            for via in ("pp=1,dp=4", "pp=4,dp=1", "pp=2,dp=3")] +
                         [(TIED, via, "pp=2,dp=2") for via in ("pp=4,dp=1", "pp=3,dp=3")])
def test_pipeline_round_trip_gives_back_deepspeeds_own_files(name, via, back, tmp_path):
    convert_and_open(fixture_dir(name), tmp_path / "m", via)
    convert_and_open(tmp_path / "m", tmp_path / "n", back)
    covered = covered_elements(reshard.open_checkpoint(fixture_dir(name)))
    assert_same_files(tag_dir(fixture_dir(name)), tag_dir(tmp_path / "n"), covered)


def test_pipeline_partition_by_parameters_when_named(tmp_path):
    """The fixture's 5 layers weigh [348, 262, 24, 162, 348] trainable elements: DeepSpeed's 'parameters'
    partition at pp=2 is [0, 2, 5] (uniform: [0, 3, 5]), so layer 2 moves to the second stage."""
    out = convert_and_open(fixture_dir(PIPE), tmp_path / "out", "pp=2,dp=1,partition=parameters")
    assert out.notes.stages["1.fc.weight"] == [0] and out.notes.stages["2.weight"] == [1]
    assert out.notes.stages["3.fc.weight"] == [1]
    assert out.notes.stages["tied_modules.emb.weight"] == [0, 1]
    back = convert_and_open(tmp_path / "out", tmp_path / "back", "pp=2,dp=2,partition=uniform")
    assert_same_files(tag_dir(fixture_dir(PIPE)), tag_dir(tmp_path / "back"),
                      covered_elements(reshard.open_checkpoint(fixture_dir(PIPE))))
    assert back.notes.stages == reshard.open_checkpoint(fixture_dir(PIPE)).notes.stages


def test_pipeline_stage_boundaries_follow_deepspeeds_partition():
    from deepspeed.runtime.utils import partition_balanced as ds_balanced, partition_uniform as ds_uniform

    from reshard.formats.deepspeed.pipe_writer import partition_balanced, partition_uniform
    for items in range(1, 12):
        for parts in range(1, 7):
            assert partition_uniform(items, parts) == list(ds_uniform(items, parts))
    for weights in ([348, 262, 24, 162, 348], [1, 1, 1, 1], [5, 0, 0, 7, 1, 9, 2], [3, 3, 3]):
        for parts in range(1, 6):
            assert partition_balanced(weights, parts) == [int(x) for x in ds_balanced(weights, parts)]


PIPE_TYPES = "Embed/Block/LayerNorm/Block/Embed"     # tools/fixture_parallel.py pipe_module's layer classes


def test_pipeline_partition_by_type_follows_deepspeeds():
    """'type:REGEX' weighs 1 the layers DeepSpeed's own PipelineModule._find_layer_type finds (run unbound on
    the layer specs: it needs no process group) and balances them with its partition_balanced."""
    from types import SimpleNamespace

    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.utils import partition_balanced as ds_balanced

    from reshard.formats.deepspeed.pipe_writer import partition_by_type

    class Embed(torch.nn.Module):
        pass

    class Block(torch.nn.Module):
        pass

    class FinalBlockNorm(torch.nn.Module):
        pass
    models = [[Embed, Block, torch.nn.LayerNorm, Block, Embed],
              [Embed] + [Block] * 7 + [FinalBlockNorm, torch.nn.Linear],
              [Block, Embed, Embed, Embed, Block, torch.nn.Dropout, Block]]
    for classes in models:
        specs = SimpleNamespace(_layer_specs=[LayerSpec(c) for c in classes])
        names = [c.__name__ for c in classes]
        for regex in ("Block", "embed", "^block$", "norm|embed", "Linear|Dropout", "e", "Conv"):
            try:
                found = PipelineModule._find_layer_type(specs, regex)
            except RuntimeError:          # DeepSpeed refuses a regex finding no layer; so do we
                with pytest.raises(ReshardError, match="finds no layer"):
                    partition_by_type(names, f"type:{regex}", 2)
                continue
            binary = [1 if i in found else 0 for i in range(len(classes))]
            for parts in range(1, len(classes) + 1):
                assert partition_by_type(names, f"type:{regex}", parts) == \
                    [int(x) for x in ds_balanced(binary, parts)], (names, regex, parts)


def test_pipeline_partition_by_type_when_named(tmp_path):
    """type:embed weighs the two tied Embed layers only: at pp=2 DeepSpeed cuts [0, 4, 5] (uniform [0, 3, 5],
    parameters [0, 2, 5]), so the last stage holds the output Embed alone."""
    out = convert_and_open(fixture_dir(PIPE), tmp_path / "out",
                           f"pp=2,dp=1,partition=type:embed,layer_types={PIPE_TYPES}")
    assert out.notes.stages["3.fc.weight"] == [0] and out.notes.stages["tied_modules.emb.weight"] == [0, 1]
    assert reshard.validate(out, deep=True).ok
    back = convert_and_open(tmp_path / "out", tmp_path / "back", "pp=2,dp=2,partition=uniform")
    assert_same_files(tag_dir(fixture_dir(PIPE)), tag_dir(tmp_path / "back"),
                      covered_elements(reshard.open_checkpoint(fixture_dir(PIPE))))
    assert back.notes.stages == reshard.open_checkpoint(fixture_dir(PIPE)).notes.stages
    # a layout descriptor names them too (options.partition_method, options.layer_types)
    descriptor = tmp_path / "layout.json"
    descriptor.write_text(json.dumps({"kind": "reshard.core.layout", "version": 1, "dp": 1, "pp": 2, "options": {
        "partition_method": "type:embed", "layer_types": PIPE_TYPES.split("/")}}))
    by_file = convert_and_open(fixture_dir(PIPE), tmp_path / "by_file", str(descriptor))
    assert by_file.notes.stages == out.notes.stages
    pipe = reshard.open_checkpoint(fixture_dir(PIPE))
    for to, words in [("pp=2,partition=type:Block", "add layer_types="),
                      ("pp=2,partition=type:Conv,layer_types=" + PIPE_TYPES, "finds no layer"),
                      ("pp=2,partition=type:(,layer_types=" + PIPE_TYPES, "bad regular expression"),
                      ("pp=2,partition=type:Block,layer_types=Embed/Block", "names 2 layers but the checkpoint has 5"),
                      ("pp=2,partition=type:Block,layer_types=Embed//Block", "separated by '/'")]:
        with pytest.raises(ReshardError, match=words) as e:
            make_plan(pipe, to)
        assert "\n" not in str(e.value)


def test_refusals_are_one_line(tmp_path):
    tp_source = reshard.open_checkpoint(fixture_dir("autotp2_z1_fp32_dp2"))
    for to, words in [("tp=4,dp=1", "give it with --layout-rules"),
                      ("tp=2,dp=2,zero=3", "ZeRO-1/2 only"), ("pp=2,tp=1", "not a PipelineModule save")]:
        with pytest.raises(ReshardError, match=words) as e:
            make_plan(tp_source, to)
        assert "\n" not in str(e.value)
    pipe = reshard.open_checkpoint(fixture_dir(PIPE))
    one_stage = convert_and_open(fixture_dir(PIPE), tmp_path / "pp1", "pp=1")     # any partition gives its one stage
    with pytest.raises(ReshardError, match="partition must be one of"):
        make_plan(one_stage, "pp=2,partition=block")
    for to, words in [("pp=6", "pp=6 but the model has 5 layers"), ("pp=2,zero=2", "ZeRO stage 1 only"),
                      ("pp=1,zero=3", "ZeRO stage 1 only"),
                      ("pp=2,tp=2", "give it with --layout-rules")]:
        with pytest.raises(ReshardError, match=words):
            make_plan(pipe, to)
    with pytest.raises(ReshardError, match="not a PipelineModule save"):
        make_plan(reshard.open_checkpoint(fixture_dir("z1_fp32_dp2")), "pp=2")
    with pytest.raises(ReshardError, match="not an AutoTP run"):     # a plain save: no AutoTP to cut by
        make_plan(reshard.open_checkpoint(fixture_dir("z1_fp32_dp2")), "tp=2")


# ------------------------------------------------------- a tied head on the last stage; the default partition

def _tied_head_counts():
    """DeepSpeed's own count of the tied-head model's trainable parameters per layer: PipelineModule's
    _count_layer_params, run unbound on tools/fixture_parallel.py's layer specs (it needs no process group)."""
    from types import SimpleNamespace

    from deepspeed.pipe import PipelineModule

    import fixture_parallel
    return PipelineModule._count_layer_params(SimpleNamespace(_layer_specs=fixture_parallel.tied_head_specs()))


def _deepspeed_parts(method, pp):
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    counts = _tied_head_counts()
    parts = partition_balanced(counts, pp) if method == "parameters" else partition_uniform(len(counts), pp)
    return [int(x) for x in parts]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_stage_using_the_tied_head_trains_the_tied_weight(pp, tmp_path):
    """The head (layer 6, the tied embedding through a forward_fn) has no layer file, yet the source's last
    stage trains the embedding: each target stage holds DeepSpeed's 'parameters' cut of all 7 layers, and
    the last one's optimizer partition the tied weight beside its own layers' params."""
    source = reshard.open_checkpoint(fixture_dir(TIED))
    plan = make_plan(source, f"pp={pp},dp=1")
    parts = _deepspeed_parts("parameters", pp)
    assert plan.stage_cut.method == "parameters" and list(plan.stage_cut.stages) == list(itertools.pairwise(parts))
    execute(plan, str(tmp_path / "out"), progress=False)
    out = reshard.open_checkpoint(tmp_path / "out")
    assert reshard.validate(out, deep=True).ok
    _assert_same_tensors(source, out)
    assert out.notes.stages["tied_modules.emb.weight"] == [0, pp - 1]
    for layer in range(1, 6):
        stage = next(s for s in range(pp) if parts[s] <= layer < parts[s + 1])
        assert out.notes.stages[f"{layer}.fc.weight" if layer < 5 else "5.weight"] == [stage]
    counts = _tied_head_counts()
    last = deepspeed_pickles.load(tag_dir(tmp_path / "out") / f"zero_pp_rank_0_mp_rank_{pp - 1:02d}_optim_states.pt")
    flat = last["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    assert tuple(flat.shape) == (sum(counts[parts[-2]:]),)      # its layers, the head's tied weight included


def _ranges(parts):
    return ", ".join(f"stage {s} " + (f"layers {a}-{b - 1}" if b - a > 1 else f"layer {a}")
                     for s, (a, b) in enumerate(itertools.pairwise(parts)))


def test_the_default_partition_is_deepspeeds_and_the_plan_says_when_the_source_cannot_tell(tmp_path):
    """The tied-head save's 2 stages are both DeepSpeed's 'uniform' and its 'parameters' partition, which cut
    pp=4 differently: the default is 'parameters' (PipelineModule's), plan and convert print the method and
    every stage's layers, and one line says the choice was the default's and that partition= decides it."""
    assert _deepspeed_parts("parameters", 2) == _deepspeed_parts("uniform", 2)
    parameters, uniform = _deepspeed_parts("parameters", 4), _deepspeed_parts("uniform", 4)
    assert parameters != uniform
    src = fixture_dir(TIED)
    summary = json.loads(run_cli("plan", src, "--to", "pp=4,dp=1", "--json").stdout)["partition"]
    assert summary["method"] == "parameters" and summary["stages"] == [list(r) for r in itertools.pairwise(parameters)]
    assert "partition=uniform" in summary["ambiguous"]
    text = run_cli("plan", src, "--to", "pp=4,dp=1").stdout.splitlines()
    assert f"stages   'parameters' partition: {_ranges(parameters)}" in text
    assert [line for line in text if line.startswith("note")] == [f"note     {summary['ambiguous']}"]
    proc = run_cli("convert", src, tmp_path / "out", "--to", "pp=4,dp=1")
    assert f"stages   'parameters' partition: {_ranges(parameters)}" in proc.stdout.splitlines()
    assert [line for line in proc.stderr.splitlines() if "note" in line] == [f"reshard: note: {summary['ambiguous']}"]
    out = reshard.open_checkpoint(tmp_path / "out")
    assert out.notes.stages["1.fc.weight"] == [1] and out.notes.stages["4.fc.weight"] == [2]
    assert out.notes.stages["5.weight"] == [3]
    # partition=uniform decides it: DeepSpeed's uniform cut, nothing ambiguous
    summary = json.loads(run_cli("plan", src, "--to", "pp=4,dp=1,partition=uniform", "--json").stdout)["partition"]
    assert summary == {"method": "uniform", "stages": [list(r) for r in itertools.pairwise(uniform)], "ambiguous": None}
    text = run_cli("plan", src, "--to", "pp=4,dp=1,partition=uniform").stdout
    assert f"stages   'uniform' partition: {_ranges(uniform)}\n" in text and "\nnote" not in text
    # where both methods cut the target alike (pp=2), or only one gives the source's stages, nothing to say
    for source, to in [(src, "pp=2,dp=1"), (fixture_dir(PIPE), "pp=4,dp=1")]:
        assert json.loads(run_cli("plan", source, "--to", to, "--json").stdout)["partition"]["ambiguous"] is None
    # a one-stage source fits any method: the default, said in the note
    one_stage = convert_and_open(fixture_dir(PIPE), tmp_path / "pp1", "pp=1")
    plan = make_plan(one_stage, "pp=2")
    assert plan.stage_cut.method == "parameters" and "cut pp=2 differently" in plan.stage_cut.ambiguous
    assert not json.loads(run_cli("plan", fixture_dir("z1_fp32_dp2"), "--to", "dp=4", "--json").stdout)["partition"]


# ----------------------------------------------------------------------------------------------- engine

ENGINE_JOBS = [(name, "tp=1,dp=2") for name in AUTOTP] + [(name, "tp=2,dp=1") for name in AUTOTP] + \
              [("autotp2_z1_fp32_dp2", "tp=1,dp=4"), ("autotp2_z2_fp32_tied_dp2", "tp=1,dp=4")] + \
              [("autotp2_z1_fp32_dp2", "tp=2,dp=1,zero=2"), ("autotp2_z2_fp32_tied_dp2", "tp=1,dp=2,zero=1")] + \
              [(PIPE, "pp=1,dp=2"), (PIPE, "pp=1,dp=4"), (PIPE, "pp=2,dp=1"), (PIPE, "pp=4,dp=1"),
               (PIPE, "pp=2,dp=1,partition=parameters"),
               (PIPE, f"pp=2,dp=1,partition=type:embed,layer_types={PIPE_TYPES}")] + \
              [(TIED, "pp=2,dp=1"), (TIED, "pp=4,dp=1"), (TIED, "pp=1,dp=4"), (TIED, "pp=4,dp=1,partition=uniform")]


# (issue #15) The fixtures themselves, loaded by live engines at another tp / pp / dp through
# reshard.deepspeed_engine.load_checkpoint (no conversion step), in the same launches.
DIRECT_JOBS = [("autotp2_z1_fp32_dp2", "tp=1,dp=2"), ("autotp2_z2_fp32_tied_dp2", "tp=2,dp=1"),
               (PIPE, "pp=1,dp=2"), (PIPE, "pp=2,dp=1"), (TIED, "pp=1,dp=2")]


def _run(world, jobs, out):
    stem = f"{jobs[0]['fixture']}-{jobs[0]['to']}".replace("/", "-").replace(":", "-")
    return run_torchrun("engine_tp_resume.py", world, jobs, out, stem)


@shares("engine_tp_resume.py")
def tp_resume_jobs(out):
    """Each conversion (its engine re-saves it), each direct load, the control: (world, tp or "pipe", job)."""
    jobs = []
    for name, to in ENGINE_JOBS + [(name, f"direct:{to}") for name, to in DIRECT_JOBS]:
        direct = to.startswith("direct:")
        source = reshard.open_checkpoint(fixture_dir(name)).layout
        target = target_layout(source, to.removeprefix("direct:"), "deepspeed")
        if direct:
            job = {"fixture": name, "checkpoint": str(fixture_dir(name)), "tp": target.tp, "zero": ds.of(target).zero,
                   "fixtures": str(FIXTURES), "to": to, "direct": True}
        else:
            dst = out / f"{name}-{to.replace(',', '-').replace('/', '-')}"
            execute(make_plan(reshard.open_checkpoint(fixture_dir(name)), to), str(dst), progress=False)
            job = {"fixture": name, "checkpoint": str(dst), "tp": target.tp, "zero": ds.of(target).zero,
                   "fixtures": str(FIXTURES), "resave": str(dst) + "-resaved", "to": to}
        pipe = name in (PIPE, TIED)
        if pipe:    # the engine script builds a PipelineModule per job: every pp x dp of a world size shares a launch
            job.update(pp=target.pp, partition=ds.of(target).partition_method)   # None: the model's own
        jobs.append((target.tp * target.pp * target.dp, "pipe" if pipe else target.tp, job))
    # negative control: a complete checkpoint that loads, compared with another run's truth (same model)
    jobs.append((2, 1, {"fixture": "autotp2_z2_fp32_tied_dp2", "truth": "autotp2_z1_bf16_tied_dp2",
                        "checkpoint": str(out / "autotp2_z2_fp32_tied_dp2-tp=1-dp=2"), "tp": 1,
                        "fixtures": str(FIXTURES), "to": "control"}))
    return jobs


@pytest.fixture(scope="module")
def resumed(engine_launches):
    return {(r["fixture"], r["to"]): r for r in engine_launches.results(tp_resume_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("name, to", ENGINE_JOBS, ids=[f"{n}-{t}" for n, t in ENGINE_JOBS])
def test_engine_resumes_at_the_new_topology_bit_exactly(resumed, name, to):
    result = resumed[(name, to)]
    assert result["problems"] == [], "\n".join(result["problems"])
    # the engine's own save of the state it resumed is our files again (tensor bytes but padding, trees equal)
    ours, theirs = tag_dir(Path(result["checkpoint"])), tag_dir(Path(result["resave"]))
    covered = covered_elements(reshard.open_checkpoint(result["checkpoint"]))
    assert sorted(os.listdir(theirs)) == sorted(os.listdir(ours))
    for n in sorted(os.listdir(ours)):
        assert_same_tree(deepspeed_pickles.load(ours / n), deepspeed_pickles.load(theirs / n), n, covered)


@pytest.mark.engine
@pytest.mark.parametrize("name, to", DIRECT_JOBS, ids=[f"{n}-{t}" for n, t in DIRECT_JOBS])
def test_engine_loads_the_source_directly_through_reshard(resumed, name, to):
    """The engine at `to` loads the fixture's own files with reshard.deepspeed_engine.load_checkpoint: the truth, bit
    for bit, and one more step."""
    result = resumed[(name, f"direct:{to}")]
    assert result["problems"] == [], "\n".join(result["problems"])


@pytest.mark.engine
def test_the_resume_check_sees_another_runs_state(resumed):
    problems = resumed[("autotp2_z2_fp32_tied_dp2", "control")]["problems"]
    assert any("differs from the saved engine's value" in p for p in problems), problems


@pytest.mark.engine
def test_engine_refuses_the_tied_head_model_cut_by_another_partition(resumed, tmp_path):
    """Negative control of the tied-head resumes: the stages DeepSpeed's 'uniform' partition gives at pp=4
    (which the engine built with partition_method='uniform' resumed above) are not the ones the model's own
    'parameters' builds, and the unmodified engine refuses their optimizer partitions at load."""
    result = resumed[(TIED, "pp=4,dp=1,partition=uniform")]
    assert result["problems"] == [] and result["partition"] == "uniform"
    job = {**{k: result[k] for k in ("fixture", "checkpoint", "tp", "zero", "fixtures", "pp")},
           "partition": None, "to": "control-other-partition"}
    with pytest.raises(AssertionError, match="parameter-alignment layout does not match"):
        _run(4, [job], tmp_path)


# ------------------------------------------------------------------------------ re-cut to a new tp degree

RULES = str(REPO / "reshard" / "layouts" / "tp-rules" / "llama-autotp.json")
KV_HEADS = {name: json.loads((FIXTURES / name / "hf_config" / "config.json").read_text())["num_key_value_heads"]
            for name in ("autotp2_z1_fp32_dp2", "autotp2_z1_fp32_uneven_dp2")}     # 2 and 3


def test_shard_sizes_follow_deepspeeds_autotp():
    """tp_recut.shard_sizes is tp_shard.get_shard_size_list: attention by key-value heads, MLP and lm_head even."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    from reshard.formats.deepspeed.tp_recut import shard_sizes
    layers = {"heads": "model.layers.0.self_attn.q_proj", "even": "model.layers.0.mlp.gate_proj"}
    for kv in (None, 1, 2, 3, 4, 8):
        for grain in (1, 2, 8):
            meta = AutoTPMeta(num_kv_heads=kv, tp_grain_size=grain)
            for total in (3, 12, 24, 48, 50, 64, 96):
                for tp in range(1, 6):
                    for cut, layer in list(layers.items()) + [("even", "lm_head")]:
                        expected = get_shard_size_list(total, tp, meta, layer)     # 1890 cases
                        assert shard_sizes(total, tp, cut, kv, grain) == expected, (kv, grain, total, tp, layer)
    assert shard_sizes(24, 2, "heads", 3, 1) == [16, 8] and shard_sizes(24, 3, "heads", 3, 1) == [8, 8, 8]


def _recut(name, tmp_path, to, via_tp1=True):
    """fixture -> (tp=1,dp=2 ->) `to`, the rules read with the source of the re-cut."""
    src = fixture_dir(name)
    if via_tp1:
        convert_and_open(src, tmp_path / "tp1", "tp=1,dp=2")
        src = tmp_path / "tp1"
    out = tmp_path / to.replace(",", "-")
    execute(make_plan(reshard.open_checkpoint(src, layout_rules=RULES), to), str(out), progress=False)
    return out


@pytest.mark.parametrize("name", list(KV_HEADS))
def test_tp1_recut_to_tp2_gives_back_deepspeeds_own_files(name, tmp_path):
    """AutoTP tp2-dp2 -> tp1-dp2 -> tp2-dp2: every file as the engine wrote it, universal_checkpoint_info
    (pattern lists, affine map) rebuilt from the rule file and the head count alone."""
    convert_and_open(fixture_dir(name), tmp_path / "tp1", "tp=1,dp=2")
    back = tmp_path / "back"
    run_cli("convert", tmp_path / "tp1", back, "--to", f"tp=2,dp=2,kv_heads={KV_HEADS[name]}", "--layout-rules", RULES)
    source = reshard.open_checkpoint(fixture_dir(name))
    assert_same_files(tag_dir(fixture_dir(name)), tag_dir(back), covered_elements(source))
    assert reshard.validate(reshard.open_checkpoint(back), deep=True).ok


def test_uneven_tp2_recut_to_tp3_cuts_one_kv_head_per_rank(tmp_path):
    dst = _recut("autotp2_z1_fp32_uneven_dp2", tmp_path, "tp=3,dp=1,kv_heads=3", False)
    out = reshard.open_checkpoint(dst)
    assert reshard.validate(out, deep=True).ok and out.layout.tp == 3
    source = reshard.open_checkpoint(fixture_dir("autotp2_z1_fp32_uneven_dp2"))
    _assert_same_tensors(source, out)
    for rank in range(3):
        model = deepspeed_pickles.load(tag_dir(dst) / f"mp_rank_{rank:02d}_model_states.pt")
        assert model["module"]["model.layers.0.self_attn.k_proj.weight"].shape == (4, 24)    # 1 head of 4
        assert model["module"]["model.layers.0.self_attn.o_proj.weight"].shape == (24, 8)
        assert model["module"]["lm_head.weight"].shape == (16, 24)
        affine = model["universal_checkpoint_info"]["affine_map"]["params"]
        assert sorted(affine[r"^model\.layers\.0\.mlp\.down_proj\.weight$"]["ranks"]) == [0, 1, 2]


def test_recut_refusals_are_one_line(tmp_path):
    uneven = reshard.open_checkpoint(fixture_dir("autotp2_z1_fp32_uneven_dp2"), layout_rules=RULES)
    for catalog, to, words in [
            (reshard.open_checkpoint(fixture_dir("autotp2_z1_fp32_dp2")), "tp=4", "--layout-rules"),
            (uneven, "tp=3", "kv_heads=K"),
            (uneven, "tp=3,kv_heads=6", "do not give the cut the source was saved with"),   # 6 heads: 12+12
            (uneven, "tp=4,kv_heads=3", "gives tensor-parallel rank 3 nothing"),
            (reshard.open_checkpoint(fixture_dir("autotp2_z1_bf16_tied_dp2"),
                                     layout_rules=str(REPO / "reshard" / "layouts" / "tp-rules"
                                                      / "llama-autotp-tied.json")),
             "tp=4,kv_heads=2", "at another degree")]:
        with pytest.raises(ReshardError, match=words) as e:
            make_plan(catalog, to)
        assert "\n" not in str(e.value)
    proc = run_cli("convert", fixture_dir("autotp2_z1_fp32_dp2"), tmp_path / "x", "--to", "tp=4", check=1)
    assert "--layout-rules" in proc.stderr and not (tmp_path / "x").exists()


RECUT_JOBS = [("autotp2_z1_fp32_dp2", "tp=2,dp=1,kv_heads=2", True),
              ("autotp2_z1_fp32_uneven_dp2", "tp=2,dp=1,kv_heads=3", True),
              ("autotp2_z1_fp32_uneven_dp2", "tp=3,dp=1,kv_heads=3", False)]


@shares("engine_tp_resume.py")
def recut_jobs(out):
    """Each recut, resumed (and saved again) at its new degree: (world, tp, job), beside the conversions' jobs."""
    jobs = []
    for index, (name, to, via_tp1) in enumerate(RECUT_JOBS):
        (out / str(index)).mkdir()
        dst = _recut(name, out / str(index), to, via_tp1)
        target = reshard.open_checkpoint(dst).layout
        jobs.append((target.tp * target.dp, target.tp, {"fixture": name, "checkpoint": str(dst), "tp": target.tp,
                     "zero": ds.of(target).zero, "fixtures": str(FIXTURES), "resave": str(dst) + "-resaved", "to": to}))
    return jobs


@pytest.mark.engine
@pytest.mark.parametrize("name, to, via_tp1", RECUT_JOBS, ids=[f"{n}-{t}" for n, t, _ in RECUT_JOBS])
def test_engine_resumes_a_recut_checkpoint_bit_exactly(name, to, via_tp1, engine_launches):
    """tp1 -> tp2 (and tp2 -> tp3 on 3 kv heads): the unmodified engine at the new degree loads it, holds the
    fixture's truth bit for bit, steps, and its own save is our files (universal_checkpoint_info included)."""
    result = engine_launches.results(recut_jobs)[RECUT_JOBS.index((name, to, via_tp1))]
    assert (result["fixture"], result["to"]) == (name, to)
    dst = Path(result["checkpoint"])
    assert result["problems"] == [], "\n".join(result["problems"])
    ours, theirs = tag_dir(dst), tag_dir(Path(result["resave"]))
    covered = covered_elements(reshard.open_checkpoint(dst))
    assert sorted(os.listdir(theirs)) == sorted(os.listdir(ours))
    for n in sorted(os.listdir(ours)):
        assert_same_tree(deepspeed_pickles.load(ours / n), deepspeed_pickles.load(theirs / n), n, covered)


@pytest.mark.engine
def test_engine_rejects_a_recut_made_with_the_wrong_head_count(tmp_path):
    """Negative control: a tp=1 source cannot confirm kv_heads (it holds no cut); 6 instead of the model's 3
    cuts attention 12+12 instead of 16+8, and the engine at tp=2 refuses the shapes at load."""
    dst = _recut("autotp2_z1_fp32_uneven_dp2", tmp_path, "tp=2,dp=1,kv_heads=6")
    job = {"fixture": "autotp2_z1_fp32_uneven_dp2", "checkpoint": str(dst), "tp": 2, "zero": 1,
           "fixtures": str(FIXTURES), "to": "wrong-heads"}
    with pytest.raises(AssertionError, match=r"size mismatch for model\.layers\.0\.self_attn\.q_proj\.weight"):
        _run(2, [job], tmp_path)
