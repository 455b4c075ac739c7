"""convert of AutoEP mixture-of-experts saves across ep and dp, without the engine (issue #16): every conversion
read back is the fixture's truth bit for bit, in the placement and partition DeepSpeed's process groups give; at
the fixture's own topology (and there and back) the files are DeepSpeed's own; `reshard diff` finds nothing; a
changed expert element shows; what cannot be written is refused in one line. tests/formats/deepspeed/test_moe_engine.py
has the
engine load them."""
import shutil
from dataclasses import replace

import pytest
import torch

import reshard
from reshard.core.catalog import MASTER
from reshard.formats.deepspeed import pickles as deepspeed_pickles, topology as ds
from reshard.formats.deepspeed.experts import expert_ranks
from tests.helpers.cli import run_cli
from tests.helpers.damage import set_element
from tests.helpers.deepspeed_files import assert_deepspeeds_own_files, convert_and_open
from tests.helpers.fixtures import MOE_FIXTURES, fixture_dir, tag_dir, truth_json, truth_tensors
from tests.helpers.moe import PACKED, experts_held, truth_differences

# (fixture, --to): ep 2 -> 1, 2 -> 4, ep 2 x expert-dp 2 -> ep 2 x expert-dp 1, the dense dp alone, a stage change.
# dp is the data-parallel degree of the dense params (DeepSpeed's dp_world_size, the world here); the experts'
# data-parallel degree is dp / ep.
CONVERSIONS = [
    ("autoep2_z1_fp32", "ep=1"), ("autoep2_z1_fp32", "ep=1,dp=1"), ("autoep2_z1_fp32", "ep=4,dp=4"),
    ("autoep2_z1_fp32", "dp=4"), ("autoep2_z1_fp32", "ep=2,dp=6,zero=2"),
    ("autoep2_z2_bf16", "ep=1"), ("autoep2_z2_bf16", "ep=4,dp=4"), ("autoep2_z2_bf16", "zero=1"),
    ("autoep2_z2_fp32_dp2", "dp=2"), ("autoep2_z2_fp32_dp2", "ep=4"), ("autoep2_z2_fp32_dp2", "ep=1,dp=3"),
    ("autoep2_z2_fp32_dp2", "zero=1"),
    ("autoep2_z2_fp32_dp2_datafirst", "ep=1,dp=2"), ("autoep2_z2_fp32_dp2_datafirst", "dp=8"),
]


def _spec(catalog, to):
    """The (ep, dp, zero) `to` asks for, the source's where it names none."""
    given = dict(item.split("=") for item in to.split(","))
    return (int(given.get("ep", catalog.experts.ep)), int(given.get("dp", catalog.layout.dp)),
            int(given.get("zero", ds.of(catalog.layout).zero)))


