"""verl's FSDP actor checkpoints (fixtures/verl/, saved by verl 0.9.1's own FSDPCheckpointManager at 2 CPU ranks:
tools/fixture_verl.py), as verl's own loader takes them, read and converted to other world sizes.

The fixtures: each holds ``global_step_3/`` with ``actor/`` (every rank's model, optimizer and extra-state file,
``huggingface/``, ``fsdp_config.json``) and ``data.pt``, and ``latest_checkpointed_iteration.txt`` saying 3; verl's
own ``FSDPCheckpointManager.load_checkpoint`` (tests/scripts/verl_load.py, one torchrun a world size running all of
its jobs) loads each at 2 ranks into a differently seeded actor, whose sharded model and optimizer state and lr
scheduler then equal the files as torch.load reads them, and one more training step runs; each converted to 1, 3 and
4 ranks, loaded there, holds bit for bit what the 2-rank load of the source holds. Negative controls: a copy with one
weight element changed is loaded and found naming that weight (in the source, and in a conversion); at 1 and at 4
ranks verl's loader refuses the unconverted fixture, naming the rank file it looks for.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

from reshard.storage.names import WATCH_STATE
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES
from tests.helpers.repo import SCRIPTS
from tests.helpers.torchrun import torchrun

ROOT = FIXTURES / "verl"
FSDP = {1: ROOT / "verl_fsdp1_dp2", 2: ROOT / "verl_fsdp2_dp2"}
CHANGED = "model.layers.1.mlp.down_proj.weight"     # the weight the negative control changes (rank 1's shard)
CONVERTED = (1, 3, 4)   # the world sizes each fixture is converted to and loaded at (3: uneven blocks, padded)


def _actor(run):
    return run / "global_step_3" / "actor"


@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_fixture_is_verl_own_layout(fsdp):
    run = FSDP[fsdp]
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (run / "global_step_3" / "data.pt").is_file()
    actor = _actor(run)
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": fsdp, "world_size": 2}
    for kind in ("model", "optim", "extra_state"):
        for rank in (0, 1):
            assert (actor / f"{kind}_world_size_2_rank_{rank}.pt").is_file()
    assert json.loads((actor / "huggingface" / "config.json").read_text())["model_type"] == "qwen2"
    assert (actor / "huggingface" / "tokenizer.json").is_file()


def _change_weight(actor, key, world=2):
    """One element of `key`'s shard in rank 1's model file changed (torch.load/torch.save, no reshard)."""
    import torch
    path = actor / f"model_world_size_{world}_rank_1.pt"
    state = torch.load(path, weights_only=False)
    state[key].to_local().view(-1)[0] += 1.0
    torch.save(state, path)


def _job(label, actor, fsdp, out=None, truth=None, optim=False):
    job = {"label": label, "folder": str(actor), "fsdp": fsdp, "truth": str(truth) if truth else None}
    if out is not None:
        job["full"] = str(out / f"{label}.safetensors")
        if optim:
            job["full_optim"] = str(out / f"{label}-optim.safetensors")
    return job


def _launches(out):
    """{world: its jobs}, one launch each: each fixture at 2 ranks (and a changed copy of the FSDP2 one), at 1 and at
    4 (refused), and each converted to 1, 3 and 4 ranks, loaded there (and a changed copy of FSDP2's 4)."""
    for fsdp, run in FSDP.items():
        for world in CONVERTED:
            run_cli("convert", run / "global_step_3", _converted(out, fsdp, world), "--to", f"dp={world}", check=0)
    changed = out / "changed" / "global_step_3" / "actor"
    shutil.copytree(_actor(FSDP[2]), changed)
    _change_weight(changed, CHANGED)
    changed4 = out / "changed4" / "actor"
    shutil.copytree(_converted(out, 2, 4) / "actor", changed4)
    _change_weight(changed4, CHANGED, world=4)
    launches = {2: [_job(f"fsdp{f}", _actor(r), f, out, truth=_actor(r), optim=True) for f, r in FSDP.items()],
                1: [_job(f"fsdp{f} at 1", _actor(r), f) for f, r in FSDP.items()],
                3: [], 4: [_job("fsdp2 at 4", _actor(FSDP[2]), 2)]}
    launches[2].append(_job("changed", changed, 2, truth=_actor(FSDP[2])))
    for fsdp in FSDP:
        for world in CONVERTED:
            actor = _converted(out, fsdp, world) / "actor"
            launches[world].append(_job(f"fsdp{fsdp} dp{world}", actor, fsdp, out, truth=actor, optim=True))
    launches[4].append(_job("changed at 4", changed4, 2, out))
    return launches


def _converted(out, fsdp, world):
    return out / f"fsdp{fsdp}-dp{world}" / "global_step_3"


@pytest.fixture(scope="session")
def loaded(tmp_path_factory):
    """verl's loader in fresh interpreters, one torchrun a world size running all of its jobs (torchrun itself, not
    ranks forked from the suite's preloading server, where Lightning's import leaves FSDP2 unable to wrap
    transformers' nn.Embedding: "object layout differs")."""
    out = tmp_path_factory.mktemp("verl")
    results = {}
    for world, jobs in _launches(out).items():
        jobs_path, results_path = out / f"jobs-{world}.json", out / f"results-{world}.json"
        jobs_path.write_text(json.dumps(jobs))
        torchrun(world, SCRIPTS / "verl_load.py", jobs_path, results_path, deepspeed=False, forked=False)
        results.update({r["label"]: {**r, "full": job.get("full"), "full_optim": job.get("full_optim")}
                        for r, job in zip(json.loads(results_path.read_text()), jobs, strict=True)})
    return results


@pytest.mark.engine
@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_verl_loads_the_fixture_at_2_ranks_as_saved_and_trains_on(loaded, fsdp):
    result = loaded[f"fsdp{fsdp}"]
    assert result["loaded"] and result["error"] is None, result
    assert result["problems"] == [], result      # weights, both Adam moments, steps, lr scheduler
    assert result["last_epoch"] == 3
    assert math.isfinite(result["loss"]) and result["step_after"] == [4.0], result


@pytest.mark.engine
def test_a_changed_weight_is_found_in_what_verl_loaded(loaded):
    result = loaded["changed"]
    assert result["loaded"] and result["problems"] == [f"model.{CHANGED}: differs from the truth"], result


@pytest.mark.engine
@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_verl_refuses_the_fixture_at_1_rank(loaded, fsdp):
    result = loaded[f"fsdp{fsdp} at 1"]
    assert not result["loaded"] and "model_world_size_1_rank_0.pt" in result["error"], result


# Convert: verl's FSDP2 checkpoint at another world size, loaded there by verl's own FSDPCheckpointManager

def _differing(a_path, b_path):
    """{key: elements that differ} of two safetensors files with the same keys."""
    import torch
    from safetensors.torch import load_file
    a, b = load_file(a_path), load_file(b_path)
    assert set(a) == set(b)
    return {k: int((a[k] != b[k]).sum()) for k in a if not torch.equal(a[k], b[k])}


@pytest.mark.engine
@pytest.mark.parametrize("fsdp", sorted(FSDP))
@pytest.mark.parametrize("world", sorted(CONVERTED))
def test_verl_loads_the_conversion_at_its_world_size_bit_equal_and_trains_on(loaded, fsdp, world):
    result, source = loaded[f"fsdp{fsdp} dp{world}"], loaded[f"fsdp{fsdp}"]
    assert result["loaded"] and result["error"] is None and result["problems"] == [], result
    # what verl loaded at `world` ranks is what it loaded at 2 from the source: weights, moments, steps, scheduler
    assert _differing(result["full"], source["full"]) == {}
    assert _differing(result["full_optim"], source["full_optim"]) == {}
    assert result["scheduler"] == source["scheduler"] and result["last_epoch"] == 3, result
    assert math.isfinite(result["loss"]) and result["step_after"] == [4.0], result


@pytest.mark.engine
def test_a_changed_element_of_the_conversion_is_found_in_what_verl_loaded(loaded):
    result = loaded["changed at 4"]
    assert result["loaded"], result
    assert _differing(result["full"], loaded["fsdp2"]["full"]) == {CHANGED: 1}


@pytest.mark.engine
def test_verl_refuses_the_unconverted_fixture_at_4_ranks(loaded):
    result = loaded["fsdp2 at 4"]
    assert not result["loaded"] and "model_world_size_4_rank_0.pt" in result["error"], result


def test_convert_writes_verl_files_and_carries_the_step(tmp_path):
    import torch
    dst = tmp_path / "dp3" / "global_step_3"
    out = run_cli("convert", FSDP[2] / "global_step_3", dst, "--to", "dp=3", check=0).stdout
    assert "(verl dp=3)" in out, out
    actor, source = dst / "actor", _actor(FSDP[2])
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 3}
    assert sorted(p.name for p in actor.glob("*_rank_*.pt")) == sorted(
        f"{kind}_world_size_3_rank_{rank}.pt" for kind in ("model", "optim", "extra_state") for rank in range(3))
    for path in [dst / "data.pt", *(actor / "huggingface").iterdir()]:     # carried as they are
        assert path.read_bytes() == (FSDP[2] / "global_step_3" / path.relative_to(dst)).read_bytes()
    # a rank the source had keeps its RNG states; a new one gets the scheduler alone (verl keeps its seed's streams)
    assert (actor / "extra_state_world_size_3_rank_1.pt").read_bytes() == \
        (source / "extra_state_world_size_2_rank_1.pt").read_bytes()
    new = torch.load(actor / "extra_state_world_size_3_rank_2.pt", weights_only=False)
    assert new == {"lr_scheduler": torch.load(source / "extra_state_world_size_2_rank_0.pt",
                                              weights_only=False)["lr_scheduler"]}
    # uneven blocks (16 rows over 3 ranks: 6, 6, 4) as torch.chunk cuts them, Shard(0) over a mesh of 3
    model = torch.load(actor / "model_world_size_3_rank_2.pt", weights_only=False)
    weight = model["model.norm.weight"]
    assert weight.shape == (16,) and weight.to_local().shape == (4,) and weight.device_mesh.size() == 3
    assert run_cli("validate", "--deep", dst, check=0).stdout.startswith("complete;")
    # negative control: the source, read the same way, is a mesh of 2
    assert torch.load(source / "model_world_size_2_rank_1.pt", weights_only=False)[
        "model.norm.weight"].device_mesh.size() == 2


