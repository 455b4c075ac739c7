"""AutoEP under ZeRO-3 (issue #29): DeepSpeed 0.19.8 saves the experts partition-native, inside the ZeRO-3 files
(docs/deepspeed-moe.md §2). Read, inspected, validated, exported and compared against the live engine's truth
(tools/fixture_moe.py, fixtures/autoep2_z3_*); converted across ep, dp and ZeRO stages, read back as the truth, and
there and back the very files DeepSpeed wrote (at its own topology: tests/formats/deepspeed/test_moe_convert.py).
Negative controls: a missing rank file is named with the experts it held, a changed expert element is found.
tests/formats/deepspeed/test_moe_engine.py
has the engine load them."""
import json
import os
import shutil

import pytest

import reshard
from reshard.core.catalog import MASTER
from reshard.formats.deepspeed import pickles as deepspeed_pickles, topology as ds
from reshard.formats.deepspeed.experts import expert_ranks
from tests.helpers.cli import lines_naming, run_cli
from tests.helpers.damage import set_element
from tests.helpers.deepspeed_files import assert_deepspeeds_own_files, convert_and_open
from tests.helpers.fixtures import fixture_dir, tag_dir, truth_json, truth_tensors
from tests.helpers.moe import PACKED, experts_held, truth_differences

Z3 = ["autoep2_z3_fp32", "autoep2_z3_fp32_dp2"]
ELEMENT = 3 * 16 * 32 + 100          # expert 3 of the packed (4, 16, 32) weight


