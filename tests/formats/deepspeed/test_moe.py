"""Mixture-of-experts DeepSpeed saves (issue #16): AutoEP Mixtral (ZeRO-1/2, fp32/bf16, ep 2, ep 2 x dp 2) and
deepspeed.moe (ep 2), read as full logical tensors, inspected, validated and exported; the truth is the live
engine's (tools/fixture_moe.py). Reading needs no torchrun."""
import json
import os
import shutil

import pytest
import torch

import reshard
from reshard.core.catalog import MASTER, MODULE
from reshard.formats.deepspeed import topology as ds
from reshard.reading.source_bytes import full_tensor
from tests.helpers.cli import lines_naming, run_cli
from tests.helpers.damage import set_element
from tests.helpers.fixtures import FIXTURES, MOE_FIXTURES, fixture_dir, tag_dir, truth_json, truth_tensors
from tests.helpers.moe import AUTOEP, AUTOEP_Z3, PACKED, truth_differences


def test_the_moe_fixtures_are_there():
    assert AUTOEP == ["autoep2_z1_fp32", "autoep2_z2_bf16", "autoep2_z2_fp32_dp2", "autoep2_z2_fp32_dp2_datafirst"]
    assert AUTOEP_Z3 == ["autoep2_z3_fp32", "autoep2_z3_fp32_dp2"]
    assert MOE_FIXTURES == sorted(AUTOEP + AUTOEP_Z3) + ["dsmoe_ep2_z2_fp32"]
    for name in MOE_FIXTURES:       # small enough to commit
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(FIXTURES / name) for f in fs)
        assert size < 1 << 20, (name, size)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_every_tensor_is_the_engines_truth(name):
    catalog = reshard.open_checkpoint(fixture_dir(name))
    meta = truth_json(name)
    assert truth_differences(catalog, truth_tensors(name)) == []
    assert sorted(n for n, p in catalog.params.items() if p.kind == "trainable") == sorted(meta["trainable"])
    assert catalog.layout.dp == meta["world_size"] and ds.of(catalog.layout).zero == meta["zero_stage"]
    experts = catalog.experts
    assert (experts.ep, experts.expert_dp) == (meta["ep"], meta["world_size"] // meta["ep"])
    assert all(layer.num_experts == meta["num_experts"] and layer.placement == ((0, 1), (2, 3))
               for layer in experts.layers)
    report = reshard.validate(catalog)
    assert report.ok, report.problems


@pytest.mark.parametrize("name", AUTOEP + AUTOEP_Z3)
def test_autoep_experts_are_one_packed_tensor_each(name):
    """Every expert of a packed weight in one (num_experts, ...) logical tensor; each rank's local experts a box."""
    catalog = reshard.open_checkpoint(fixture_dir(name))
    master = catalog.tensors[(PACKED, MASTER)]
    assert master.shape == (4, 16, 32)
    if name in AUTOEP:      # (ZeRO-3 saves no module copy of a trainable param)
        assert catalog.tensors[(PACKED, MODULE)].shape == (4, 16, 32)
    boxes = {(b.at, b.shape) for f in master.fragments for b in f.shard.blocks}
    assert boxes == {((0, 0, 0), (2, 16, 32)), ((2, 0, 0), (2, 16, 32))}      # ep rank 0: experts 0-1, rank 1: 2-3


@pytest.mark.parametrize("name,experts_of_rank", [
    ("autoep2_z2_fp32_dp2", {0: (0, 1), 1: (2, 3), 2: (0, 1), 3: (2, 3)}),    # ep groups [0, 1], [2, 3]: rank % 2
    ("autoep2_z2_fp32_dp2_datafirst", {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)})])   # data first: rank // 2
def test_which_rank_file_holds_which_experts(name, experts_of_rank):
    """ep 2 x dp 2: the experts each rank's optimizer file holds, as DeepSpeed's process groups give them."""
    catalog = reshard.open_checkpoint(fixture_dir(name))
    held = {}
    for layer in catalog.experts.layers:
        for param in layer.params:
            for f in catalog.tensors[(param, MASTER)].fragments:
                for b in f.shard.blocks:
                    held.setdefault(f.rank, set()).update(range(b.at[0], b.at[0] + b.shape[0]))
    assert {rank: tuple(sorted(e)) for rank, e in held.items()} == experts_of_rank


