"""A DeepSpeed run saving every step, and the engine loading what a prune kept (torchrun, CPU, gloo).

    torchrun --nproc_per_node 2 tests/scripts/lifecycle_deepspeed.py JOBS.json RESULTS.json

JOBS.json: {"mode": "train", "dir": D, "steps": N} trains the fixture model with ZeRO-3 for N steps, calling
engine.save_checkpoint(D, client_state={"eval_loss": ...}) after each, and writes back per step the eval_loss
it recorded and the sum of every full fp32 parameter (safe_get_full_fp32_param). {"mode": "load", "dir": D,
"tags": [...]} loads each tag (None: what `latest` names) with engine.load_checkpoint into a freshly initialised
engine and writes back the global step and parameter sum it holds.

A train job's optional "rank0_only": [steps] and "truncate": [steps] break those saves the moment they return,
before the next step (a watcher beside the run sees them broken as they land): rank 1's files deleted (a ZeRO-3
save from rank 0 only), rank 1's optimizer file cut to a third.
"""
import json
import os

from tests.helpers.rank_main import run_main

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": 3}}


def engine_of(seed):
    import deepspeed

    from fixture_model import build_model
    model = build_model(seed=seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    return engine


def param_sum(engine) -> float:
    from deepspeed.utils import safe_get_full_fp32_param
    return float(sum(safe_get_full_fp32_param(p).double().sum() for _, p in engine.module.named_parameters()))


def broken_save(tag_dir: str, step: int, job: dict) -> None:
    import glob
    if step in job.get("rank0_only", ()):
        for f in glob.glob(os.path.join(tag_dir, "*rank_1_*")):
            os.unlink(f)                # rank 1 never wrote its partitions
    if step in job.get("truncate", ()):
        [optim] = glob.glob(os.path.join(tag_dir, "*rank_1_*optim_states.pt"))
        os.truncate(optim, os.path.getsize(optim) // 3)


def main(jobs_path, results_path):
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from fixture_model import make_batch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    with open(jobs_path) as f:
        job = json.load(f)
    rank = dist.get_rank()
    out = {}
    if job["mode"] == "train":
        engine = engine_of(seed=0)
        for step in range(1, job["steps"] + 1):
            loss = engine(make_batch(step, rank))
            engine.backward(loss)
            engine.step()
            with torch.no_grad():       # a held-out batch: the same on every rank
                eval_loss = float(engine(make_batch(1000, 0)))
            engine.save_checkpoint(job["dir"], client_state={"eval_loss": eval_loss})
            if rank == 0:
                broken_save(os.path.join(job["dir"], f"global_step{engine.global_steps}"), step, job)
            dist.barrier()
            out[f"global_step{engine.global_steps}"] = {"eval_loss": eval_loss, "sum": param_sum(engine)}
    else:
        for tag in job["tags"]:
            engine = engine_of(seed=99)     # another init: what it holds must come from the checkpoint
            path, _ = engine.load_checkpoint(job["dir"], tag=tag)
            out[str(tag)] = {"loaded": path is not None, "global_steps": engine.global_steps,
                             "sum": param_sum(engine)}
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(out, f)
    dist.barrier()


if __name__ == "__main__":
    run_main(main, 2)
