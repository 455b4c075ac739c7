"""Resume universal checkpoints in the real DeepSpeed engine (torchrun, CPU, gloo).

    torchrun --nproc_per_node M tests/engine_resume_universal.py JOBS.json RESULTS.json

Like tests/engine_resume.py, but a job with "universal": true builds the engine with
`"checkpoint": {"load_universal": true}`, so `engine.load_checkpoint(dir)` takes the tag from
`latest_universal` and loads `zero/`. The resumed fp32 params, every optimizer state, steps and
hyper-parameters are compared with the fixture's truth (engine_resume.compare) and one more step
is trained. Run it with a fixed PYTHONHASHSEED: that set order decides the order of each rank's
optimizer states, and the truth reader gathers states across ranks in that order. A job with
"universal": false is an ordinary ZeRO load (a universal source converted back to ZeRO files).
"""
import copy
import gc
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def engine_config(job, make_fixtures):
    spec = copy.deepcopy(make_fixtures.CONFIGS[job["fixture"]])
    config = copy.deepcopy(spec["ds_config"])
    zero = config["zero_optimization"]
    zero["stage"] = spec["stage"] = job["stage"]
    if job["universal"]:
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
    from engine_resume import compare
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
        load_path, client_state = engine.load_checkpoint(job["checkpoint"])
        if load_path is None:
            problems.append("load_checkpoint found nothing to load")
        tensors, info = make_fixtures.engine_truth(engine, spec)
        if rank == 0:
            fixture = os.path.join(job["fixtures"], job["fixture"])
            truth = load_file(os.path.join(fixture, "truth.safetensors"))
            with open(os.path.join(fixture, "truth.json")) as f:
                meta = json.load(f)
            if job["universal"] and sorted(info["state_names"]) == sorted(meta["state_names"]):
                # The universal loader inserts the states in the order of a Python set (map_to_flat_opt_states);
                # torch.optim looks them up by name, so only the set of names matters.
                info["state_names"] = meta["state_names"]
            problems += compare(tensors, truth, info, meta, client_state or {}, torch)
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