def test_deepspeed_moe_experts_are_named_by_their_global_number():
    catalog = reshard.open_checkpoint(fixture_dir("dsmoe_ep2_z2_fp32"))
    experts = sorted({n.split(".")[4] for n in catalog.params if ".deepspeed_experts." in n})
    assert experts == ["0", "1", "2", "3"]
    [layer] = catalog.experts.layers
    assert len(layer.params) == 4 * 4         # 4 experts x (2 Linear weights + biases)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_export_is_the_truth_bit_for_bit(name, tmp_path):
    from safetensors.torch import load_file
    out = tmp_path / "model.safetensors"
    run_cli("export", fixture_dir(name), out, "--quiet", "--dtype", "fp32", check=0)     # the fp32 masters
    exported, truth = load_file(str(out)), truth_tensors(name)
    catalog = reshard.open_checkpoint(fixture_dir(name))
    # (a ZeRO-3 save's router alias is a tie: listed in the metadata, not written twice)
    assert set(exported) == set(catalog.order) - set(catalog.aliases)
    for key, value in exported.items():
        expected = truth[f"fp32/{key}"] if catalog.params[key].kind == "trainable" else truth[f"module/{key}"]
        assert torch.equal(value, expected), key
    if name in AUTOEP:
        assert exported[PACKED].shape == (4, 16, 32)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_inspect_shows_ep_experts_per_rank_and_expert_dp(name):
    meta = truth_json(name)
    info = json.loads(run_cli("inspect", fixture_dir(name), "--json", check=0).stdout)
    edp = meta["world_size"] // 2
    assert info["experts"]["ep"] == 2 and info["experts"]["expert_dp"] == edp
    assert [(layer["experts"], layer["experts_per_rank"]) for layer in info["experts"]["layers"]] == \
        [(4, [2, 2])] * (2 if name in AUTOEP + AUTOEP_Z3 else 1)
    text = run_cli("inspect", fixture_dir(name), check=0).stdout
    assert f"ep=2 expert-dp={edp}; layer 0: 4 experts, 2/2 per rank" in text
    # negative control: a save without experts says none
    assert json.loads(run_cli("inspect", fixture_dir("z1_fp32_dp2"), "--json", check=0).stdout)["experts"] is None


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_validate_passes(name):
    assert run_cli("validate", fixture_dir(name), check=0).stdout.startswith("complete")


@pytest.mark.parametrize("name", ["autoep2_z1_fp32", "dsmoe_ep2_z2_fp32"])
def test_validate_names_a_missing_expert_file(name, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(fixture_dir(name), save)
    missing = tag_dir(save) / "layer_0_expert_3_mp_rank_00_model_states.pt"
    os.remove(missing)
    proc = run_cli("validate", save, check=1)
    [line] = lines_naming(proc, missing.name)
    assert line == f"{missing}: missing (expected for expert 3 of MoE layer 0)"
    assert proc.stdout.splitlines()[-1].startswith("NOT complete")


def test_validate_names_a_missing_expert_data_parallel_optimizer_file(tmp_path):
    """ep 2 x dp 2: rank 3's optimizer file holds the second expert-data-parallel half of experts 2-3."""
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z2_fp32_dp2"), save)
    missing = tag_dir(save) / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    os.remove(missing)
    proc = run_cli("validate", save, check=1)
    [line] = lines_naming(proc, missing.name)
    assert line == f"{missing}: missing (expected for data-parallel rank 3)"
    # it held the half of ep rank 1's flat expert partition that has layer 1's w2: its experts 2-3 are missing,
    # ep rank 0's experts 0-1 are there (in rank 2's file)
    catalog = reshard.open_checkpoint(save)
    held = {(b.at[0], b.shape[0]) for f in catalog.tensors[(PACKED, MASTER)].fragments for b in f.shard.blocks}
    assert held == {(0, 2)}
    [gap] = [line for line in proc.stdout.splitlines() if f"{PACKED} (fp32, " in line]
    assert gap.endswith("1024 elements missing, at [1024, 2048)")


def test_one_changed_expert_element_is_caught(tmp_path):
    """Negative control of the truth comparison: one element of expert 3's fp32 master changed in a copy is found,
    in that tensor only; `reshard diff` against the original names it; a NaN there fails `validate --deep`."""
    name = "autoep2_z2_fp32_dp2"
    save = tmp_path / "save"
    shutil.copytree(fixture_dir(name), save)
    element = 3 * 16 * 32 + 100          # expert 3 of the packed (4, 16, 32) weight
    set_element(reshard.open_checkpoint(save), PACKED, MASTER, element, lambda x: x + 0.5)
    changed = reshard.open_checkpoint(save)
    assert truth_differences(changed, truth_tensors(name)) == [f"fp32/{PACKED}"]
    diff = (full_tensor(changed, PACKED, MASTER) - truth_tensors(name)[f"fp32/{PACKED}"]).reshape(-1)
    assert diff.nonzero().reshape(-1).tolist() == [element] and float(diff[element]) == pytest.approx(0.5)
    proc = run_cli("diff", fixture_dir(name), save, check=1)
    assert "DIFFERENT" in proc.stdout and lines_naming(proc, PACKED)
    set_element(reshard.open_checkpoint(save), PACKED, MASTER, element, lambda x: float("nan"))
    run_cli("validate", save, check=0)              # complete: every element is there
    proc = run_cli("validate", save, "--deep", check=1)
    assert len(lines_naming(proc, PACKED)) == 1


def test_validate_names_an_unreadable_expert_file(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autoep2_z2_bf16"), save)
    broken = tag_dir(save) / "layer_1_expert_0_mp_rank_00_model_states.pt"
    broken.write_bytes(broken.read_bytes()[:1000])           # cut short: not a zip any more
    proc = run_cli("validate", save, check=1)
    [line] = lines_naming(proc, broken.name)
    assert line.startswith(f"{broken}: ")
    # its experts' weights are missing, every other expert's are there
    gaps = [line for line in proc.stdout.splitlines() if "missing, at" in line]
    assert gaps and all("model.layers.1.mlp.experts.w" in line and "(module," in line and
                        line.endswith("elements missing, at [0, 512)") for line in gaps)