@pytest.mark.parametrize("name", Z3)
def test_a_zero3_save_has_no_expert_layer_files_and_every_rank_its_model_states(name):
    """The facts the reader relies on, on the engine's own files (docs/deepspeed-moe.md §2)."""
    world = truth_json(name)["world_size"]
    files = sorted(os.listdir(tag_dir(fixture_dir(name))))
    assert not [f for f in files if f.startswith("layer_")]
    assert files == sorted([f"zero_pp_rank_{d}_mp_rank_00_{kind}_states.pt" for d in range(world)
                            for kind in ("model", "optim")])
    for d in range(world):
        model = deepspeed_pickles.load(tag_dir(fixture_dir(name)) / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt")
        ep_rank, edp_rank = expert_ranks(d, 2, world // 2, False)
        for entry in model["ds_autoep_layers"]:
            assert (entry["checkpoint_format"], entry["checkpoint_format_version"]) == ("zero3_partitioned", 1)
            assert (entry["ep_rank"], entry["expert_data_parallel_rank"]) == (ep_rank, edp_rank)
            assert (entry["global_expert_start"], entry["global_expert_end"]) == (2 * ep_rank, 2 * ep_rank + 2)
        assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in model["module"])
        optim = deepspeed_pickles.load(tag_dir(fixture_dir(name)) / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")
        groups = optim["optimizer_state_dict"]["ds_zero_partition_groups"]
        assert [(g["partition_count"], g["partition_rank"], g["families"]) for g in groups] == \
            [(world, d, ["replicated"]), (world // 2, edp_rank, ["autoep_expert"])]


@pytest.mark.parametrize("name,experts_of_rank", [
    ("autoep2_z3_fp32", {0: (0, 1), 1: (2, 3)}),
    ("autoep2_z3_fp32_dp2", {0: (0, 1), 1: (2, 3), 2: (0, 1), 3: (2, 3)})])
def test_which_rank_file_holds_which_experts(name, experts_of_rank):
    assert experts_held(reshard.open_checkpoint(fixture_dir(name))) == experts_of_rank


@pytest.mark.parametrize("name", Z3)
def test_inspect_names_zero3_and_the_expert_parallel_degrees(name):
    meta = truth_json(name)
    info = json.loads(run_cli("inspect", fixture_dir(name), "--json", check=0).stdout)
    assert info["experts"]["ep"] == 2 and info["experts"]["expert_dp"] == meta["world_size"] // 2
    catalog = reshard.open_checkpoint(fixture_dir(name))
    assert ds.of(catalog.layout).zero == 3 and catalog.layout.dp == meta["world_size"]
    assert catalog.param_groups[1]["name"] == "ep_size_2" and catalog.param_groups[1]["moe"]


def test_validate_names_a_missing_optimizer_file_and_the_experts_it_held(tmp_path):
    """ep 2 x expert-dp 2: rank 3's optimizer file holds the second expert-data-parallel half of each of ep rank 1's
    local experts (2-3), param by param: validate names the file, and the gap is in experts 2-3 only."""
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z3_fp32_dp2"), save)
    missing = tag_dir(save) / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    os.remove(missing)
    proc = run_cli("validate", save, check=1)
    [line] = lines_naming(proc, missing.name)
    assert line == f"{missing}: missing (expected for data-parallel rank 3)"
    [gap] = [line for line in proc.stdout.splitlines() if f"{PACKED} (fp32, " in line]
    # PACKED (4, 16, 32): ep rank 1's local (2, 16, 32) = 1024 elements, cut in two parts of 512 over expert-dp 2
    assert gap.endswith("512 elements missing, at [1536, 2048)")
    assert proc.stdout.splitlines()[-1].startswith("NOT complete")


def test_validate_names_a_missing_model_states_file(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z3_fp32"), save)
    missing = tag_dir(save) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    os.remove(missing)
    proc = run_cli("validate", save, check=1)
    [line] = lines_naming(proc, missing.name)
    assert line == f"{missing}: missing (expected for data-parallel rank 1)"


def test_one_changed_expert_element_is_caught(tmp_path):
    name = "autoep2_z3_fp32_dp2"
    save = tmp_path / "save"
    shutil.copytree(fixture_dir(name), save)
    set_element(reshard.open_checkpoint(save), PACKED, MASTER, ELEMENT, lambda x: x + 0.5)
    # (ZeRO-3's module weight is its master: the engine restores it from it)
    assert truth_differences(reshard.open_checkpoint(save), truth_tensors(name)) == \
        [f"fp32/{PACKED}", f"module/{PACKED}"]
    proc = run_cli("diff", fixture_dir(name), save, check=1)
    assert "DIFFERENT" in proc.stdout and lines_naming(proc, PACKED)


# (fixture, --to): across ep and dp under ZeRO-3, and across ZeRO stages both ways
CONVERSIONS = [("autoep2_z3_fp32", "ep=1"), ("autoep2_z3_fp32", "ep=4,dp=4"), ("autoep2_z3_fp32", "dp=4"),
               ("autoep2_z3_fp32_dp2", "ep=1,dp=2"), ("autoep2_z3_fp32_dp2", "dp=2"),
               ("autoep2_z3_fp32_dp2", "ep=4,dp=8"), ("autoep2_z3_fp32", "zero=1"),
               ("autoep2_z3_fp32_dp2", "ep=1,dp=2,zero=2"), ("autoep2_z1_fp32", "zero=3"),
               ("autoep2_z2_fp32_dp2", "ep=1,dp=2,zero=3"), ("autoep2_z2_fp32_dp2_datafirst", "zero=3"),
               ("autoep2_z2_bf16", "ep=4,dp=4,zero=3")]


@pytest.mark.parametrize("name,to", CONVERSIONS)
def test_a_conversion_read_back_is_the_truth(name, to, tmp_path):
    source = reshard.open_checkpoint(fixture_dir(name))
    given = dict(item.split("=") for item in to.split(","))
    ep, dp = int(given.get("ep", source.experts.ep)), int(given.get("dp", source.layout.dp))
    zero = int(given.get("zero", ds.of(source.layout).zero))
    out = convert_and_open(fixture_dir(name), tmp_path / "out", to)
    assert truth_differences(out, truth_tensors(name)) == []
    report = reshard.validate(out, deep=True)
    assert report.ok, report.problems
    assert (out.experts.ep, out.experts.expert_dp, out.layout.dp, ds.of(out.layout).zero) == (ep, dp // ep, dp, zero)
    local = 4 // ep
    data_first = name.endswith("datafirst")
    assert experts_held(out) == {
        d: tuple(range(expert_ranks(d, ep, dp // ep, data_first)[0] * local,
                       (expert_ranks(d, ep, dp // ep, data_first)[0] + 1) * local)) for d in range(dp)}


@pytest.mark.parametrize("name,there", [("autoep2_z3_fp32", "ep=1"), ("autoep2_z3_fp32", "ep=2,dp=2,zero=1"),
                                        ("autoep2_z3_fp32_dp2", "ep=4"), ("autoep2_z3_fp32_dp2", "ep=1,dp=2,zero=2")])
def test_there_and_back_gives_deepspeeds_own_files(name, there, tmp_path):
    meta = truth_json(name)
    convert_and_open(fixture_dir(name), tmp_path / "there", there)
    convert_and_open(tmp_path / "there", tmp_path / "back", f"ep=2,dp={meta['world_size']},zero=3")
    assert_deepspeeds_own_files(name, tmp_path / "back")


def _rewrite_model_states(save, change):
    """Every rank's model states of a copy, changed by change(state dict) and saved again (our own test files)."""
    import torch
    for path in sorted(tag_dir(save).glob("zero_pp_rank_*_model_states.pt")):
        sd = torch.load(path, weights_only=False)
        change(sd)
        torch.save(sd, path)


def test_another_expert_state_format_version_is_refused_in_one_line(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z3_fp32"), save)

    def version_2(sd):
        for entry in sd["ds_autoep_layers"]:
            entry["checkpoint_format_version"] = 2
    _rewrite_model_states(save, version_2)
    proc = run_cli("inspect", save, check=1)
    [line] = proc.stderr.strip().splitlines()
    assert "expert state format 'zero3_partitioned' version 2; only 'zero3_partitioned' version 1" in line, line


def test_a_rank_naming_other_experts_than_its_process_groups_is_a_problem(tmp_path):
    """Rank 1 of the ep-2 save says it held ep rank 0's experts: validate names its model states."""
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z3_fp32"), save)
    path = tag_dir(save) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    import torch
    sd = torch.load(path, weights_only=False)
    for entry in sd["ds_autoep_layers"]:
        entry["ep_rank"] = 0
    torch.save(sd, path)
    proc = run_cli("validate", save, check=1)
    [line] = lines_naming(proc, path.name)
    assert line == f"{path}: MoE layer 0: ep rank, expert-data-parallel rank (0, 0), expected (1, 0) for " \
                   "data-parallel rank 1"


def test_a_zero3_moe_save_is_not_written_as_a_universal_tree_for_zero3(tmp_path):
    proc = run_cli("convert", fixture_dir("autoep2_z3_fp32"), tmp_path / "out", "--format", "universal", check=1)
    [line] = proc.stderr.strip().splitlines()
    assert "a universal checkpoint of experts is written for ZeRO-1/2 only" in line
    assert not (tmp_path / "out").exists()


def test_a_save_without_zero_is_refused_in_one_line_naming_why(tmp_path):
    """An `expp_rank_*` optimizer file (DeepSpeed's MoE save without ZeRO, docs/deepspeed-moe.md §6) in the tag
    folder: refused before anything is read."""
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z1_fp32"), save)
    shutil.copy(tag_dir(save) / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                tag_dir(save) / "expp_rank_0_mp_rank_00_optim_states.pt")
    proc = run_cli("inspect", save, check=1)
    [line] = proc.stderr.strip().splitlines()
    assert line == f"reshard: {tag_dir(save)}: mixture-of-experts checkpoints without ZeRO (expp_rank_* optimizer " \
                   "files) are not supported"
