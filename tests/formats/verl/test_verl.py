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


def _critic(run):
    return run / "global_step_3" / "critic"


@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_fixture_is_verl_own_layout(fsdp):
    run = FSDP[fsdp]
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(p.name for p in (run / "global_step_3").iterdir()) == ["actor", "critic", "data.pt"]
    for role in (_actor(run), _critic(run)):
        assert json.loads((role / "fsdp_config.json").read_text()) == {"FSDP_version": fsdp, "world_size": 2}
        for kind in ("model", "optim", "extra_state"):
            for rank in (0, 1):
                assert (role / f"{kind}_world_size_2_rank_{rank}.pt").is_file()
        assert json.loads((role / "huggingface" / "config.json").read_text())["model_type"] == "qwen2"
        assert (role / "huggingface" / "tokenizer.json").is_file()
    # the critic is verl's value model: one label, a value head (score) where the actor has its language head
    assert json.loads((_critic(run) / "huggingface" / "config.json").read_text())["id2label"] == {"0": "LABEL_0"}
    import torch
    critic = torch.load(_critic(run) / "model_world_size_2_rank_0.pt", weights_only=False)
    assert critic["score.weight"].shape == (1, 16) and "lm_head.weight" not in critic


def _change_weight(actor, key, world=2):
    """One element of `key`'s shard in rank 1's model file changed (torch.load/torch.save, no reshard)."""
    import torch
    path = actor / f"model_world_size_{world}_rank_1.pt"
    state = torch.load(path, weights_only=False)
    state[key].to_local().view(-1)[0] += 1.0
    torch.save(state, path)


def _job(label, folder, fsdp, out=None, truth=None, optim=False, role="actor", **more):
    job = {"label": label, "folder": str(folder) if folder else None, "fsdp": fsdp,
           "truth": str(truth) if truth else None, "role": role, **{k: str(v) for k, v in more.items()}}
    if out is not None:
        job["full"] = str(out / f"{label}.safetensors")
        if optim:
            job["full_optim"] = str(out / f"{label}-optim.safetensors")
    return job


def _launches(out):
    """{world: its jobs}, one launch each: each fixture's actor and critic at 2 ranks (and a changed copy of the FSDP2
    actor), at 1 and at 4 (refused), and each step (both roles in one command) converted to 1, 3 and 4 ranks, loaded
    there (and a changed copy of FSDP2's 4, of either role); FSDP1's run folder converted to 3 ranks with
    --new-rank-state copy-rank0, each role found by verl's own find_latest_ckpt_path (and a step folder's output,
    which holds no tracker, not found)."""
    for fsdp, run in FSDP.items():
        for world in CONVERTED:
            run_cli("convert", run / "global_step_3", _converted(out, fsdp, world), "--to", f"dp={world}", check=0)
    run_cli("convert", FSDP[1], out / "run-dp3", "--to", "dp=3", "--new-rank-state", "copy-rank0", check=0)
    changed = out / "changed" / "global_step_3" / "actor"
    shutil.copytree(_actor(FSDP[2]), changed)
    _change_weight(changed, CHANGED)
    changed4 = {}
    for role in ("actor", "critic"):
        changed4[role] = out / "changed4" / role
        shutil.copytree(_converted(out, 2, 4) / role, changed4[role])
        _change_weight(changed4[role], CHANGED, world=4)
    launches = {2: [_job(f"fsdp{f}", _actor(r), f, out, truth=_actor(r), optim=True) for f, r in FSDP.items()],
                1: [_job(f"fsdp{f} at 1", _actor(r), f) for f, r in FSDP.items()],
                3: [], 4: [_job("fsdp2 at 4", _actor(FSDP[2]), 2), _job("critic at 4", _critic(FSDP[2]), 2,
                                                                         role="critic")]}
    launches[2] += [_job(f"fsdp{f} critic", _critic(r), f, out, truth=_critic(r), optim=True, role="critic")
                    for f, r in FSDP.items()]
    launches[2].append(_job("changed", changed, 2, truth=_actor(FSDP[2])))
    for fsdp in FSDP:
        for world in CONVERTED:
            step = _converted(out, fsdp, world)
            launches[world].append(_job(f"fsdp{fsdp} dp{world}", step / "actor", fsdp, out, truth=step / "actor",
                                        optim=True, rng_of=_actor(FSDP[fsdp]) / "extra_state_world_size_2_rank_0.pt"))
            launches[world].append(_job(f"fsdp{fsdp} critic dp{world}", step / "critic", fsdp, out,
                                        truth=step / "critic", optim=True, role="critic"))
    launches[4] += [_job(f"{role} changed at 4", folder, 2, out, role=role) for role, folder in changed4.items()]
    launches[4].append(_job("step output as a run", None, 2, run=_converted(out, 2, 4).parent))
    for role in ("actor", "critic"):
        launches[3].append(_job(f"run {role} dp3", None, 1, out, optim=True, role=role, run=out / "run-dp3",
                                rng_of=FSDP[1] / "global_step_3" / role / "extra_state_world_size_2_rank_0.pt"))
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
@pytest.mark.parametrize("role", ["", " critic"])
def test_verl_loads_each_converted_role_at_its_world_size_bit_equal_and_trains_on(loaded, fsdp, world, role):
    """The step converted in one command: what verl's manager loads of its actor (and of its critic) at `world`
    ranks is what it loads at 2 of the source's (weights, both Adam moments, steps, scheduler)."""
    result, source = loaded[f"fsdp{fsdp}{role} dp{world}"], loaded[f"fsdp{fsdp}{role}"]
    assert result["loaded"] and result["error"] is None and result["problems"] == [], result
    assert _differing(result["full"], source["full"]) == {}
    assert _differing(result["full_optim"], source["full_optim"]) == {}
    assert result["scheduler"] == source["scheduler"] and result["last_epoch"] == 3, result
    assert math.isfinite(result["loss"]) and result["step_after"] == [4.0], result