def test_fsdp1_flat_parameters_are_told_from_their_sizes_or_refused(tmp_path):
    """FSDP1's optimizer keys flat parameters: which parameters each holds is read from the sizes (the root's
    embeddings, norm and head; one per layer). Negative control: a model whose order the sizes do not cut one way
    (the flat parameters' blocks changed to sizes no run of parameters has) is refused in one line."""
    from reshard.formats.verl.flat_params import cuts
    data = json.loads(run_cli("inspect", FSDP[1] / "global_step_3", "--json", check=0).stdout)
    assert (data["optimizer"], data["step"], data["trainable"]) == ("AdamW", 3, 27), data
    params = [("embed", 384), ("a0", 256), ("b0", 256), ("a1", 256), ("b1", 256), ("norm", 16), ("head", 384)]
    [cut] = cuts(params, [392, 256, 256], 2)
    assert [u.names for u in cut] == [("embed", "norm", "head"), ("a0", "b0"), ("a1", "b1")]
    assert cuts(params, [392, 300, 256], 2) == []      # no run of 599 or 600 elements where the layers begin
    # not one way: an embedding as large as a layer could be the first nested unit, the root the layer after it
    tied = [("embed", 512), *params[1:-1], ("head", 512)]
    assert len(cuts(tied, [520, 256, 256], 2)) == 2
    broken = tmp_path / "broken" / "global_step_3"
    shutil.copytree(FSDP[1] / "global_step_3", broken)
    import torch
    for rank in (0, 1):
        path = broken / "actor" / f"optim_world_size_2_rank_{rank}.pt"
        state = torch.load(path, weights_only=False)
        state["state"][1]["exp_avg"] = state["state"][1]["exp_avg"][:-1].clone()
        torch.save(state, path)
    proc = run_cli("convert", broken, tmp_path / "out", "--to", "dp=4")
    assert proc.returncode == 1 and "FSDP1's flat parameters" in proc.stderr, proc
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


