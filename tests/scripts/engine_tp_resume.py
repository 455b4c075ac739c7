"""Resume converted AutoTP / pipeline checkpoints in the real DeepSpeed engine at a new topology (torchrun, CPU).

    torchrun --nproc_per_node TP*DP (or PP*DP) tests/scripts/engine_tp_resume.py JOBS.json RESULTS.json

JOBS.json lists {"fixture": autotp fixture name, "checkpoint": dir, "tp": TP, "fixtures": dir, "universal"?: bool}, or
for the pipeline fixtures {"fixture": "pipe2_z1_fp32_dp2", "checkpoint": dir, "pp": PP, "partition"?: METHOD,
"fixtures": dir}: its PipelineModule (fixture_parallel.pipe_model) built with num_stages=PP and resumed by the
PipelineEngine (truth: fixture_parallel.pipe_truth, one more `train_batch`). For each job
every rank builds the fixture's Llama exactly as tools/fixture_parallel.py did (same seed), with the
fixture's DeepSpeed config but `"tensor_parallel": {"autotp_size": TP}` (AutoTP off at TP=1), calls the
ordinary `engine.load_checkpoint(dir)`, takes the truth from the live engine with the function the fixture
was made with (fixture_parallel.autotp_truth: full fp32 masters, every optimizer state, module weights),
compares it with the fixture's truth.safetensors bit for bit, checks steps and client state, optionally
saves the resumed state again with the engine's own `save_checkpoint` (job "resave": a directory; the test
compares those files with ours), and runs one more training step. Rank 0 writes {"fixture", "checkpoint", "tp",
"world", "problems": [...]} per job.
"""
import copy
import gc
import json
import math
import os

from tests.helpers.engine_resume_checks import (
    client_state_problems,
    counter_problems,
    optimizer_states,
    start_ranks,
    tensor_problems,
)
from tests.helpers.rank_main import run_main


def main(jobs_path, results_path):
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    import fixture_parallel as fp
    import make_fixtures

    rank, world, jobs = start_ranks(jobs_path)
    results = []
    for job in jobs:
        spec = copy.deepcopy(make_fixtures.CONFIGS[job["fixture"]])
        config = copy.deepcopy(spec["ds_config"])
        config["zero_optimization"]["stage"] = job.get("zero", config["zero_optimization"]["stage"])
        pipe = "pp" in job
        if pipe:        # the fixture's PipelineModule cut into job["pp"] stages (its own partition method unless named)
            model = fp.pipe_model(spec, num_stages=job["pp"], partition_method=job.get("partition"))
        else:
            config["tensor_parallel"] = {"autotp_size": job["tp"]}
            torch.manual_seed(0)
            model = LlamaForCausalLM(fp.llama_config(spec["tied"], spec.get("uneven", False)))
        if job.get("universal"):   # resume a universal checkpoint (its latest_universal)
            config["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        problems = []
        if job.get("direct"):       # the source itself, saved at another topology, through reshard (issue #15)
            import reshard.deepspeed_engine
            load_path, client_state = reshard.deepspeed_engine.load_checkpoint(engine, job["checkpoint"])
        else:
            load_path, client_state = engine.load_checkpoint(job["checkpoint"])
        if load_path is None:
            problems.append("load_checkpoint found nothing to load")
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        state_names, steps = optimizer_states(engine, make_fixtures)
        if pipe:
            tensors = fp.pipe_truth(engine, state_names, make_fixtures._flat_truth)
        elif job["tp"] > 1:
            tensors = fp.autotp_truth(engine, state_names)
        else:
            tensors = whole_truth(engine, state_names)
        if rank == 0:
            fixture = os.path.join(job["fixtures"], job.get("truth", job["fixture"]))   # "truth": a control
            truth = load_file(os.path.join(fixture, "truth.safetensors"))
            with open(os.path.join(fixture, "truth.json")) as f:
                meta = json.load(f)
            problems += tensor_problems(tensors, truth) + counter_problems(engine, steps, state_names, meta)
            if len(set(steps)) > 1:
                problems.append(f"optimizer steps differ between params: {sorted(set(steps))}")
            problems += client_state_problems(client_state, meta)
        if job.get("resave"):     # the engine's own save of the resumed state at this topology, to compare with
            engine.save_checkpoint(job["resave"], tag=open(os.path.join(job["checkpoint"], "latest")).read().strip(),
                                   client_state={k: (client_state or {}).get(k) for k in make_fixtures.CLIENT_STATE})
        # one more training step must run on the resumed state (TP ranks of a DP group see the same batch)
        before = engine.global_steps
        if pipe:
            generator = torch.Generator().manual_seed(300 + engine.grid.data_parallel_id)
            batches = [torch.randint(0, fp.VOCAB, (2, 7), generator=generator) for _ in range(4)]
            loss = engine.train_batch(data_iter=iter([(b[:, :-1].contiguous(), b[:, 1:].contiguous())
                                                      for b in batches]))
        else:
            from deepspeed.utils import groups
            dp_rank = groups.get_data_parallel_rank() if job["tp"] > 1 else rank   # no groups without AutoTP
            generator = torch.Generator().manual_seed(200 + dp_rank)
            ids = torch.randint(0, fp.TOKENS, (2, 10), generator=generator)
            loss = engine(input_ids=ids, labels=ids).loss
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
    dist.barrier()


def whole_truth(engine, state_names):
    """autotp_truth without tensor parallelism (no TP group exists at tp=1): every param is whole on the
    rank, gathered over data parallelism by the same helpers."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
        for s in state_names:
            out[f"{s}/{name}"] = safe_get_full_optimizer_state(p, s).detach().float().cpu().clone()
    for k, v in engine.module.state_dict().items():
        out[f"module/{k}"] = v.detach().cpu().clone().contiguous()
    return out


if __name__ == "__main__":
    run_main(main, 2)
