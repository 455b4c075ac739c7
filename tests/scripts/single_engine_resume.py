"""Resume a converted single-process checkpoint in the real DeepSpeed engine (torchrun, CPU, gloo).

    torchrun --nproc_per_node M tests/scripts/single_engine_resume.py JOBS.json RESULTS.json

JOBS.json is a list of jobs, each {"model": "tiny_lm" | "gpt2" | "lightning", "checkpoint": dir, "stage": S,
      "truth": file, "optimizer": "Adam" | "AdamW" | "SGD", "hyper": {...}, "groups": [{"names": [...], hyper...}],
      "global_steps": N, "scheduler": {"class", "kwargs", "expected": {state key: value}} or absent}.
Every rank builds the model, the optimizer with the source's groups (as the source training built
them) and its LR scheduler, calls the ordinary engine.load_checkpoint, reads every fp32 param and
optimizer state back with deepspeed.utils.safe_get_full_*, compares them with the truth (the
source's own optimizer state, named by parameter identity when it was saved), and trains one more step.
"""
import json
import math

from tests.helpers.rank_main import run_main


def build(kind):
    from tests.helpers import single_models
    if kind == "tiny_lm":
        return single_models.TinyLM()
    if kind == "gpt2":
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel(single_models.gpt2_config())
    if kind == "lightning":
        from tests.helpers import single_lightning
        return single_lightning.LitTiny()
    raise ValueError(kind)


def make_scheduler(spec, optimizer):
    """The source run's LR scheduler, built fresh: its state must come from the checkpoint."""
    if spec is None:
        return None
    if spec["class"] == "hf_linear":
        from transformers import get_linear_schedule_with_warmup
        return get_linear_schedule_with_warmup(optimizer, **spec["kwargs"])
    import torch
    return getattr(torch.optim.lr_scheduler, spec["class"])(optimizer, **spec["kwargs"])


def loss_of(kind, engine, batch):
    if kind == "gpt2":
        return engine(input_ids=batch, labels=batch).loss
    return engine(batch)


def main(jobs_path, results_path):
    import deepspeed
    import deepspeed.comm as dist
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [run(job, dist.get_rank()) for job in jobs]
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.barrier()


def run(job, rank):
    import gc

    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import load_file

    from tests.helpers import single_models
    torch.manual_seed(1234)        # a different init: everything must come from the checkpoint
    model = build(job["model"])
    named = dict(model.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "names"}, "params": [named[n] for n in g["names"]]}
              for g in job["groups"]]
    optimizer = getattr(torch.optim, job["optimizer"])(groups, **job["hyper"])
    scheduler = make_scheduler(job.get("scheduler"), optimizer)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": job["stage"]}, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True}
    if job.get("bf16"):
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, lr_scheduler=scheduler)
    problems = []
    load_path, _ = engine.load_checkpoint(job["checkpoint"])
    if load_path is None:
        problems.append("load_checkpoint found nothing to load")
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):   # DeepSpeed 0.19.8 lazy-link bug, see make_fixtures
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    truth = load_file(job["truth"])
    got = {}
    for name, p in engine.module.named_parameters():
        got[f"fp32/{name}"] = safe_get_full_fp32_param(p)
        for key in truth:
            state, _, pname = key.partition("/")
            if pname == name and state != "fp32":
                got[key] = safe_get_full_optimizer_state(p, state)
    if rank == 0:
        for key, expected in truth.items():
            value = got.get(key)
            if value is None:
                problems.append(f"{key}: not in the resumed engine")
            elif value.shape != expected.shape or not torch.equal(value.float().cpu(), expected):
                problems.append(f"{key}: differs after resume")
        steps = {float(st["step"]) for st in engine.optimizer.optimizer.state.values() if "step" in st}
        if job.get("step") is not None and steps != {float(job["step"])}:
            problems.append(f"optimizer step {steps} after resume, saved {job['step']}")
        if scheduler is not None:
            state = engine.lr_scheduler.state_dict()
            for key, value in job["scheduler"]["expected"].items():
                if state.get(key) != value:
                    problems.append(f"lr scheduler {key}: {state.get(key)!r} after resume, saved {value!r}")
        if engine.global_steps != job["global_steps"]:
            problems.append(f"global_steps {engine.global_steps}, saved {job['global_steps']}")
    before = engine.global_steps
    loss = loss_of(job["model"], engine, single_models.tokens(100 + rank))
    engine.backward(loss)
    engine.step()
    if not math.isfinite(float(loss)) or engine.global_steps != before + 1:
        problems.append(f"one more step: loss {float(loss)}, global_steps {before} -> {engine.global_steps}")
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model, optimizer
    gc.collect()
    return {"checkpoint": job["checkpoint"], "stage": job["stage"], "problems": problems, "compared": len(truth)}


if __name__ == "__main__":
    run_main(main, 2)