@pytest.mark.engine
def test_verl_refuses_the_unconverted_fixture_at_4_ranks(loaded):
    for label in ("fsdp2 at 4", "critic at 4"):     # the actor's and the critic's files alike
        result = loaded[label]
        assert not result["loaded"] and "model_world_size_4_rank_0.pt" in result["error"], result
        assert "critic" in result["error"] if label.startswith("critic") else "actor" in result["error"]


# A step's critic: converted with its actor in one command, loaded by verl's own manager into the critic verl builds

@pytest.mark.engine
@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_verl_loads_the_critic_at_2_ranks_as_saved_and_trains_on(loaded, fsdp):
    result = loaded[f"fsdp{fsdp} critic"]
    assert result["loaded"] and result["error"] is None and result["problems"] == [], result
    assert result["last_epoch"] == 3 and math.isfinite(result["loss"]) and result["step_after"] == [4.0], result
    # the value head where the actor has its language head; negative control: the actor's weights, loaded the same
    # way, are not the critic's
    import torch
    from safetensors.torch import load_file
    critic, actor = load_file(result["full"]), load_file(loaded[f"fsdp{fsdp}"]["full"])
    assert critic["score.weight"].shape == (1, 16) and "lm_head.weight" not in critic
    assert not torch.equal(critic[CHANGED], actor[CHANGED])


@pytest.mark.engine
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_changed_element_of_either_converted_role_is_found_in_what_verl_loaded(loaded, role):
    result = loaded[f"{role} changed at 4"]
    assert result["loaded"], result
    assert _differing(result["full"], loaded["fsdp2" + (" critic" if role == "critic" else "")]["full"]) == \
        {CHANGED: 1}


# A run folder: converted into a run folder whose tracker verl's own find_latest_ckpt_path follows

