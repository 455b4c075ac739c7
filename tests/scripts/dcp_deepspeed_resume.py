"""Resume, in the real DeepSpeed engine, a DeepSpeed checkpoint converted from an FSDP2 DCP save.

    torchrun --nproc_per_node 2 tests/scripts/dcp_deepspeed_resume.py JOBS.json RESULTS.json

JOBS.json lists {"checkpoint": CHECKPOINT, "stage": STAGE, "truth": TRUTH.pt, "control"?: CONTROL.pt,
"loader"?: "reshard"}, run in order in one process; RESULTS.json (rank 0) holds one result per job. For each, every
rank builds the untied fixture model with an fp32 DeepSpeed config (torch.optim.Adam, ZeRO
STAGE), calls the ordinary `engine.load_checkpoint(CHECKPOINT)`, and reads the full fp32 params
and Adam states back from the live engine (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`). Rank 0 compares them, the step and the learning rate with the
FSDP2 run's gathered state (TRUTH.pt, written by tests/scripts/dcp_fsdp2.py train) and reports the
problems found, after one more training step has run, with the engine's counters as loaded. CONTROL.pt, a truth with
something changed, is compared the same way ("control_problems"): the comparison must see it. With
`reshard`, CHECKPOINT is the FSDP2 save itself, loaded with reshard.deepspeed_engine.load_checkpoint (issue #15).
"""
import json
import math

from tests.helpers.rank_main import run_main


def main(jobs_path, results_path):
    import deepspeed
    import deepspeed.comm as dist
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [resume(job["checkpoint"], job["stage"], job["truth"], job.get("control"),
                      job.get("loader", "deepspeed")) for job in jobs]
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)


def resume(checkpoint, stage, truth_path, control_path, loader) -> dict:
    """One job (every rank): rank 0's result."""
    import gc

    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from fixture_model import build_model, make_batch

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.5, "torch_adam": True, "adam_w_mode": False}},
              "zero_optimization": {"stage": int(stage)}}
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if loader == "reshard":
        import reshard.deepspeed_engine
        load_path, _ = reshard.deepspeed_engine.load_checkpoint(engine, checkpoint, load_lr_scheduler_states=False)
    else:
        load_path, _ = engine.load_checkpoint(checkpoint, load_lr_scheduler_states=False)
    counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "train_batch_size": engine.train_batch_size()}
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 links optimizer-state fragments lazily after a step (see
        # tools/make_fixtures.engine_truth); after a load with no step yet, link them now.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    got = {}
    for name, param in engine.module.named_parameters():
        got[f"fp32/{name}"] = safe_get_full_fp32_param(param).detach().float().cpu().clone()
        for state in ("exp_avg", "exp_avg_sq"):
            got[f"{state}/{name}"] = safe_get_full_optimizer_state(param, state).detach().cpu().clone()
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    lrs = [g["lr"] for g in engine.optimizer.optimizer.param_groups]
    problems, control = [], []
    if rank == 0:
        if load_path is None:
            problems.append("load_checkpoint found nothing to load")
        problems += compare(got, steps, lrs, torch.load(truth_path, weights_only=False), torch)
        if control_path:
            control = compare(got, steps, lrs, torch.load(control_path, weights_only=False), torch)
    loss = engine(make_batch(100, rank))
    engine.backward(loss)
    engine.step()
    if rank == 0 and not math.isfinite(float(loss)):
        problems.append(f"loss after resume is {float(loss)}")
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model
    gc.collect()
    return {"problems": problems, "control_problems": control, "compared": len(got), **counters}


def compare(got, steps, lrs, truth, torch):
    """What differs between the resumed engine and an FSDP2 run's gathered state."""
    problems = []
    expected = {f"fp32/{n}": t for n, t in truth["model"].items() if f"fp32/{n}" in got}
    for name, state in truth["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            expected[f"{key}/{name}"] = state[key]
    if len(expected) != len(got):
        problems.append(f"{len(got)} tensors in the engine, {len(expected)} in the FSDP2 run")
    for key, want in expected.items():
        have = got.get(key)
        if have is None or have.shape != want.shape or not torch.equal(have, want.float()):
            problems.append(f"{key}: differs from the FSDP2 run")
    want_steps = {float(s["step"]) for s in truth["optim"]["state"].values()}
    if steps != want_steps:
        problems.append(f"optimizer step {steps} after resume, {want_steps} in the FSDP2 run")
    want_lrs = [g["lr"] for g in truth["optim"]["param_groups"]]
    if lrs != want_lrs:
        problems.append(f"lr {lrs} after resume, {want_lrs} in the FSDP2 run")
    return problems


if __name__ == "__main__":
    run_main(main, 2)
