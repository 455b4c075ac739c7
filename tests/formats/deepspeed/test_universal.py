"""DeepSpeed universal checkpoints: written by `convert --format universal`, read as a source.

Proofs: our tree equals the one DeepSpeed's own ds_to_universal writes (same files, same keys,
same tensors) wherever that tool is right; on the round-robin fixture ours equals the engine's
truth and ds_to_universal's does not; ds_to_universal's output read by reshard gives the truth
back. The real engine resuming from these trees is in test_universal_engine.py.
"""
import json
import os

import pytest
import torch

import reshard
from make_hostile import Payload
from reshard.core.catalog import MASTER
from tests.helpers.cli import assert_one_line_error, run_cli
from tests.helpers.dcp_resume import assert_resumed_as_truth, resume_fixture_model
from tests.helpers.fixtures import FIXTURE_NAMES, fixture_dir, truth_json, truth_tensors
from tests.helpers.universal import differences, ds_to_universal, load_output, our_universal, tree_files

# Fixtures DeepSpeed's ds_to_universal converts correctly (one per optimizer wrapper / stage / dtype family).
DS_AGREES = ["z2_fp32_dp4", "z3_fp32_dp4", "bf16opt_z1_dp2", "z1_bf16_frozen_tied_dp2", "z2_fp16_dp2",
             "z3_fp32_frozen_tied_dp2"]
ROUND_ROBIN = "z2_fp32_roundrobin_dp4"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("universal")
    return {name: (ds_to_universal(name, root / f"{name}-ds"), our_universal(name, root / f"{name}-ours"))
            for name in DS_AGREES + [ROUND_ROBIN]}


@pytest.mark.parametrize("name", DS_AGREES)
def test_our_tree_equals_ds_to_universal(built, name):
    theirs, mine = built[name]
    assert tree_files(theirs) == tree_files(mine)
    assert (theirs / "latest_universal").read_text() == (mine / "latest_universal").read_text()
    diffs = []
    for rel in tree_files(theirs):
        if not rel.endswith(".pt"):
            continue
        a, b = load_output(theirs / rel), load_output(mine / rel)
        if rel.endswith("zero/optimizer_state.pt") and truth_json(name)["zero_stage"] == 3:
            # ds_to_universal copies rank 0's whole ZeRO-3 optimizer file (its fp32 and moment partitions
            # too); the loader reads the loss scaler, state[i]['step'] and the param groups. Those must agree.
            a = {k: a[k] for k in b if k != "optimizer_state_dict"} | {
                "state": {i: {"step": s["step"]} for i, s in a["optimizer_state_dict"]["state"].items()},
                "inner_groups": a["optimizer_state_dict"]["param_groups"]}
            b = {k: b[k] for k in b if k != "optimizer_state_dict"} | {
                "state": b["optimizer_state_dict"]["state"], "inner_groups": b["optimizer_state_dict"]["param_groups"]}
        diffs += differences(a, b, rel)
    expected = []
    if name == "z1_bf16_frozen_tied_dp2":
        # ds_to_universal writes a tied name from the bf16 module copy; ours is its holder's fp32 master
        expected = ["global_step3/zero/head.weight/fp32.pt.param: values differ"]
        master = load_output(mine / "global_step3/zero/emb.weight/fp32.pt")["param"]
        assert torch.equal(load_output(mine / "global_step3/zero/head.weight/fp32.pt")["param"], master)
    assert diffs == expected


def test_round_robin_ours_is_the_truth_ds_to_universal_is_not(built):
    theirs, mine = built[ROUND_ROBIN]
    truth = truth_tensors(ROUND_ROBIN)
    worst_theirs = 0.0
    for key, expected in truth.items():
        state, name = key.split("/", 1)
        if state == "module":
            continue
        rel = f"global_step3/zero/{name}/{state}.pt"
        assert torch.equal(load_output(mine / rel)["param"], expected), key
        worst_theirs = max(worst_theirs, (load_output(theirs / rel)["param"] - expected).abs().max().item())
    assert worst_theirs > 0.1     # DeepSpeed's defect B1: silently wrong by O(1)


