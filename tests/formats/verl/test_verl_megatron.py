"""verl's Megatron-backend checkpoints (fixtures/verl_megatron/{dp2,tp2}, saved by verl 0.9.1's own
MegatronCheckpointManager at 2 CPU ranks, tp=1 dp=2 and tp=2 dp=1: tools/fixture_verl_megatron.py), read through the
Megatron reader.

Each fixture holds ``global_step_3/actor/`` as verl's manager lays it out (``ckpt_contents.json``,
``transformer_config.json``, ``model/``, ``optimizer/`` and ``extra/dist_ckpt/``), ``global_step_3/data.pt`` and the
tracker. reshard reads the model's torch_dist save with the Megatron reader and names the optimizer's and the RNG
states' folders as not read, their files checked present. Proof of what it reads: megatron-core's own
``dist_checkpointing.load_plain_tensors`` of ``model/dist_ckpt`` (tests/scripts/megatron_plain_load.py, one launch at
1 rank) equals ``reshard export``'s safetensors bit for bit; negative control: the export of a copy with one weight
element changed differs from it in that weight alone. A conversion is refused in one line (its optimizer is not
read); a missing optimizer shard makes the step incomplete in `validate` and `list`, and `prune --delete-incomplete`
takes the whole step folder, never a part of it.
"""
from __future__ import annotations

import json
import shutil

import pytest

from reshard.formats.megatron.pickles import METADATA_ALLOWED
from tests.helpers.cli import assert_one_line_error, run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.fixtures import FIXTURES
from tests.helpers.lifecycle_runs import age
from tests.helpers.torchrun import run_torchrun

ROOT = FIXTURES / "verl_megatron"
RUNS = {"dp2": (2, 1), "tp2": (1, 2)}       # each fixture's (dp, tp)
RUN = ROOT / "dp2"
STEP = RUN / "global_step_3"
ACTOR = STEP / "actor"
CHANGED = "decoder.layers.1.mlp.linear_fc2.weight"     # the weight the negative control changes
STACK = "decoder.layers."


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fixture_is_verl_own_layout(name):
    run = ROOT / name
    actor = run / "global_step_3" / "actor"
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (run / "global_step_3" / "data.pt").is_file()
    manifest = json.loads((actor / "ckpt_contents.json").read_text())
    assert (manifest["framework"], manifest["schema_version"], manifest["role"], manifest["global_step"],
            manifest["world_size"]) == ("megatron", 2, "actor", 3, 2)
    assert manifest["backend"] == {"has_bridge": False, "peft": False, "use_dist_checkpointing": True}
    for part in ("model", "optimizer", "extra"):
        folder = actor / part / "dist_ckpt"
        assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        assert (folder / ".metadata").is_file() and (folder / "common.pt").is_file()
    config = json.loads((actor / "transformer_config.json").read_text())
    assert config["tensor_model_parallel_size"] == RUNS[name][1] == json.loads((run / "truth.json").read_text())["tp"]


@pytest.mark.parametrize("where", [RUN, STEP, ACTOR, ROOT / "tp2"])
def test_inspect_reads_the_model_and_names_what_it_does_not(where):
    info = json.loads(run_cli("inspect", "--json", where, check=0).stdout)
    assert (info["format"], info["tag"], info["global_steps"], info["parameters"]) == ("verl", "global_step_3", 3, 17)
    dp, tp = RUNS["tp2" if "tp2" in str(where) else "dp2"]      # (the degrees transformer_config.json gives)
    assert (info["topology"]["dp"], info["topology"]["tp"], info["dtype"]) == (dp, tp, "bfloat16")
    assert "Megatron backend" in info["framing"] and "model/dist_ckpt" in info["framing"]
    assert [u["path"] for u in info["unread"]] == ["optimizer/dist_ckpt", "extra/dist_ckpt"]
    files = {f["path"] for f in info["files"]}
    assert {"model/dist_ckpt/__0_0.distcp", "optimizer/dist_ckpt/__1_1.distcp", "extra/dist_ckpt/__0_0.distcp"} <= files
    text = run_cli("inspect", where, check=0).stdout
    assert "not read      optimizer/dist_ckpt" in text
    validated = run_cli("validate", "--deep", where, check=0).stdout
    assert "not read: optimizer/dist_ckpt" in validated and validated.splitlines()[-1].startswith("complete; 17 ")


@pytest.fixture(scope="module")
def megatron_loaded(tmp_path_factory):
    """{fixture: (megatron-core's own load of its model/dist_ckpt, reshard's export of it, reshard's export of a copy
    with one element of CHANGED changed)}: one launch, a job per fixture."""
    from safetensors.torch import load_file
    out = tmp_path_factory.mktemp("verl_megatron")
    jobs = [{"label": name, "folder": str(ROOT / name / "global_step_3" / "actor" / "model" / "dist_ckpt"),
             "out": str(out / f"{name}-megatron.safetensors")} for name in sorted(RUNS)]
    results = run_torchrun("megatron_plain_load.py", 1, jobs, out, "verl-megatron")
    assert all(r["loaded"] for r in results), results
    found = {}
    for job in jobs:
        name = job["label"]
        actor = ROOT / name / "global_step_3" / "actor"
        changed = out / name / "changed" / "global_step_3" / "actor"
        shutil.copytree(actor, changed)
        change_dcp_element(changed, CHANGED, METADATA_ALLOWED, state="module")
        for source, kind in ((actor, "export"), (changed, "changed")):
            run_cli("export", source, out / name / kind / "model.safetensors", check=0)
        found[name] = tuple(load_file(path) for path in (job["out"], str(out / name / "export" / "model.safetensors"),
                                                         str(out / name / "changed" / "model.safetensors")))
    return found