@pytest.mark.engine
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_verl_resumes_a_converted_run_from_its_tracker_with_rank_0s_rng_on_new_ranks(loaded, role):
    """FSDP1's run folder converted to 3 ranks with --new-rank-state copy-rank0: verl's find_latest_ckpt_path finds
    global_step_3 from the tracker written beside it, its manager loads each role there bit for bit as at 2 ranks from
    the source, and the new rank 2's torch RNG state after the load is rank 0's saved one.
    Negative controls: the fresh conversion's new ranks keep their own seeded streams; a step folder's output (no
    tracker) is no run verl resumes."""
    result = loaded[f"run {role} dp3"]
    source = loaded["fsdp1" + (" critic" if role == "critic" else "")]
    assert result["found"].endswith("run-dp3/global_step_3"), result
    assert result["loaded"] and result["error"] is None, result
    assert _differing(result["full"], source["full"]) == {} and _differing(result["full_optim"],
                                                                           source["full_optim"]) == {}
    assert result["step_after"] == [4.0], result
    # (the fixture's ranks were seeded alike, so rank 1's own saved state is rank 0's too)
    assert result["rng_equal"] == [True, True, True], result
    assert loaded["fsdp1 dp3"]["rng_equal"] == [True, True, False]      # fresh: rank 2 its own seeded stream
    assert loaded["fsdp2 dp4"]["rng_equal"] == [True, True, False, False]
    missing = loaded["step output as a run"]
    assert not missing["loaded"] and missing["found"] is None, missing


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
    # the critic beside it in the same command, at 3 ranks too; data.pt once, one manifest for the step
    assert sorted(p.name for p in dst.iterdir()) == ["actor", "critic", "data.pt", "reshard-manifest.json"]
    assert sorted(p.name for p in (dst / "critic").glob("*_rank_*.pt")) == sorted(
        f"{kind}_world_size_3_rank_{rank}.pt" for kind in ("model", "optim", "extra_state") for rank in range(3))
    assert json.loads((dst / "critic" / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 3}
    assert torch.load(dst / "critic" / "model_world_size_3_rank_0.pt", weights_only=False)[
        "score.weight"].device_mesh.size() == 3
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


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_a_missing_or_truncated_critic_rank_file_is_named(tmp_path, kind):
    """The step is whole only with its critic: validate (and --deep) of the step names the critic's file."""
    missing = tmp_path / "missing"
    shutil.copytree(FSDP[2] / "global_step_3", missing)
    (missing / "critic" / f"{kind}_world_size_2_rank_1.pt").unlink()
    proc = run_cli("validate", missing)
    assert proc.returncode != 0 and f"critic/{kind}_world_size_2_rank_1.pt" in proc.stderr + proc.stdout, proc
    truncated = tmp_path / "truncated"
    shutil.copytree(FSDP[2] / "global_step_3", truncated)
    rank1 = truncated / "critic" / f"{kind}_world_size_2_rank_1.pt"
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    proc = run_cli("validate", "--deep", truncated)
    assert proc.returncode != 0 and f"critic/{kind}_world_size_2_rank_1.pt" in proc.stderr + proc.stdout, proc
    # negative control: the same copy whole is complete
    assert run_cli("validate", "--deep", FSDP[2] / "global_step_3", check=0).stdout.startswith("complete;")


def test_a_run_folder_converts_to_a_run_folder_with_its_tracker_written_last(tmp_path):
    """RUN (the tracker beside global_step_*/) converts the step the tracker names into DST/global_step_3/ and
    writes DST/latest_checkpointed_iteration.txt, listed last (the executor writes text files after the rest, in
    order); a newer step the tracker does not name is not converted. Negative controls: a run without its tracker,
    and a tracker naming a step that is not there, are refused in one line with nothing written."""
    run = tmp_path / "run"
    shutil.copytree(FSDP[2], run)
    shutil.copytree(run / "global_step_3", run / "global_step_4")     # a save in progress: the tracker says 3
    dst = tmp_path / "dp4"
    written = json.loads(run_cli("convert", run, dst, "--to", "dp=4", "--json", check=0).stdout)
    assert sorted(p.name for p in dst.iterdir()) == ["global_step_3", "latest_checkpointed_iteration.txt",
                                                     "reshard-manifest.json"]
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert written["files"][-1]["path"] == str(dst / "latest_checkpointed_iteration.txt"), written["files"][-3:]
    assert sorted(p.name for p in (dst / "global_step_3").iterdir()) == ["actor", "critic", "data.pt"]
    assert run_cli("diff", FSDP[2] / "global_step_3", dst / "global_step_3", check=0).returncode == 0
    assert run_cli("validate", dst, check=0).stdout.startswith("complete;")
    # a step folder as the source keeps writing DST as the step: no tracker
    run_cli("convert", run / "global_step_3", tmp_path / "step", "--to", "dp=4", check=0)
    assert not (tmp_path / "step" / "latest_checkpointed_iteration.txt").exists()
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    proc = run_cli("convert", run, tmp_path / "five", "--to", "dp=4")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc
    assert "global_step_5" in proc.stderr and "names step 5" in proc.stderr, proc.stderr
    (run / "latest_checkpointed_iteration.txt").unlink()
    proc = run_cli("convert", run, tmp_path / "none", "--to", "dp=4")
    assert proc.returncode != 0 and len(proc.stderr.splitlines()) == 1 and "run directory" in proc.stderr, proc
    assert not (tmp_path / "five").exists() and not (tmp_path / "none").exists()


def test_new_rank_state_is_honoured_for_the_extra_state_and_said_by_plan(tmp_path):
    """fresh (the default): a new rank's extra state is the lr scheduler alone; copy-rank0: rank 0's file, byte for
    byte, in each role; fail: refused in one line naming the rank, nothing written; plan says which."""
    import torch
    step = FSDP[2] / "global_step_3"
    for policy in ("fresh", "copy-rank0"):
        dst = tmp_path / policy
        out = run_cli("convert", step, dst, "--to", "dp=3", "--new-rank-state", policy, check=0).stdout
        for role in ("actor", "critic"):
            new = dst / role / "extra_state_world_size_3_rank_2.pt"
            rank0 = step / role / "extra_state_world_size_2_rank_0.pt"
            if policy == "copy-rank0":
                assert new.read_bytes() == rank0.read_bytes()
                assert f"{role}/extra_state_world_size_3_rank_2.pt copied from rank 0" in out, out
            else:
                assert set(torch.load(new, weights_only=False)) == {"lr_scheduler"}
                assert f"{role}/extra_state_world_size_3_rank_2.pt written fresh" in out, out
    plan = run_cli("plan", step, "--to", "dp=3", "--new-rank-state", "copy-rank0", check=0).stdout
    assert "per-rank --new-rank-state copy-rank0: new ranks get a copy of rank 0's" in plan, plan
    data = json.loads(run_cli("plan", step, "--to", "dp=3", "--json", check=0).stdout)
    assert data["framework"]["new_rank_state"] == "fresh" and "without RNG states" in data["framework"]["policy"]
    proc = run_cli("convert", step, tmp_path / "fail", "--to", "dp=3", "--new-rank-state", "fail")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and "rank 2 of 3" in proc.stderr, proc
    assert not (tmp_path / "fail").exists()
    # negative control: no new rank, nothing to refuse
    run_cli("convert", step, tmp_path / "same", "--to", "dp=2", "--new-rank-state", "fail", check=0)


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
        shutil.copytree(FSDP[2] / "global_step_3", run / f"global_step_{step}")     # actor/ and critic/
    (run / "latest_checkpointed_iteration.txt").write_text(tracker)
    for path in run.rglob("*"):      # saved a while ago: no save in progress
        os.utime(path, (1e9, 1e9))
    return run


def test_list_sees_each_step_folder_as_one_checkpoint(tmp_path):
    """Each step is one row whose bytes are both roles' and data.pt's, weights and optimizer those of actor and
    critic together; a step missing a critic rank file is INCOMPLETE, naming it."""
    from tests.helpers import lifecycle_runs as lr
    run = _run(tmp_path)
    (run / "global_step_1" / "critic" / "optim_world_size_2_rank_1.pt").unlink()
    lr.age(run)     # (no save in progress)
    rows = {r["name"]: r for r in json.loads(run_cli("list", run, "--json", check=1).stdout)["checkpoints"]}
    assert sorted(rows) == ["global_step_1", "global_step_2", "global_step_3"], rows
    step = run / "global_step_3"
    assert rows["global_step_3"]["bytes"] == sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    # the weights are both models' (each role's as inspect reads it alone; negative control: the actor's alone less)
    weights = {role: json.loads(run_cli("inspect", step / role, "--json", check=0).stdout)["bytes_per_state"]["module"]
               for role in ("actor", "critic")}
    assert rows["global_step_3"]["bytes_by_kind"]["weights"] == weights["actor"] + weights["critic"], weights
    assert rows["global_step_1"]["status"] == "incomplete", rows["global_step_1"]
    assert "critic/optim_world_size_2_rank_1.pt" in rows["global_step_1"]["why"], rows["global_step_1"]


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
    assert sorted(p.name for p in (run / "global_step_3").iterdir()) == ["actor", "critic", "data.pt"]
    # negative control: step 4 lands without rank 1's model file; it is flagged, and step 3 is not deleted for it
    shutil.copytree(FSDP[2] / "global_step_3", run / "global_step_4")
    (run / "global_step_4" / "actor" / "model_world_size_2_rank_1.pt").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    lr.age(run)
    proc = run_cli(*args, check=1)
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("step 4:")]
    assert "INCOMPLETE" in line and "model_world_size_2_rank_1.pt" in line, proc.stdout
    assert entries() == ["global_step_3", "global_step_4", "latest_checkpointed_iteration.txt"]


