"""Resume converted checkpoints in the real DeepSpeed engine (run under torchrun, CPU, gloo).

    torchrun --nproc_per_node M tests/scripts/engine_resume.py JOBS.json RESULTS.json

JOBS.json lists {"fixture": name, "checkpoint": dir, "stage": S[, "universal": true][, "direct": true]}. For each job
every rank builds the fixture's model with its DeepSpeed config (ZeRO stage S, world size M), calls the ordinary
`engine.load_checkpoint(dir)`, reads the full fp32 params and optimizer states back from the live
engine exactly as tools/make_fixtures.py did when it saved the fixture, compares them with the
fixture's truth, checks steps and hyper-parameters, and trains one more step. Rank 0 writes
{"fixture", "checkpoint", "stage", "world", "problems": [...]} per job to RESULTS.json.

A "direct" job loads "checkpoint", saved at any topology, with `reshard.deepspeed_engine.load_checkpoint(engine, dir)`
instead of DeepSpeed's own call (no conversion step); "checkpoint" may be an s3:// URL, reached with the job's
"env" (the AWS chain's variables) set. A "universal" job builds the engine with `"checkpoint":
{"load_universal": true}`, so `load_checkpoint(dir)` takes the tag from `latest_universal` and loads `zero/`. Run those
with a fixed PYTHONHASHSEED: that set order decides the order of each rank's optimizer states, and the
truth reader gathers states across ranks in that order.
"""
import copy
import gc
import json
import math
import os

from tests.helpers.rank_main import run_main

HERE = os.path.dirname(os.path.abspath(__file__))



def engine_config(job, make_fixtures):
    spec = copy.deepcopy(make_fixtures.CONFIGS[job["fixture"]])
    config = copy.deepcopy(spec["ds_config"])
    zero = config["zero_optimization"]
    zero["stage"] = spec["stage"] = job["stage"]
    if job.get("universal"):
        config["checkpoint"] = {"load_universal": True}
        # DeepSpeed maps params to the flat buffer in the original order even under round_robin_gradients
        # (its defect B1), so a round-robin engine cannot load any universal checkpoint correctly; the
        # universal checkpoint itself does not depend on that setting.
        zero.pop("round_robin_gradients", None)
    make_fixtures.allow_cpu_fp16(spec)
    return spec, config


def main(jobs_path, results_path):
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import load_file

    import make_fixtures
    from fixture_model import build_model, make_batch, param_groups

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        spec, config = engine_config(job, make_fixtures)
        model = build_model(tied=spec["tied"], frozen=spec["frozen"])
        groups, _ = param_groups(model, two_groups=spec["two_groups"])
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        problems = []
        if job.get("direct"):       # the source itself, at its own topology, through reshard (issue #15)
            import reshard.deepspeed_engine
            from reshard.errors import ReshardError
            os.environ.update(job.get("env", {}))     # an s3:// checkpoint's endpoint and credentials
            try:
                load_path, client_state = reshard.deepspeed_engine.load_checkpoint(engine, job["checkpoint"])
            except ReshardError as e:   # every rank raises it, before any DeepSpeed collective: no hang
                if rank == 0:
                    results.append({**job, "world": world, "problems": [], "error": str(e)})
                del engine, model
                gc.collect()
                continue
        elif job.get("module_only"):     # a thinned checkpoint (reshard thin): DeepSpeed's weights-only load
            load_path, _ = engine.load_checkpoint(job["checkpoint"], job.get("tag"), load_module_only=True,
                                                  load_optimizer_states=job.get("load_optimizer_states", False),
                                                  load_lr_scheduler_states=False)
            live = module_weights(engine, deepspeed)
            if rank == 0:
                results.append({**job, "world": world, "problems": module_problems(live, job, load_path, torch)})
            dist.barrier()
            del engine, model
            gc.collect()
            continue
        else:
            load_path, client_state = engine.load_checkpoint(job["checkpoint"])
        if load_path is None:
            problems.append("load_checkpoint found nothing to load")
        tensors, info = make_fixtures.engine_truth(engine, spec)
        if rank == 0:
            fixture = os.path.join(job["fixtures"], job["fixture"])
            truth = load_file(os.path.join(fixture, "truth.safetensors"))
            with open(os.path.join(fixture, "truth.json")) as f:
                meta = json.load(f)
            if job.get("universal") and sorted(info["state_names"]) == sorted(meta["state_names"]):
                # The universal loader inserts the states in the order of a Python set (map_to_flat_opt_states);
                # torch.optim looks them up by name, so only the set of names matters.
                info["state_names"] = meta["state_names"]
            problems += compare(tensors, truth, info, meta, client_state or {}, torch)
        # one more training step must run on the resumed state
        before = engine.global_steps
        batch = make_batch(100, rank, make_fixtures.MICRO_BATCH).to(engine.device)
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            if not math.isfinite(float(loss)):
                problems.append(f"loss after resume is {float(loss)}")
            if engine.global_steps != before + 1:
                problems.append(f"global_steps {before} -> {engine.global_steps} after one step")
            results.append({**job, "world": world, "problems": problems})
        dist.barrier()
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, model
        gc.collect()
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)


def module_weights(engine, deepspeed) -> dict:
    """The live module's state dict, its ZeRO-3 partitions gathered whole (a collective: every rank calls it)."""
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def module_problems(live, job, load_path, torch):
    """The live module's weights, in the dtype it trains in, against the fixture's truth of its module."""
    from safetensors.torch import load_file
    if load_path is None:
        return ["load_checkpoint found nothing to load"]
    truth = load_file(os.path.join(job["fixtures"], job["fixture"], "truth.safetensors"))
    problems = []
    for key, expected in truth.items():
        if not key.startswith("module/"):
            continue
        got = live.get(key[len("module/"):])
        if got is None:
            problems.append(f"{key}: not in the loaded module")
        elif got.dtype != expected.dtype or not torch.equal(got, expected):
            problems.append(f"{key}: differs from the full checkpoint's weights")
    return problems


def compare(tensors, truth, info, meta, client_state, torch):
    problems = []
    for key, expected in truth.items():
        got = tensors.get(key)
        if got is None:
            problems.append(f"{key}: not in the resumed engine")
        elif got.dtype != expected.dtype or got.shape != expected.shape:
            problems.append(f"{key}: {got.dtype}{list(got.shape)} vs saved {expected.dtype}{list(expected.shape)}")
        elif not torch.equal(got, expected):
            diff = (got.float() - expected.float()).abs().max().item()
            problems.append(f"{key}: differs from the saved engine's value (max abs diff {diff:g})")
    for key in ("step", "global_steps", "global_samples", "skipped_steps", "state_names", "lr_scheduler"):
        if info[key] != meta[key]:
            problems.append(f"{key}: {info[key]!r} after resume, {meta[key]!r} when saved")
    hyper = [{k: v for k, v in g.items() if k != "param_names"} for g in meta["param_groups"]]
    elastic = meta["ds_config"]["zero_optimization"].get("elastic_checkpoint")
    # DeepSpeed's elastic files hold no param groups: a resumed engine keeps its configured hyper-parameters
    if not elastic and [{k: v for k, v in g.items() if k != "param_names"} for g in info["param_groups"]] != hyper:
        problems.append(f"param group hyper-parameters {info['param_groups']} vs saved {meta['param_groups']}")
    for key, value in meta["client_state"].items():
        if client_state.get(key) != value:
            problems.append(f"client state {key}: {client_state.get(key)!r} vs saved {value!r}")
    return problems


if __name__ == "__main__":
    run_main(main, 2)
