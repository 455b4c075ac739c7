"""DeepSpeed's own universal tree of an AutoEP save (ds_to_universal) read as a source (issue #16): the catalog is
what reading the ZeRO save gives — every packed expert weight one (num_experts, ...) logical tensor with its fp32
master and Adam moments, the placement from the model states' ds_autoep_layers — and the experts' module weights,
which the tree keeps nowhere, are their master cast to the model's dtype, as DeepSpeed's universal load sets them.
The truth is the engine's (truth.safetensors); the engine's resume of the tree converted back is in
test_moe_engine.py. No torchrun."""
import json
import shutil

import pytest
import torch

import reshard
from reshard.core.catalog import MASTER, MODULE
from reshard.formats.deepspeed import topology as ds
from tests.helpers.cli import assert_one_line_error, run_cli
from tests.helpers.damage import set_element
from tests.helpers.fixtures import fixture_dir, truth_json, truth_tensors
from tests.helpers.moe import PACKED, truth_differences
from tests.helpers.universal import ds_to_universal

READ = ["autoep2_z1_fp32", "autoep2_z2_bf16", "autoep2_z2_fp32_dp2"]
CHANGED_ELEMENT = 3 * 16 * 32 + 100      # expert 3 of PACKED (4, 16, 32)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """ds_to_universal's tree of each fixture (its save dir, with latest_universal), made once."""
    root = tmp_path_factory.mktemp("moe_universal_read")
    return {name: ds_to_universal(name, root / name) for name in READ}


@pytest.mark.parametrize("name", READ)
def test_the_tree_reads_as_the_engines_truth(trees, name):
    catalog = reshard.open_checkpoint(trees[name])
    source = reshard.open_checkpoint(fixture_dir(name))
    assert catalog.format == "universal"
    assert truth_differences(catalog, truth_tensors(name)) == []
    assert catalog.experts == source.experts            # ep, expert-dp, every layer's placement and params
    assert catalog.experts.expert_dp == truth_json(name)["world_size"] // 2
    assert {n: (p.kind, p.group) for n, p in catalog.params.items()} == \
        {n: (p.kind, p.group) for n, p in source.params.items()}
    assert ds.of(catalog.layout).ep == 2 and catalog.layout.dtype == source.layout.dtype
    report = reshard.validate(catalog)
    assert report.ok, report.problems
    # the experts' module weights are the master's own elements, cast where the model is 16-bit
    master, module = catalog.tensors[(PACKED, MASTER)], catalog.tensors[(PACKED, MODULE)]
    assert module.fragments == master.fragments and master.dtype == "float32"
    assert (module.dtype, module.cast_from) == (("bfloat16", "float32") if "bf16" in name else ("float32", ""))


@pytest.mark.parametrize("name", READ)
def test_diff_of_the_save_and_its_tree_finds_no_difference(trees, name, tmp_path):
    proc = run_cli("diff", fixture_dir(name), trees[name], check=0)
    assert proc.stdout.startswith("no difference: 94 tensors" if "bf16" in name else "no difference: 88 tensors")
    # negative control: one element of expert 3's fp32 master changed in a copy of the tree
    changed = tmp_path / "changed"
    shutil.copytree(trees[name], changed)
    set_element(reshard.open_checkpoint(changed), PACKED, MASTER, CHANGED_ELEMENT, lambda x: x + 0.5)
    proc = run_cli("diff", fixture_dir(name), changed, check=1)
    found = [line.split(":")[0] for line in proc.stdout.splitlines()[:-1]]
    # a bf16 model's expert module is the master cast: it changes with it (and is compared, as a cast)
    assert found == [f"{PACKED} (weight)"] + ([f"{PACKED} (module)"] if "bf16" in name else [])
    assert f"at element {CHANGED_ELEMENT}" in proc.stdout


@pytest.mark.parametrize("name", READ)
def test_inspect_shows_the_experts(trees, name):
    edp = truth_json(name)["world_size"] // 2
    text = run_cli("inspect", trees[name], check=0).stdout
    assert "format        universal" in text and f"experts       ep=2 expert-dp={edp}; layer 0: 4 experts, 2/2 per " \
                                                  "rank; layer 1: 4 experts, 2/2 per rank" in text
    ours = json.loads(run_cli("inspect", trees[name], "--json", check=0).stdout)["experts"]
    assert ours == json.loads(run_cli("inspect", fixture_dir(name), "--json", check=0).stdout)["experts"]


