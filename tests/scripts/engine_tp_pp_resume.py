"""Resume a converted tensor x pipeline parallel checkpoint in the real PipelineEngine (torchrun, CPU, gloo).

    torchrun --nproc_per_node TP*PP*DP tests/scripts/engine_tp_pp_resume.py JOBS.json RESULTS.json

JOBS.json lists jobs of one world size TP*PP*DP, run in order in one process, each {"fixture":
"megatron_pipe_tp2_pp2_z1_fp32_dp2", "checkpoint": dir, "tp", "pp", "dp", "fixtures": dir, "resave": dir}. Every
rank builds the fixture's PipelineModule of Megatron-style TP layers (tools/fixture_megatron_pipe.py) on the job's
topology (DeepSpeed's PipeModelDataParallelTopology; at tp=1 its plain pipe x data topology), with the fixture's
DeepSpeed config, calls the ordinary `engine.load_checkpoint`, takes the truth from the live engine with the
function the fixture was made with (full fp32 masters, every optimizer state, module weights), compares it with the
fixture's truth.safetensors bit for bit, checks steps and client state, saves the resumed state again
(`save_checkpoint`, to compare file names) and runs one more `train_batch`. Rank 0 writes the jobs, each with
"problems", "checked", "loss_after", "steps_after". With "source" (and "rules", the layout rule file), the same
engine then loads the fixture itself, with no conversion step, through reshard.deepspeed_engine.load_checkpoint
(issue #15), and is checked again ("direct: " problems).
"""
import copy
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
    rank, _, jobs = start_ranks(jobs_path)
    results = [resume(job, rank) for job in jobs]
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)


def resume(job, rank) -> dict:
    """One job (every rank): rank 0's result."""
    import gc

    import deepspeed
    import deepspeed.comm as dist
    from safetensors.torch import load_file

    import fixture_megatron_pipe as fmp
    import make_fixtures

    spec = copy.deepcopy(make_fixtures.CONFIGS[job["fixture"]])
    net = fmp.pipe_module(fmp.topology(job["tp"], job["pp"], job["dp"]))
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                           config=spec["ds_config"])
    load_path, client_state = engine.load_checkpoint(job["checkpoint"])
    problems = loaded_problems(engine, load_path, client_state, job, rank)
    if job.get("source"):
        import reshard.deepspeed_engine
        direct = reshard.deepspeed_engine.load_checkpoint(engine, job["source"], layout_rules=job["rules"])
        problems += [f"direct: {p}" for p in loaded_problems(engine, *direct, job, rank)]
    engine.save_checkpoint(job["resave"], tag=open(os.path.join(job["checkpoint"], "latest")).read().strip(),
                           client_state={k: (client_state or {}).get(k) for k in make_fixtures.CLIENT_STATE})
    gas = spec["ds_config"]["gradient_accumulation_steps"]
    loss = engine.train_batch(data_iter=fmp.data_iter(fmp.batches(engine.grid.data_parallel_id + 10, gas)))
    result = None
    if rank == 0:
        if not math.isfinite(float(loss)):
            problems.append(f"loss after resume is {float(loss)}")
        truth = load_file(os.path.join(job["fixtures"], job["fixture"], "truth.safetensors"))
        result = {**job, "problems": problems, "checked": len(truth) if not problems else 0,
                  "loss_after": float(loss), "steps_after": int(engine.global_steps)}
    dist.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, net
    gc.collect()
    return result


def loaded_problems(engine, load_path, client_state, job, rank) -> list:
    """What differs between the engine, as a load left it, and the fixture's truth (collective: every rank
    calls it; rank 0's list holds the problems)."""
    from safetensors.torch import load_file

    import fixture_megatron_pipe as fmp
    import make_fixtures

    problems = []
    if load_path is None:
        problems.append("load_checkpoint found nothing to load")
    state_names, steps = optimizer_states(engine, make_fixtures)
    tensors = fmp.megatron_pipe_truth(engine, state_names, make_fixtures._flat_truth)
    truth = load_file(os.path.join(job["fixtures"], job["fixture"], "truth.safetensors"))
    with open(os.path.join(job["fixtures"], job["fixture"], "truth.json")) as f:
        meta = json.load(f)
    if rank == 0:
        problems += tensor_problems(tensors, truth) + counter_problems(engine, steps, state_names, meta)
        problems += client_state_problems(client_state, meta)
    return problems


if __name__ == "__main__":
    run_main(main, 2)