def _unstacked(loaded: dict) -> dict:
    """megatron-core's tensors under reshard's names: a layer stack cut along its leading (layer) axis."""
    out = {}
    for key, tensor in loaded.items():
        if key.startswith(STACK):
            for layer in range(tensor.shape[0]):
                out[f"{STACK}{layer}.{key[len(STACK):]}"] = tensor[layer]
        else:
            out[key] = tensor
    return out


@pytest.mark.engine
@pytest.mark.parametrize("name", sorted(RUNS))
def test_export_equals_megatron_core_load(megatron_loaded, name):
    import torch
    loaded, exported, _ = megatron_loaded[name]
    expected = _unstacked(loaded)
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(exported[name], tensor), name


@pytest.mark.engine
@pytest.mark.parametrize("name", sorted(RUNS))
def test_negative_control_changed_element_is_found(megatron_loaded, name):
    import torch
    loaded, _, changed = megatron_loaded[name]
    expected = _unstacked(loaded)
    differing = [name for name, tensor in expected.items() if not torch.equal(changed[name], tensor)]
    assert differing == [CHANGED]


def test_convert_is_refused_in_one_line(tmp_path):
    proc = run_cli("convert", STEP, tmp_path / "out", "--to", "dp=1")
    assert_one_line_error(proc, "actor", "Megatron-backend", "not converted", "optimizer/dist_ckpt")
    assert not (tmp_path / "out").exists()


def _run_copy(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    age(run)
    return run


def test_missing_optimizer_shard_makes_the_step_incomplete(tmp_path):
    """The run with an older step beside the fixture's (its copy, as global_step_2), one optimizer shard lost."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    shutil.copytree(STEP, run / "global_step_2")
    age(run)
    listed = json.loads(run_cli("list", "--json", run, check=0).stdout)
    assert [(r["name"], r["format"], r["status"]) for r in listed["checkpoints"]] == \
        [("global_step_2", "verl", "complete"), ("global_step_3", "verl", "complete")]     # the control
    lost = run / "global_step_2" / "actor" / "optimizer" / "dist_ckpt" / "__1_1.distcp"
    lost.unlink()
    age(run)
    proc = run_cli("validate", run / "global_step_2")
    assert proc.returncode == 1 and "optimizer/dist_ckpt/__1_1.distcp: missing" in proc.stdout + proc.stderr
    rows = json.loads(run_cli("list", "--json", run, check=1).stdout)["checkpoints"]
    assert [r["status"] for r in rows] == ["incomplete", "complete"] and "__1_1.distcp" in rows[0]["why"]
    run_cli("prune", run, "--keep-last", "1", "--yes", check=0)       # incomplete: kept without --delete-incomplete
    assert (run / "global_step_2" / "actor" / "model").is_dir()
    # with it, taken whole or not at all: the step folder goes, data.pt and actor/ with it
    run_cli("prune", run, "--keep-last", "1", "--delete-incomplete", "--yes", check=0)
    assert sorted(p.name for p in run.iterdir()) == ["global_step_3", "latest_checkpointed_iteration.txt",
                                                     "truth.json"]
    assert (run / "global_step_3" / "actor" / "optimizer" / "dist_ckpt" / "__1_1.distcp").is_file()


def test_unfinished_save_without_its_manifest(tmp_path):
    run = _run_copy(tmp_path)
    (run / "global_step_3" / "actor" / "ckpt_contents.json").unlink()
    age(run)
    proc = run_cli("inspect", run / "global_step_3")
    assert_one_line_error(proc, "ckpt_contents.json", "missing", "did not finish")
    [row] = json.loads(run_cli("list", "--json", run, check=1).stdout)["checkpoints"]
    assert row["status"] == "incomplete" and "ckpt_contents.json" in row["why"]


def test_a_lost_model_folder_is_missing(tmp_path):
    run = _run_copy(tmp_path)
    shutil.rmtree(run / "global_step_3" / "actor" / "model" / "dist_ckpt")
    age(run)
    assert_one_line_error(run_cli("inspect", run), "model/dist_ckpt", "missing", "ckpt_contents.json says")
    [row] = json.loads(run_cli("list", "--json", run, check=1).stdout)["checkpoints"]
    assert row["status"] == "incomplete" and "model/dist_ckpt" in row["why"]


def test_schema_1_layout_is_named_in_one_line_and_never_deleted(tmp_path):
    """verl's pre-v2 layout (dist_ckpt/ directly under the role, as its _raise_for_old_layout describes it): the
    fixture's model save moved there, the v2 folders and the manifest gone."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    shutil.copytree(STEP, run / "global_step_2")
    old = run / "global_step_2" / "actor"
    (old / "model" / "dist_ckpt").rename(old / "dist_ckpt")
    for name in ("model", "optimizer", "extra"):
        shutil.rmtree(old / name)
    (old / "ckpt_contents.json").unlink()
    age(run)
    assert_one_line_error(run_cli("inspect", run / "global_step_2"), "actor/dist_ckpt", "schema 1", "not read",
                          "migrate_megatron_checkpoint_layout.py")
    rows = json.loads(run_cli("list", "--json", run, check=0).stdout)["checkpoints"]
    assert [(r["name"], r["status"]) for r in rows] == [("global_step_2", "unverifiable"),
                                                        ("global_step_3", "complete")]
    run_cli("prune", run, "--keep-last", "1", "--delete-incomplete", "--yes", check=0)
    # never deleted, even with --delete-incomplete (which deletes a step missing a shard, as tested above)
    assert (old / "dist_ckpt" / ".metadata").is_file() and (run / "global_step_3").is_dir()