# Reading: inspect, validate, diff, export (reshard.formats.verl)

@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_inspect_names_verl_its_world_size_step_and_optimizer(fsdp):
    out = run_cli("inspect", FSDP[fsdp] / "global_step_3", check=0).stdout
    assert "format        verl (tag global_step_3)" in out and "world size 2" in out, out
    assert "(global_steps 3," in out, out      # the step folder's number
    data = json.loads(run_cli("inspect", _actor(FSDP[fsdp]), "--json", check=0).stdout)
    assert data["format"] == "verl" and data["topology"]["dp"] == 2
    if fsdp == 2:       # FSDP2's optimizer read with the weights
        assert "optimizer     AdamW: states exp_avg, exp_avg_sq" in out and "27 trainable, 0 frozen" in out, out
        assert "step          3 (global_steps 3" in out, out


def test_a_run_dir_is_read_as_the_step_its_tracker_names(tmp_path):
    data = json.loads(run_cli("inspect", FSDP[2], "--json", check=0).stdout)
    assert (data["format"], data["tag"], data["path"]) == ("verl", "global_step_3", str(FSDP[2] / "global_step_3"))
    # negative control: a tracker naming a step the run does not hold is no verl run dir (nor Megatron-LM's)
    run = tmp_path / "run"
    shutil.copytree(FSDP[2], run)
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    proc = run_cli("inspect", run)
    assert proc.returncode == 1 and "iter_0000004: missing" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_validate_deep_finds_the_fixture_complete(fsdp):
    out = run_cli("validate", "--deep", FSDP[fsdp] / "global_step_3", check=0).stdout
    assert out.startswith("complete;"), out