def test_a_step_converts_both_roles_in_one_command_and_reads_back_as_its_source(tmp_path):
    """One command writes actor/ and critic/ at 4 ranks; diff, inspect, validate and export take the step's two
    roles: diff finds no difference in either, and a changed critic element only under critic/ (negative control); a
    role folder still converts alone; another --format is refused for a step of two models, nothing written."""
    step = FSDP[1] / "global_step_3"
    dst = tmp_path / "dp4" / "global_step_3"
    run_cli("convert", step, dst, "--to", "dp=4", check=0)
    assert run_cli("diff", step, dst, check=0).stdout.strip().endswith("no difference: 165 tensors, 33,171 elements "
                                                                       "compared"), "both roles compared"
    changed = tmp_path / "changed" / "global_step_3"
    shutil.copytree(dst, changed)
    (changed / "reshard-manifest.json").unlink()        # (the files change under it)
    _change_weight(changed / "critic", CHANGED, world=4)
    proc = run_cli("diff", dst, changed, check=1)
    differing = [line for line in proc.stdout.splitlines() if "max abs diff" in line]
    assert differing and all(line.startswith(f"critic/{CHANGED} (") for line in differing), proc.stdout
    info = json.loads(run_cli("inspect", dst, "--json", check=0).stdout)
    critic = info["companions"]["critic"]
    assert (info["topology"]["dp"], critic["topology"]["dp"], critic["step"]) == (4, 4, 3), critic
    assert critic["parameters"] == 28 and info["parameters"] == 27      # the value head, not the language head
    exported = json.loads(run_cli("export", dst, tmp_path / "hf", "--json", check=0).stdout)
    assert exported["left_out"] == ["critic"], exported
    run_cli("convert", step / "critic", tmp_path / "alone" / "critic", "--to", "dp=3", check=0)
    assert run_cli("diff", step / "critic", tmp_path / "alone" / "critic", check=0).returncode == 0
    proc = run_cli("convert", step, tmp_path / "dcp", "--to", "dp=2", "--format", "dcp")
    assert proc.returncode == 1 and "critic/" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc
    assert not (tmp_path / "dcp").exists()


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