def _assert_catalog_is_truth(catalog, name):
    truth = truth_tensors(name)
    for key, expected in truth.items():
        state, param = key.split("/", 1)
        if state == "module":
            continue
        got = reshard.full_tensor(catalog, param, MASTER if state == "fp32" else state)
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
    meta = truth_json(name)
    hyper = [{k: v for k, v in g.items() if k != "param_names"} for g in meta["param_groups"]]
    assert [g["params"] for g in catalog.param_groups] == [g["param_names"] for g in meta["param_groups"]]
    plain = [json.loads(json.dumps({k: v for k, v in g.items() if k != "params"})) for g in catalog.param_groups]
    # DeepSpeed's elastic files hold no hyper-parameters; the resuming engine keeps its configured ones
    assert plain == hyper or (meta["ds_config"]["zero_optimization"].get("elastic_checkpoint") and plain == [{}])
    assert catalog.contents().step == meta["step"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_our_universal_output_reads_back_as_the_truth(tmp_path, name):
    stage = 2 if name == "z2_fp32_sgd_dp2" else 3 if truth_json(name)["zero_stage"] != 3 else 1
    for to in ("", f"zero={stage},dp=3"):     # the source's flavour, and the other one at another dp
        out = our_universal(name, tmp_path / f"out{to}", to)
        catalog = reshard.open_checkpoint(out)
        assert catalog.format == "universal" and reshard.validate(catalog).ok, reshard.validate(catalog).problems
        _assert_catalog_is_truth(catalog, name)


@pytest.mark.parametrize("name", ["z2_fp32_dp4", "z3_fp32_dp4", "z1_bf16_frozen_tied_dp2"])
def test_ds_to_universal_output_is_read_as_the_truth(built, tmp_path, name):
    theirs = built[name][0]
    catalog = reshard.open_checkpoint(theirs)
    assert reshard.validate(catalog).ok, reshard.validate(catalog).problems
    _assert_catalog_is_truth(catalog, name)
    run_cli("inspect", theirs, check=0)
    run_cli("validate", theirs, check=0)
    # export: the fp32 masters, as safetensors
    run_cli("export", theirs, tmp_path / "model.safetensors", "--dtype", "fp32", check=0)
    from safetensors.torch import load_file
    exported, truth = load_file(str(tmp_path / "model.safetensors")), truth_tensors(name)
    for key, value in exported.items():
        if f"fp32/{key}" in truth:
            assert torch.equal(value, truth[f"fp32/{key}"]), key
    # and back to ZeRO files at another dp
    run_cli("convert", theirs, tmp_path / "zero", "--format", "deepspeed", "--to", "dp=3", check=0)
    _assert_catalog_is_truth(reshard.open_checkpoint(tmp_path / "zero"), name)


@pytest.mark.parametrize("name", ["z2_fp32_dp4", "z3_fp32_frozen_tied_dp2", "bf16opt_z1_dp2"])
def test_universal_trees_load_through_the_reader(built, name):
    """(issue #15) dcp.load through reshard.dcp_reader.Reader from DeepSpeed's ds_to_universal tree and from ours:
    the fixture model and optimizer resume with the engine's truth."""
    import reshard.dcp_reader
    for tree in built[name]:
        assert_resumed_as_truth(name, *resume_fixture_model(name, reshard.dcp_reader.Reader(tree)))


# ---------------------------------------------------------------------------------------------
# refusals and broken inputs: one line, exit 1, nothing executed


def test_refused_targets(tmp_path):
    assert_one_line_error(run_cli("convert", fixture_dir("z2_fp32_dp2"), tmp_path / "a", "--format", "universal",
                                  "--to", "zero=0"), "zero is 1, 2 or 3", code=2)     # a usage error (the spec's range)
    assert_one_line_error(run_cli("convert", fixture_dir("z2_fp32_sgd_dp2"), tmp_path / "b", "--format", "universal",
                                  "--to", "zero=3"), "momentum_buffer")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture
def universal_copy(tmp_path):
    return our_universal("z2_fp32_dp2", tmp_path / "uc")


def test_hostile_state_file_never_runs(universal_copy, tmp_path):
    canary = tmp_path / "canary"
    victim = universal_copy / "global_step3/zero/l1.weight/fp32.pt"
    torch.save({"param": Payload(os.system, f"touch {canary}")}, victim)
    for command in (["inspect", universal_copy], ["validate", universal_copy],
                    ["convert", universal_copy, tmp_path / "x", "--format", "deepspeed"]):
        assert_one_line_error(run_cli(*command), str(victim), "system (not on reshard's allow-list")
        assert not canary.exists()


def test_missing_state_file(universal_copy, tmp_path):
    victim = universal_copy / "global_step3/zero/l1.weight/exp_avg.pt"
    victim.unlink()
    proc = run_cli("validate", universal_copy)
    assert proc.returncode == 1 and "l1.weight" in proc.stdout + proc.stderr
    assert_one_line_error(run_cli("convert", universal_copy, tmp_path / "x", "--format", "deepspeed", "--to", "dp=3"),
                          "not complete")
    (universal_copy / "global_step3/zero/optimizer_state.pt").unlink()
    assert_one_line_error(run_cli("inspect", universal_copy), "optimizer_state.pt", "missing")


def test_shape_mismatch(universal_copy, tmp_path):
    victim = universal_copy / "global_step3/zero/l1.weight/fp32.pt"
    torch.save({"cat_dim": 0, "param": torch.zeros(3, 3)}, victim)
    assert_one_line_error(run_cli("convert", universal_copy, tmp_path / "x", "--format", "deepspeed"), "fp32.pt")
    assert not (tmp_path / "x").exists()
