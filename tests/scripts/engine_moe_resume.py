"""Resume AutoEP mixture-of-experts checkpoints in the real DeepSpeed engine at a new ep x dp (torchrun, CPU).

    torchrun --nproc_per_node DP tests/scripts/engine_moe_resume.py JOBS.json RESULTS.json

JOBS.json lists {"fixture": an autoep or deepspeed.moe fixture, "checkpoint": dir, "ep": EP, "fixtures": dir [,
"zero": stage][, "universal": true][, "direct": true]}. For each job every rank builds the fixture's model as
tools/fixture_moe.py does but with other values (so a load that does not happen shows): the AutoEP Mixtral with the
fixture's DeepSpeed config at `"autoep_size": EP`, the deepspeed.moe module at `ep_size=EP` ("zero": the engine at
that ZeRO stage, not the fixture's); calls the ordinary `engine.load_checkpoint(dir)` ("direct":
`reshard.deepspeed_engine.load_checkpoint(engine, dir)` of a checkpoint saved at any topology, instead; "refused":
DeepSpeed's own load, whose exception, if any, is the result (`"error"`), nothing compared; "universal": the
engine is built with `"checkpoint": {"load_universal": true}` and, as DeepSpeed's universal loader cuts experts by
the largest expert-parallel group any engine of the process made, universal jobs of one launch go in order of
growing EP); takes the truth from the live engine with the function the fixture was made with
(fixture_moe.moe_truth: full fp32 masters, both Adam moments, module weights, every expert in its global place) and
compares it with the fixture's truth.safetensors bit for bit; then one more training step runs. Rank 0 writes
{**job, "world", "problems", "differ": [keys not equal to the truth]} per job.
"""
import copy
import gc
import json
import math
import os

from tests.helpers.engine_resume_checks import optimizer_states, start_ranks, tensor_problems
from tests.helpers.rank_main import run_main


def main(jobs_path, results_path):
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    import fixture_moe
    import make_fixtures

    rank, world, jobs = start_ranks(jobs_path)
    results = []
    for job in jobs:
        spec = make_fixtures.CONFIGS[job["fixture"]]
        config = copy.deepcopy(spec["ds_config"])
        if "zero" in job:
            config["zero_optimization"]["stage"] = job["zero"]
        if job.get("universal"):            # load_checkpoint takes the tag from latest_universal and reads zero/
            config["checkpoint"] = {"load_universal": True}
        if spec["kind"] == "autoep":
            config["expert_parallel"]["autoep_size"] = job["ep"]
            torch.manual_seed(1)                  # not the fixture's seed 0: the load must bring every value
            model = MixtralForCausalLM(fixture_moe.mixtral_config())
            params = model.parameters()

            def forward(engine, ids):         # a Hugging Face model: the loss from its labels
                return engine(input_ids=ids, labels=ids).loss
        else:                                     # deepspeed.moe: the fixture's module at ep_size=EP
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
            model = fixture_moe.MoENet(job["ep"])
            with torch.no_grad():                 # it seeds itself as the fixture did: move every value away
                for p in model.parameters():
                    p.add_(1.0)
            params = split_params_into_different_moe_groups_for_optimizer(
                {"params": list(model.parameters()), "name": "dense"})

            def forward(engine, ids):         # the fixture's module returns its loss
                return engine(ids, ids)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        problems = []
        if "zero" in job and engine.zero_optimization_stage() != job["zero"]:
            problems.append(f"the engine runs ZeRO-{engine.zero_optimization_stage()}, not {job['zero']}")
        if job.get("refused"):      # DeepSpeed's own load expected to refuse: its error is the result
            try:
                engine.load_checkpoint(job["checkpoint"])
                error = None
            except Exception as e:          # whatever the engine raises is what is measured
                error = f"{type(e).__name__}: {e}"
            if rank == 0:
                results.append({**job, "world": world, "problems": [], "differ": [], "error": error})
            dist.barrier()
            del engine, model
            gc.collect()
            continue
        if job.get("direct"):       # no conversion step: reshard plans this engine's files and serves them
            import reshard.deepspeed_engine
            load_path, _ = reshard.deepspeed_engine.load_checkpoint(engine, job["checkpoint"])
        else:
            load_path, _ = engine.load_checkpoint(job["checkpoint"])
        if load_path is None:
            problems.append("load_checkpoint found nothing to load")
        state_names, _ = optimizer_states(engine, make_fixtures)
        # sorted: the universal loader inserts each rank's states in the order of a Python set
        # (map_to_flat_opt_states), and every rank must all-gather the same state at once
        tensors = fixture_moe.moe_truth(engine, sorted(state_names), make_fixtures._flat_truth)
        differ = []
        if rank == 0:
            truth = load_file(os.path.join(job["fixtures"], job["fixture"], "truth.safetensors"))
            truth.pop("logits")
            found = tensor_problems(tensors, truth)
            differ = sorted(line.split(":")[0] for line in found)
            problems += found
            if engine.global_steps != make_fixtures_meta(job)["global_steps"]:
                problems.append(f"global_steps {engine.global_steps} after resume")
        # one more training step runs on the resumed state (every rank is a data-parallel rank of the dense part)
        generator = torch.Generator().manual_seed(400 + rank)
        ids = torch.randint(0, fixture_moe.TOKENS, (2, 10), generator=generator)
        before = engine.global_steps
        loss = forward(engine, ids)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            if not math.isfinite(float(loss.detach())):
                problems.append(f"loss after resume is {float(loss.detach())}")
            if engine.global_steps != before + 1:
                problems.append(f"global_steps {before} -> {engine.global_steps} after one step")
            results.append({**job, "world": world, "problems": problems, "differ": differ})
        dist.barrier()
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, model
        gc.collect()
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


def make_fixtures_meta(job) -> dict:
    with open(os.path.join(job["fixtures"], job["fixture"], "truth.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    run_main(main, 2)