# Between verl and the other FSDP writers: --format dcp converts, proven by torch's own dcp.load; the HF Trainer's FSDP
# layout and torchtitan's are refused either way in one line, the reason shown on the consumers' own objects

def _dcp_loaded(folder, role_dir):
    """torch's own dcp.load (no process group) of the DCP folder `folder` into the state dict of the model the role's
    huggingface/ config builds (the actor's language model, the critic's value model: a token classifier of one
    label), and its optimizer's as the DCP writer names them (optim.state.<fqn>.<state>), every tensor NaN before the
    load: {"model": {fqn: tensor}, "optim": {fqn.state: tensor}}."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
    builds = AutoModelForTokenClassification if role_dir.name == "critic" else AutoModelForCausalLM
    model = builds.from_config(AutoConfig.from_pretrained(role_dir / "huggingface"), dtype=torch.float32)
    nan = float("nan")
    tree = {"model": {k: torch.full_like(v, nan) for k, v in model.state_dict().items()},
            "optim": {"state": {name: {"exp_avg": torch.full_like(p, nan), "exp_avg_sq": torch.full_like(p, nan),
                                       "step": torch.tensor(nan)} for name, p in model.named_parameters()}}}
    dcp.load(tree, checkpoint_id=str(folder))
    return {"model": tree["model"], "optim": {f"{name}.{key}": value for name, states in tree["optim"]["state"].items()
                                              for key, value in states.items()}}


def _unequal(live: dict, truth: dict) -> list:
    """The keys whose tensors differ, element for element in order (FSDP1's moments, split out of its flat
    parameters, are flat in verl_load.py's truth; the loaded ones have the parameter's shape)."""
    import torch
    assert set(live) == set(truth), set(live) ^ set(truth)
    return sorted(k for k in truth if not torch.equal(live[k].reshape(-1), truth[k].reshape(-1)))


@pytest.mark.engine
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("fsdp", sorted(FSDP))
def test_dcp_from_verl_is_loaded_by_torch_into_the_model_with_what_verl_loaded(loaded, fsdp, role, tmp_path):
    """Each role folder to --format dcp at 3 ranks: torch's dcp.load into its Qwen2's own state dict gives every
    weight, both Adam moments and each parameter's step that verl's own loader loaded from the source at 2 ranks, bit
    for bit, and the param group verl saved. Negative control: a copy with one weight element changed loads with that
    weight alone different."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    folder = (_critic if role == "critic" else _actor)(FSDP[fsdp])
    run_cli("convert", folder, tmp_path / "dcp", "--format", "dcp", "--to", "dp=3", "--quiet", check=0)
    got = _dcp_loaded(tmp_path / "dcp", folder)
    verl = loaded[f"fsdp{fsdp}" + (" critic" if role == "critic" else "")]
    assert _unequal(got["model"], load_file(verl["full"])) == []
    assert _unequal(got["optim"], load_file(verl["full_optim"])) == []
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "whole.pt")
    groups = torch.load(tmp_path / "whole.pt")["optim"]["param_groups"]
    saved = torch.load(folder / "optim_world_size_2_rank_0.pt", weights_only=False)["param_groups"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in saved]
    # verl's one group, over every parameter (FSDP1's saved group names its 3 flat parameters)
    assert len(groups) == len(saved) == 1 and sorted(groups[0]["params"]) == sorted(got["model"])
    changed = tmp_path / "changed" / role
    shutil.copytree(folder, changed)
    _change_weight(changed, CHANGED)
    run_cli("convert", changed, tmp_path / "dcp-changed", "--format", "dcp", "--to", "dp=3", "--quiet", check=0)
    assert _unequal(_dcp_loaded(tmp_path / "dcp-changed", changed)["model"],
                    load_file(verl["full"])) == [CHANGED]


