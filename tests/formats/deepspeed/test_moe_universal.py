"""`convert --format universal` of AutoEP mixture-of-experts saves (issue #16), without the engine: our tree is the
one DeepSpeed's own ds_to_universal writes, file for file and tensor for tensor, but for the few model-state and
optimizer_state.pt entries listed (and why) below; at another ep only the model states change; what cannot be
written is refused in one line.
tests/formats/deepspeed/test_moe_engine.py has the engine load these trees with load_universal."""
import shutil

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.helpers.deepspeed_files import assert_deepspeeds_own_files
from tests.helpers.fixtures import fixture_dir, truth_json, truth_tensors
from tests.helpers.moe import AUTOEP
from tests.helpers.universal import differences, ds_to_universal, load_output, our_universal, tree_files

TAG = "global_step3"
UC_INFO = f"{TAG}/mp_rank_00_model_states.pt.universal_checkpoint_info"


def _expected_differences() -> set:
    """Where ds_to_universal and we differ on purpose; no loader reads any of these (DeepSpeed 0.19.8):
    * universal_checkpoint_info: ds_to_universal rewrites the engine's expert_parameter_patterns
      ('.*\\.experts\\.w[123]$' -> '\\.experts\\.w[123]$') and cuts its ds_autoep_layers down to six keys per layer;
      ours are the engine's own, as it saves them at the target's ep.
    * optimizer_state.pt's partition_count: ds_to_universal's ZeROCheckpoint sets every group's to dp
      (_update_partition_count); ours is the engine's, the expert group cut over the expert-data-parallel group."""
    return {f"{UC_INFO}.expert_parameter_patterns[0]", f"{UC_INFO}.ds_autoep_layers[0]",
            f"{UC_INFO}.ds_autoep_layers[1]", f"{TAG}/zero/optimizer_state.pt.partition_count[1]"}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-universal")
    return {name: (ds_to_universal(name, root / f"{name}-ds"), our_universal(name, root / f"{name}-ours"))
            for name in AUTOEP}


def _tree_differences(theirs, mine) -> list:
    assert tree_files(theirs) == tree_files(mine)
    found = []
    for rel in tree_files(theirs):
        if rel.endswith(".pt"):
            found += [d.split(":")[0] for d in differences(load_output(theirs / rel), load_output(mine / rel), rel)]
    return found


@pytest.mark.parametrize("name", AUTOEP)
def test_our_tree_is_ds_to_universals(trees, name):
    theirs, mine = trees[name]
    assert (theirs / "latest_universal").read_text() == (mine / "latest_universal").read_text() == TAG
    assert set(_tree_differences(theirs, mine)) == _expected_differences()


@pytest.mark.parametrize("name", AUTOEP)
def test_every_expert_is_whole_and_marked(trees, name):
    """Each packed weight's state files hold all its experts, (num_experts, ...), the fixture's truth bit for bit,
    with the keys the loader slices them by."""
    _, mine = trees[name]
    truth = truth_tensors(name)
    packed = sorted(k.split("/", 1)[1] for k in truth if k.startswith("fp32/") and ".experts.w" in k)
    assert len(packed) == 6
    for param in packed:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = load_output(mine / TAG / "zero" / param / f"{state}.pt")
            assert list(saved) == ["param", "cat_dim", "is_expert_param", "ep_num_experts"]
            assert (saved["cat_dim"], saved["is_expert_param"], saved["ep_num_experts"]) == (0, True, 4)
            assert torch.equal(saved["param"], truth[f"{state}/{param}"])


def test_another_ep_changes_only_the_model_states(trees, tmp_path):
    """The zero/ tree serves every ep (the loader cuts the experts by the live placement); the model states are
    the engine's at ep 4 x dp 4, and the expert group's name follows the ep."""
    _, mine = trees["autoep2_z1_fp32"]
    at4 = our_universal("autoep2_z1_fp32", tmp_path / "ep4", "ep=4,dp=4")
    found = _tree_differences(mine, at4)
    assert found and all(d.startswith(f"{TAG}/mp_rank_00_model_states.pt") or
                         d.startswith(f"{TAG}/zero/optimizer_state.pt.param_groups[1].name") or
                         d.startswith(f"{TAG}/zero/optimizer_state.pt.partition_count") for d in found), found
    states = load_output(at4 / TAG / "mp_rank_00_model_states.pt")
    assert states["dp_world_size"] == 4
    assert [e["ep_size"] for e in states["ds_autoep_layers"]] == [4, 4]
    assert load_output(at4 / TAG / "zero" / "optimizer_state.pt")["param_groups"][1]["name"] == "ep_size_4"


@pytest.mark.parametrize("name", AUTOEP)
def test_diff_finds_no_difference_and_the_way_back_gives_deepspeeds_own_files(trees, name, tmp_path):
    """Our tree read back (tests/formats/deepspeed/test_moe_universal_read.py reads ds_to_universal's) is the save;
    converted back to
    the save's topology it gives the engine's own files. Negative control: a changed expert element shows."""
    _, mine = trees[name]
    assert run_cli("diff", fixture_dir(name), mine, check=0).stdout.startswith("no difference")
    meta = truth_json(name)
    run_cli("convert", mine, tmp_path / "back", "--format", "deepspeed", "--to",
            f"ep={meta['ep']},dp={meta['world_size']}", "--quiet", check=0)
    assert_deepspeeds_own_files(name, tmp_path / "back")
    changed = tmp_path / "changed"
    shutil.copytree(mine, changed)
    master = changed / TAG / "zero" / "model.layers.1.mlp.experts.w2" / "fp32.pt"
    saved = load_output(master)
    saved["param"][3, 0, 0] += 0.5
    torch.save(saved, master)
    proc = run_cli("diff", fixture_dir(name), changed, check=1)
    assert "DIFFERENT" in proc.stdout and "model.layers.1.mlp.experts.w2" in proc.stdout


@pytest.mark.parametrize("name,args,needle", [
    ("dsmoe_ep2_z2_fp32", [], "a universal checkpoint of deepspeed.moe experts cannot be loaded"),
    ("autoep2_z1_fp32", ["--to", "zero=3"], "ZeRO-1/2 only"),
    ("autoep2_z1_fp32", ["--to", "ep=3,dp=3"], "ep=3 does not divide the 4 experts"),
    ("z2_fp32_dp4", ["--to", "ep=2"], "ep=2: the source has no experts"),
])
def test_what_cannot_be_written_is_refused_in_one_line(name, args, needle, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("convert", fixture_dir(name), out, "--format", "universal", *args)
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert not out.exists()