def test_validate_names_a_missing_or_unmarked_expert_state_file(trees, tmp_path):
    name = "autoep2_z2_fp32_dp2"
    run_cli("validate", trees[name], check=0)
    broken = tmp_path / "broken"
    shutil.copytree(trees[name], broken)
    missing = broken / "global_step3" / "zero" / PACKED / "exp_avg.pt"
    missing.unlink()
    proc = run_cli("validate", broken, check=1)
    assert f"{missing}: missing: the exp_avg of {PACKED}" in proc.stdout
    # an expert state not marked as every expert (is_expert_param, ep_num_experts): named, not read as dense
    unmarked = broken / "global_step3" / "zero" / PACKED / "exp_avg_sq.pt"
    state = torch.load(unmarked, weights_only=True)
    torch.save({"cat_dim": 0, "param": state["param"]}, unmarked)
    proc = run_cli("validate", broken, check=1)
    assert f"{unmarked}: an expert param's state, but not marked is_expert_param with ep_num_experts=4" in proc.stdout


@pytest.mark.parametrize("name", READ)
def test_export_writes_the_full_experts(trees, name, tmp_path):
    from safetensors.torch import load_file
    truth = truth_tensors(name)
    run_cli("export", trees[name], tmp_path / "master.safetensors", "--dtype", "fp32", "--quiet", check=0)
    exported = load_file(str(tmp_path / "master.safetensors"))
    catalog = reshard.open_checkpoint(trees[name])
    assert set(exported) == set(catalog.order) and exported[PACKED].shape == (4, 16, 32)
    for key, value in exported.items():
        expected = truth[f"fp32/{key}"] if catalog.params[key].kind == "trainable" else truth[f"module/{key}"]
        assert torch.equal(value, expected), key
    # the module weights in the model's dtype: the experts' are their master cast, equal to the engine's
    run_cli("export", trees[name], tmp_path / "module.safetensors", "--weights", "module", "--dtype", "auto",
            "--quiet", check=0)
    exported = load_file(str(tmp_path / "module.safetensors"))
    assert all(torch.equal(value, truth[f"module/{key}"]) for key, value in exported.items())


def test_a_cast_is_not_written_in_a_third_dtype(trees, tmp_path):
    """bf16 module weights that are an fp32 master cast, exported as fp32: the copy would cast the fp32 bytes once,
    not give the bf16 values; refused in one line, nothing written."""
    out = tmp_path / "fp32.safetensors"
    assert_one_line_error(run_cli("export", trees["autoep2_z2_bf16"], out, "--weights", "module", "--dtype", "fp32"),
                          "(module) is its float32 values cast to bfloat16; writing it as float32 is not supported")
    assert not out.exists()


@pytest.mark.parametrize("name,to", [("autoep2_z1_fp32", "ep=1,dp=2"), ("autoep2_z2_bf16", "ep=1,dp=2"),
                                     ("autoep2_z2_fp32_dp2", "ep=4,dp=4")])
def test_convert_writes_what_converting_the_save_writes(trees, name, to, tmp_path):
    """The tree converted to an AutoEP save is, file for file and byte for byte, the ZeRO save converted (whose
    engine resume test_moe_engine.py proves): model states with the engine's universal_checkpoint_info (not
    ds_to_universal's rewrite), every layer_L_expert_E file (the bf16 ones cast from the masters), optimizer files."""
    ours, theirs = tmp_path / "from-tree", tmp_path / "from-save"
    run_cli("convert", trees[name], ours, "--format", "deepspeed", "--to", to, "--quiet", check=0)
    run_cli("convert", fixture_dir(name), theirs, "--to", to, "--quiet", check=0)
    files = _written(ours)
    assert files == _written(theirs)
    assert len([f for f in files if f.startswith("global_step3/layer_")]) == 8
    assert [f for f in files if (ours / f).read_bytes() != (theirs / f).read_bytes()] == []
    assert truth_differences(reshard.open_checkpoint(ours), truth_tensors(name)) == []


def _written(save_dir) -> list:
    """The tag folder's files and `latest` (not the save dir's scripts, which a universal tree does not have)."""
    return ["latest"] + sorted(str(p.relative_to(save_dir)) for p in (save_dir / "global_step3").rglob("*"))


def test_refused_expert_trees(trees, tmp_path):
    """Expert param groups whose placement the model states do not give (a deepspeed.moe tree, which
    ds_to_universal 0.19.8 cannot write anyway): one line."""
    broken = tmp_path / "broken"
    shutil.copytree(trees["autoep2_z1_fp32"], broken)
    model = broken / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=False)
    state["ds_autoep_layers"] = None
    torch.save(state, model)
    assert_one_line_error(run_cli("inspect", broken), "expert param groups (moe: True) without ds_autoep_layers")