def test_a_missing_or_truncated_rank_file_is_named(tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(FSDP[2] / "global_step_3", missing)
    (missing / "actor" / "model_world_size_2_rank_1.pt").unlink()
    proc = run_cli("validate", missing)
    assert proc.returncode != 0 and "model_world_size_2_rank_1.pt" in proc.stderr + proc.stdout, proc
    truncated = tmp_path / "truncated"
    shutil.copytree(FSDP[2] / "global_step_3", truncated)
    rank1 = truncated / "actor" / "optim_world_size_2_rank_1.pt"
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    proc = run_cli("validate", "--deep", truncated)
    assert proc.returncode != 0 and "optim_world_size_2_rank_1.pt" in proc.stderr + proc.stdout, proc


def test_diff_finds_a_changed_weight_and_nothing_else(tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(FSDP[2] / "global_step_3", changed)
    _change_weight(changed / "actor", CHANGED)
    out = run_cli("diff", FSDP[2] / "global_step_3", changed, check=1).stdout
    assert CHANGED in out, out
    assert run_cli("diff", FSDP[2] / "global_step_3", FSDP[2] / "global_step_3", check=0).returncode == 0


@pytest.mark.engine
@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_export_is_loaded_by_from_pretrained_with_the_weights_verl_loaded(loaded, fsdp, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run_cli("export", FSDP[fsdp] / "global_step_3", tmp_path / "hf", check=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids(["t1", "t2"]) == [1, 2]
    hf = _actor(FSDP[fsdp]) / "huggingface"
    assert all((tmp_path / "hf" / f.name).read_bytes() == f.read_bytes() for f in hf.iterdir())
    live = load_file(loaded[f"fsdp{fsdp}"]["full"])
    exported = model.state_dict()
    assert set(live) == set(exported)
    assert all(torch.equal(live[k], exported[k]) for k in live)
    assert next(model.parameters()).dtype == torch.float32     # the training dtype
    # negative control: an export of a copy with one weight element changed differs there, and only there
    changed = tmp_path / "run" / "global_step_3"
    shutil.copytree(FSDP[fsdp] / "global_step_3", changed)
    _change_weight(changed / "actor", CHANGED)
    run_cli("export", changed, tmp_path / "hf-changed", check=0)
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-changed").state_dict()
    assert [k for k in live if not torch.equal(live[k], other[k])] == [CHANGED]


# Runs: list and prune see global_step_N/ as one checkpoint, its roles, data.pt and huggingface/ inside it

def _run(tmp_path, steps=(1, 2, 3), tracker="2"):
    import os
    run = tmp_path / "run"
    for step in steps:
        shutil.copytree(FSDP[2] / "global_step_3", run / f"global_step_{step}")
        shutil.copytree(_actor(FSDP[2]), run / f"global_step_{step}" / "critic")     # a second role
    (run / "latest_checkpointed_iteration.txt").write_text(tracker)
    for path in run.rglob("*"):      # saved a while ago: no save in progress
        os.utime(path, (1e9, 1e9))
    return run


def test_list_sees_each_step_folder_as_one_checkpoint(tmp_path):
    run = _run(tmp_path)
    data = json.loads(run_cli("list", run, "--json", check=0).stdout)
    rows = data["checkpoints"] if isinstance(data, dict) else data
    assert sorted(r["name"] for r in rows) == ["global_step_1", "global_step_2", "global_step_3"], rows


def test_prune_deletes_whole_step_folders_and_keeps_the_one_the_tracker_names(tmp_path):
    run = _run(tmp_path)
    out = run_cli("prune", run, "--keep-last", "1", "--recent", "0", "--settle", "0", "--yes", check=0).stdout
    assert sorted(p.name for p in run.iterdir()) == ["global_step_2", "global_step_3",
                                                     "latest_checkpointed_iteration.txt"], out
    for step in (2, 3):     # every role of a kept step whole
        kept = run / f"global_step_{step}"
        assert sorted(p.name for p in kept.iterdir()) == ["actor", "critic", "data.pt"]
        assert run_cli("validate", kept, check=0).returncode == 0
    # negative control: the tracker naming the newest, step 2 is not kept
    again = _run(tmp_path / "again", tracker="3")
    run_cli("prune", again, "--keep-last", "1", "--recent", "0", "--settle", "0", "--yes", check=0)
    assert sorted(p.name for p in again.iterdir()) == ["global_step_3", "latest_checkpointed_iteration.txt"]


def test_watch_validates_each_new_step_as_it_lands_and_applies_the_policy(tmp_path):
    """A verl run watched while it saves: each global_step_N/ is validated once the tracker names it (a newer one is
    a save in progress until then), reported in one line, and --keep-last 1 deletes the older steps whole; a step
    that lands broken is reported INCOMPLETE naming its missing rank file, and the complete one before it is kept."""
    from tests.helpers import lifecycle_runs as lr

    def entries():
        return sorted(p.name for p in run.iterdir() if p.name != WATCH_STATE)
    run = _run(tmp_path, steps=(1, 2), tracker="2")
    args = ("watch", run, "--once", "--keep-last", "1", "--settle", "0")
    proc = run_cli(*args, check=0)
    assert [line.split(",")[0] for line in proc.stdout.splitlines() if line.startswith("step ")] == \
        ["step 1: complete", "step 2: complete"], proc.stdout
    assert entries() == ["global_step_2", "latest_checkpointed_iteration.txt"]
    # step 3 lands: in progress while the tracker still names 2, then validated and the policy applied
    shutil.copytree(FSDP[2] / "global_step_3", run / "global_step_3")
    lr.age(run / "global_step_3")
    proc = run_cli(*args, check=0)
    assert "step 3: in progress" in proc.stdout and (run / "global_step_2").is_dir(), proc.stdout
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    lr.age(run / "latest_checkpointed_iteration.txt")
    proc = run_cli(*args, check=0)
    assert "step 3: complete" in proc.stdout, proc.stdout
    assert entries() == ["global_step_3", "latest_checkpointed_iteration.txt"]
    assert sorted(p.name for p in (run / "global_step_3").iterdir()) == ["actor", "data.pt"]
    # negative control: step 4 lands without rank 1's model file; it is flagged, and step 3 is not deleted for it
    shutil.copytree(FSDP[2] / "global_step_3", run / "global_step_4")
    (run / "global_step_4" / "actor" / "model_world_size_2_rank_1.pt").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    lr.age(run)
    proc = run_cli(*args, check=1)
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("step 4:")]
    assert "INCOMPLETE" in line and "model_world_size_2_rank_1.pt" in line, proc.stdout
    assert entries() == ["global_step_3", "global_step_4", "latest_checkpointed_iteration.txt"]


def test_a_step_with_a_critic_is_converted_role_by_role(tmp_path):
    """A step folder holding actor/ and critic/ (the critic's files as verl's manager writes every role's: here the
    actor's, copied) is refused in one line naming critic/, nothing written; each role folder converts on its own, and
    reads back as its source does (diff: no difference)."""
    step = tmp_path / "run" / "global_step_3"
    shutil.copytree(FSDP[2] / "global_step_3", step)
    shutil.copytree(step / "actor", step / "critic")
    proc = run_cli("convert", step, tmp_path / "out", "--to", "dp=4")
    assert proc.returncode == 1 and "critic" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc
    assert not (tmp_path / "out").exists()
    for role in ("actor", "critic"):
        run_cli("convert", step / role, tmp_path / "dp4" / role, "--to", "dp=4", check=0)
        assert run_cli("diff", step / role, tmp_path / "dp4" / role, check=0).returncode == 0
    assert (tmp_path / "dp4" / "critic" / "optim_world_size_4_rank_3.pt").is_file()


def _torch_differences(a_dir, b_dir, world):
    """The entries of each rank's model and optimizer files that differ between two role folders (torch.load)."""
    import torch
    out = []
    for kind in ("model", "optim"):
        for rank in range(world):
            name = f"{kind}_world_size_{world}_rank_{rank}.pt"
            a, b = (torch.load(d / name, weights_only=False) for d in (a_dir, b_dir))
            flat_a, flat_b = _leaves(a), _leaves(b)
            assert set(flat_a) == set(flat_b), name
            out += [f"{name}:{k}" for k in flat_a if not _same(flat_a[k], flat_b[k])]
    return out


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    if isinstance(tree, list | tuple) and not all(isinstance(v, int | float | bool) for v in tree):
        return {k: v for i, value in enumerate(tree) for k, v in _leaves(value, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def _same(a, b):
    import torch
    if not torch.is_tensor(a):
        return a == b
    if type(a) is not type(b) or getattr(a, "placements", None) != getattr(b, "placements", None):
        return False
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_one_rank_and_back_gives_verl_own_files(tmp_path, fsdp):
    """To 1 rank (FSDP1's NO_SHARD: plain tensors, whole flat parameters) and back to 2: every rank's model and
    optimizer file holds what verl saved, DTensors with their placements, as torch.load reads them. Negative control:
    one element changed in the 1-rank files shows in the 2-rank files, in that entry alone."""
    import torch
    one, back = tmp_path / "one" / "global_step_3", tmp_path / "back" / "global_step_3"
    run_cli("convert", FSDP[fsdp] / "global_step_3", one, "--to", "dp=1", check=0)
    whole = torch.load(one / "actor" / "model_world_size_1_rank_0.pt", weights_only=False)[CHANGED]
    assert hasattr(whole, "placements") == (fsdp == 2), type(whole)     # FSDP1 at one rank: a plain tensor
    run_cli("convert", one, back, "--to", "dp=2", check=0)
    assert _torch_differences(_actor(FSDP[fsdp]), back / "actor", 2) == []
    path = one / "actor" / "model_world_size_1_rank_0.pt"
    state = torch.load(path, weights_only=False)
    value = state[CHANGED].to_local() if fsdp == 2 else state[CHANGED]
    value.view(-1)[-1] += 1.0
    torch.save(state, path)
    (one / "reshard-manifest.json").unlink()        # the files changed under it
    run_cli("convert", one, tmp_path / "changed" / "global_step_3", "--to", "dp=2", check=0)
    assert _torch_differences(_actor(FSDP[fsdp]), tmp_path / "changed" / "global_step_3" / "actor", 2) == \
        [f"model_world_size_2_rank_1.pt:{CHANGED}"]