@pytest.mark.parametrize("fmt", ["fsdp", "torchtitan"])
@pytest.mark.parametrize("source", ["global_step_3/actor", "global_step_3", "."])
def test_fsdp_and_torchtitan_from_verl_are_refused_in_one_line(tmp_path, fmt, source):
    """From a role, a step or a run folder, nothing written: the line says why (the param groups, the names)."""
    path = FSDP[2] / source
    proc = run_cli("convert", path, tmp_path / "out", "--format", fmt, "--to", "dp=2")
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"reshard: {path.resolve()}: a verl checkpoint is not converted to --format {fmt}: "), line
    assert ("one param group" if fmt == "fsdp" else "tok_embeddings.weight") in line, line
    assert run_cli("plan", path, "--format", fmt, "--to", "dp=2").returncode == 1


def test_the_hf_trainers_and_verls_optimizers_refuse_each_others_param_groups(tmp_path):
    """Why neither way converts, on the real objects: the HF Trainer's create_optimizer on the fixture's Qwen2 builds
    two param groups (decay, no decay), verl's build_optimizer one over every parameter; torch's load_state_dict,
    which both resumes call, refuses verl's saved optimizer in the Trainer's and the Trainer's FSDP save
    (fixtures/hf_fsdp_sharded_dp2, torch's dcp_to_torch_save) in verl's. Negative control: each loads a state of its
    own grouping. The reverse conversion is refused in one line saying so."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
    config = AutoConfig.from_pretrained(_actor(FSDP[2]) / "huggingface")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to=[],
                                                          weight_decay=0.01))
    trainers = trainer.create_optimizer()
    assert [g["weight_decay"] for g in trainers.param_groups] == [0.01, 0.0]
    verls = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)    # verl's build_optimizer: one group
    saved = torch.load(_actor(FSDP[2]) / "optim_world_size_2_rank_0.pt", weights_only=False)
    assert len(saved["param_groups"]) == 1 and len(saved["param_groups"][0]["params"]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="different number of parameter groups"):
        trainers.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})
    hf = FIXTURES / "hf_fsdp_sharded_dp2" / "checkpoint-3"
    dcp_to_torch_save(hf / "optimizer_0", tmp_path / "hf-optim.pt")
    hf_groups = torch.load(tmp_path / "hf-optim.pt")["optimizer"]["param_groups"]
    assert len(hf_groups) == 2
    with pytest.raises(ValueError, match="different number of parameter groups"):
        verls.load_state_dict({"state": {}, "param_groups": [dict(g, params=[0]) for g in hf_groups]})
    verls.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})          # negative control: its own
    trainers.load_state_dict(trainers.state_dict())
    proc = run_cli("convert", hf, tmp_path / "verl", "--format", "verl", "--to", "dp=2")
    assert proc.returncode == 1 and not (tmp_path / "verl").exists()
    [line] = proc.stderr.splitlines()
    assert "its optimizer has 2 param groups, verl's one" in line and "huggingface/" in line, line