@pytest.mark.parametrize("name,to", CONVERSIONS)
def test_a_conversion_read_back_is_the_truth(name, to, tmp_path):
    source = reshard.open_checkpoint(fixture_dir(name))
    ep, dp, zero = _spec(source, to)
    out = convert_and_open(fixture_dir(name), tmp_path / "out", to)
    assert truth_differences(out, truth_tensors(name)) == []
    report = reshard.validate(out, deep=True)
    assert report.ok, report.problems
    assert (out.experts.ep, out.experts.expert_dp, out.layout.dp, ds.of(out.layout).zero) == (ep, dp // ep, dp, zero)
    assert out.param_groups[1]["name"] == f"ep_size_{ep}" and out.param_groups[1]["moe"]
    # every rank's file holds the experts DeepSpeed's process groups give its expert-parallel rank
    data_first = name.endswith("datafirst")
    local = 4 // ep
    assert experts_held(out) == {
        d: tuple(range(expert_ranks(d, ep, dp // ep, data_first)[0] * local,
                       (expert_ranks(d, ep, dp // ep, data_first)[0] + 1) * local)) for d in range(dp)}
    model = deepspeed_pickles.load(tag_dir(tmp_path / "out") / "mp_rank_00_model_states.pt")
    assert model["dp_world_size"] == dp and model["ds_config"]["expert_parallel"]["autoep_size"] == ep
    for entry in model["ds_autoep_layers"]:
        assert (entry["ep_size"], entry["num_local_experts"], entry["expert_data_parallel_world_size"]) == \
            (ep, local, dp // ep)
        assert [r["experts"] for r in entry["expert_placement"]["ranks"]] == \
            [list(range(r * local, (r + 1) * local)) for r in range(ep)]
    assert model["universal_checkpoint_info"]["ds_autoep_layers"] == model["ds_autoep_layers"]
    assert all(tuple(shape)[0] == local for shape in model["param_shapes"][1].values())
    for f in out.files:
        if f.role == "optim_states":
            optim = deepspeed_pickles.load(tag_dir(tmp_path / "out") / f.path)["optimizer_state_dict"]
            assert optim["partition_count"] == [dp, dp // ep], f.path


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_its_own_topology_gives_deepspeeds_own_files(name, tmp_path):
    convert_and_open(fixture_dir(name), tmp_path / "out", "")
    assert_deepspeeds_own_files(name, tmp_path / "out")


@pytest.mark.parametrize("name,there", [("autoep2_z1_fp32", "ep=1,dp=2"), ("autoep2_z1_fp32", "ep=4,dp=4"),
                                        ("autoep2_z2_bf16", "ep=1,dp=4"), ("autoep2_z2_fp32_dp2", "ep=2,dp=2"),
                                        ("autoep2_z2_fp32_dp2", "ep=4"),
                                        ("autoep2_z2_fp32_dp2_datafirst", "ep=1,dp=2"),
                                        ("dsmoe_ep2_z2_fp32", "ep=1,dp=2"), ("dsmoe_ep2_z2_fp32", "ep=4,dp=4")])
def test_there_and_back_gives_deepspeeds_own_files(name, there, tmp_path):
    """ep 1 -> 2 and 4 -> 2 included: the way back starts from our own output at another ep."""
    meta = truth_json(name)
    convert_and_open(fixture_dir(name), tmp_path / "there", there)
    back = convert_and_open(tmp_path / "there", tmp_path / "back", f"ep={meta['ep']},dp={meta['world_size']}")
    assert back.experts.ep == meta["ep"]
    assert_deepspeeds_own_files(name, tmp_path / "back")


# (source, --to, the fixture DeepSpeed saved at the target's stage and topology): the same model config trained at
# another world size, so its values and global_samples are another run's; no fp32 ZeRO-2 ep 2 x dp 2 or bf16 ZeRO-1
# fixture exists to compare those other stage changes with
STAGE_CHANGES = [("autoep2_z1_fp32", "ep=2,dp=4,zero=2", "autoep2_z2_fp32_dp2"),
                 ("autoep2_z2_fp32_dp2", "ep=2,dp=2,zero=1", "autoep2_z1_fp32")]


def _assert_same_objects(a, b, where):
    """The same keys in the same order, the same types, the same values (tensors bit for bit)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if torch.is_tensor(a):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _assert_same_objects(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_objects(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name,to,engines", STAGE_CHANGES)
def test_a_stage_change_gives_the_model_states_the_engine_saves_at_that_stage(name, to, engines, tmp_path):
    """ZeRO-1 -> 2 and 2 -> 1: the model states equal those the engine saved at the target stage and topology, key
    for key and value for value (torch.load), but for what another run has: the module's values (ours are the
    source's) and global_samples. So the router alias (AutoEP's router under the model's name, a second name of
    one parameter) is in no frozen_param_shapes at ZeRO-2, and those keys are None at ZeRO-1."""
    convert_and_open(fixture_dir(name), tmp_path / "out", to)
    file = "mp_rank_00_model_states.pt"
    ours, theirs, source = (torch.load(tag_dir(d) / file, weights_only=False)
                            for d in (tmp_path / "out", fixture_dir(engines), fixture_dir(name)))
    assert ours.pop("global_samples") == source["global_samples"]
    theirs.pop("global_samples")
    module, their_module = ours.pop("module"), theirs.pop("module")
    assert list(module) == list(their_module)
    for key, tensor in module.items():
        assert (tensor.dtype, tensor.shape) == (their_module[key].dtype, their_module[key].shape), key
        _assert_same_objects(tensor, source["module"][key], key)
    _assert_same_objects(ours, theirs, file)


def test_the_router_alias_is_a_child_holding_exactly_the_routers_tensors():
    """What tells a ZeRO-1 save's router alias from a frozen param: the AutoEP layer's child with the router's very
    tensor names, dtypes and shapes. Negative control: a child differing in one shape is no alias (it would be a
    frozen param, which a ZeRO-2 output must list)."""
    from reshard.formats.deepspeed.experts import router_aliases
    model0 = deepspeed_pickles.load(tag_dir(fixture_dir("autoep2_z1_fp32")) / "mp_rank_00_model_states.pt")
    assert router_aliases(model0) == ("model.layers.0.mlp.gate.gate.weight", "model.layers.1.mlp.gate.gate.weight")
    alias = model0["module"]["model.layers.1.mlp.gate.gate.weight"]
    model0["module"]["model.layers.1.mlp.gate.gate.weight"] = replace(alias, shape=(alias.shape[1], alias.shape[0]))
    assert router_aliases(model0) == ("model.layers.0.mlp.gate.gate.weight",)


DS_MOE = "dsmoe_ep2_z2_fp32"
DS_MOE_EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.0.weight"


@pytest.mark.parametrize("to", ["ep=1", "ep=1,dp=1", "ep=4,dp=4", "ep=2,dp=4", "ep=2,dp=6,zero=1"])
def test_a_deepspeed_moe_conversion_read_back_is_the_truth(to, tmp_path):
    """deepspeed.moe: each expert param is a logical tensor of its own; rank d's file holds those of the experts of
    its expert-parallel rank, named by their local number in param_shapes."""
    source = reshard.open_checkpoint(fixture_dir(DS_MOE))
    ep, dp, _ = _spec(source, to)
    out = convert_and_open(fixture_dir(DS_MOE), tmp_path / "out", to)
    assert truth_differences(out, truth_tensors(DS_MOE)) == []
    assert reshard.validate(out, deep=True).ok
    assert (out.experts.ep, out.experts.expert_dp, out.layout.dp) == (ep, dp // ep, dp)
    local = 4 // ep
    for e in range(4):     # (each file holds its part of its expert-parallel rank's flat vector)
        ranks = {f.rank for f in out.tensors[(DS_MOE_EXPERT.format(e), MASTER)].fragments}
        assert ranks and {expert_ranks(d, ep, dp // ep, False)[0] for d in ranks} == {e // local}, e
    model = deepspeed_pickles.load(tag_dir(tmp_path / "out") / "mp_rank_00_model_states.pt")
    assert list(model["param_shapes"][1]) == [DS_MOE_EXPERT.format(i).replace(".0.weight", rest)
                                              for i in range(local) for rest in (".0.weight", ".0.bias", ".2.weight",
                                                                                 ".2.bias")]
    assert model["ds_autoep_layers"] is None and model["num_experts"] == [4]


def test_ep_1_to_2_and_4(tmp_path):
    """An ep-1 save (our conversion of a fixture) converts up to ep 2 and ep 4 with every tensor the truth."""
    name = "autoep2_z2_fp32_dp2"
    convert_and_open(fixture_dir(name), tmp_path / "ep1", "ep=1,dp=4")
    for ep in (2, 4):
        out = convert_and_open(tmp_path / "ep1", tmp_path / f"ep{ep}", f"ep={ep}")
        assert out.experts.ep == ep and truth_differences(out, truth_tensors(name)) == []


def test_diff_finds_no_difference_and_a_changed_expert_element_shows(tmp_path):
    name = "autoep2_z2_fp32_dp2"
    run_cli("convert", fixture_dir(name), tmp_path / "out", "--to", "ep=1,dp=2", check=0)
    proc = run_cli("diff", fixture_dir(name), tmp_path / "out", check=0)
    assert proc.stdout.startswith("no difference")
    # negative control: one element of expert 3 changed in a copy of the source is in the converted output
    save = tmp_path / "save"
    shutil.copytree(fixture_dir(name), save)
    element = 3 * 16 * 32 + 100
    set_element(reshard.open_checkpoint(save), PACKED, MASTER, element, lambda x: x + 0.5)
    changed = convert_and_open(save, tmp_path / "changed", "ep=1,dp=2")
    assert truth_differences(changed, truth_tensors(name)) == [f"fp32/{PACKED}"]
    proc = run_cli("diff", fixture_dir(name), tmp_path / "changed", check=1)
    assert "DIFFERENT" in proc.stdout and PACKED in proc.stdout


@pytest.mark.parametrize("name,args,needle", [
    ("autoep2_z1_fp32", ("--to", "ep=3,dp=3"), "ep=3 does not divide the 4 experts of MoE layer 0"),
    ("autoep2_z1_fp32", ("--to", "ep=8,dp=8"), "ep=8 does not divide the 4 experts of MoE layer 0"),
    ("autoep2_z1_fp32", ("--to", "dp=3"), "ep=2 does not divide dp=3"),
    ("dsmoe_ep2_z2_fp32", ("--to", "zero=3"), "only AutoEP experts are written under ZeRO-3"),
    ("dsmoe_ep2_z2_fp32", ("--to", "ep=3,dp=3"), "ep=3 does not divide the 4 experts of MoE layer 0"),
    ("autoep2_z1_fp32", ("--to", "dp=2", "--format", "dcp"),
     "converting mixture-of-experts checkpoints to dcp needs --names RULES"),
    ("z1_fp32_dp2", ("--to", "ep=2"), "ep=2: the source has no experts"),
])
def test_what_cannot_be_written_is_refused_in_one_line(name, args, needle, tmp_path):
    proc = run_cli("convert", fixture_dir(name), tmp_path / "out", *args, check=1)
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("reshard: ") and needle in line, line
    assert not (tmp_path / "out").exists()


def test_ep_is_a_usage_error_for_a_format_without_experts(tmp_path):
    proc = run_cli("convert", fixture_dir("autoep2_z1_fp32"), tmp_path / "out", "--to", "ep=1", "--format",
                   "dcp", check=2)
    assert "dcp output has no ep" in proc.stderr and not (tmp_path / "out").exists()


def test_plan_shows_the_expert_parallel_degrees():
    import json
    data = json.loads(run_cli("plan", fixture_dir("autoep2_z2_fp32_dp2"), "--to", "ep=1,dp=2", "--json",
                              check=0).stdout)
    assert (data["source_topology"], data["target_topology"]) == ("dp=4,tp=1,pp=1,zero=2,ep=2",
                                                                  "dp=2,tp=1,pp=1,zero=2,ep=1")
    kept = json.loads(run_cli("plan", fixture_dir("autoep2_z2_fp32_dp2"), "--to", "dp=2", "--json", check=0).stdout)
    assert kept["target_topology"] == "dp=2,tp=1,pp=1,zero=2,ep=2"        # the source's ep unless named
