"""Load Megatron torch_dist saves in the real megatron-core 0.16.1 at their topology (torchrun, gloo, CPU).

    torchrun --nproc_per_node 2 tests/scripts/megatron_load.py JOBS.json RESULTS.json

JOBS.json lists {"label", "save": a Megatron-LM save dir, "tp", "pp", "truth": a truth.safetensors, "step": the
optimizer step it holds; a mixture of experts' "ep" and "experts"; a run made with Megatron-LM's defaults its
"vocab" (the embedding's rows Megatron-LM pads its tokenizer's vocabulary to at this tp) and "fp32"; "weights_only":
the model alone loaded, as Megatron-LM's --no-load-optim --no-load-rng loads it, and compared}. For each job every
rank makes the model parallel groups at tp, pp, ep (dp: what the ranks leave), builds the fixtures' GPTModel with
Megatron's optimizer as tools/fixture_megatron_core.py does (the distributed optimizer where the save's
content_metadata names a sharding type), and loads the save as Megatron-LM's load_checkpoint does at torch_dist: the
common state's args must name this tp and pp; the model's and optimizer's sharded state dicts built with the save's
content_metadata, the RNG state asked for unless args.no_save_rng, then `dist_checkpointing.load`, `load_state_dict`
of model, optimizer and scheduler. The live model and optimizer (the distributed optimizer asked for its model-space
form) are then gathered and compared with the truth bit for bit (where the vocabulary is padded to other rows than
the truth's, the truth padded as Megatron-LM's tools/checkpoint pads it: rows cut, or its last row replicated, in
every state; an fp32 run's params are its masters), and one more training step runs. Rank 0 writes {"label",
"loaded", "error", "problems": [...], "step", "losses", "moved"} per job: `error` is the first line of what Megatron
raised where the load failed. A job with "import" is a Hugging Face model imported as the model alone, loaded and
run by tests/scripts/megatron_import.py.
"""
import json
import os

from tests.helpers.rank_main import run_main


def main(jobs_path, results_path):
    import megatron_cpu
    megatron_cpu.install()

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    import fixture_megatron_core as fixture
    from tests.scripts import megatron_import

    dist.init_process_group("gloo")
    try:
        results = []
        for job in json.loads(open(jobs_path).read()):
            # (a Hugging Face model imported as the model alone: megatron_import's job)
            results.append(megatron_import.run(job, fixture) if job.get("import") else _job(job, fixture))
            mpu.destroy_model_parallel()
            dist.barrier()
        if dist.get_rank() == 0:
            with open(results_path, "w") as f:
                json.dump(results, f)
        dist.barrier()
        dist.destroy_process_group()
    finally:    # the torch_dist loader's helper processes would hold torchrun's output pipes open
        fixture.end_helpers()


def _job(job, fixture) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state as mpu, tensor_parallel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.api import CheckpointException

    save = job["save"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        folder = os.path.join(save, f"iter_{int(f.read().strip()):07d}")
    out = {"label": job["label"], "loaded": False, "error": None, "problems": []}
    common = dist_checkpointing.load_common_state_dict(folder)
    args = common["args"]
    # Megatron-LM's load_checkpoint refuses args of another tp or pp (and then ignores the RNG state)
    if (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) != (job["tp"], job["pp"]):
        out["problems"].append(f"args name tp={args.tensor_model_parallel_size}, pp="
                               f"{args.pipeline_model_parallel_size}, not the run's {job['tp']}, {job['pp']}")
    content = dist_checkpointing.load_content_metadata(folder) or {}
    distributed = "distrib_optim_sharding_type" in content
    config, model, ddp, optimizer, scheduler = fixture.build(job["tp"], job["pp"], distributed, job.get("ep", 1),
                                                             job.get("experts"), vocab=job.get("vocab", fixture.VOCAB),
                                                             fp32=job.get("fp32", False))
    _zero_state(optimizer)
    sd_metadata = {**content, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    state_dict = {"model": model.sharded_state_dict(metadata=sd_metadata)}
    weights_only = job.get("weights_only", False)       # Megatron-LM's --no-load-optim --no-load-rng
    if not weights_only:
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, is_loading=True, metadata=sd_metadata)
    if not getattr(args, "no_save_rng", False) and not weights_only:
        state_dict["rng_state"] = fixture.rng_state(mpu, tensor_parallel)
    try:
        with torch.no_grad():       # (an fp32 distributed optimizer's params are views of its buffer: copied in place)
            loaded = dist_checkpointing.load(state_dict, folder)
            model.load_state_dict(loaded["model"], strict=False)
            if weights_only:        # (as load_checkpoint does without the optimizer: its masters from the weights)
                optimizer.reload_model_params()
            else:
                optimizer.load_state_dict(loaded["optimizer"])
        if not weights_only:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
    # the negative control's expected failure (DCP raises CheckpointException, a BaseException)
    except (Exception, CheckpointException) as e:
        lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
        # DCP's CheckpointException carries each rank's traceback: its last line is what Megatron raised
        out["error"] = lines[-1][:400]
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, out["error"])
        return out
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None)
    failed = [e for e in errors if e]
    if failed:
        out["error"] = failed[0]
        return out
    out["loaded"] = True
    groups = [None] * dist.get_world_size()
    dist.all_gather_object(groups, sorted({float(g["step"]) for inner in _inners(optimizer)
                                           for g in inner.param_groups if "step" in g}))
    out["group_step"] = sorted({s for rank in groups for s in rank})
    if distributed:
        _steps_from_groups(optimizer)
    plain = {k: v for k, v in sd_metadata.items() if not k.startswith("distrib_optim")}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fixture.live_pieces(model, optimizer, plain, distributed))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, _steps(optimizer))
    out["step"] = sorted({s for rank in steps for s in rank})
    if dist.get_rank() == 0:
        got = _params_as_masters(fixture.assemble(gathered))
        truth = {k: _padded(k, v, job.get("vocab")) for k, v in load_file(job["truth"]).items()
                 if not weights_only or k.startswith("module/")}
        if weights_only:
            got = {k: v for k, v in got.items() if k.startswith("module/")}
        for key in sorted(set(truth) | set(got)):
            if key not in got or key not in truth:
                out["problems"].append(f"{key}: {'not loaded' if key not in got else 'not in the truth'}")
            elif got[key].dtype != truth[key].dtype or not torch.equal(got[key], truth[key]):
                out["problems"].append(f"{key}: differs from the truth")
    before = [p.detach().clone() for p in model.parameters()]
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, fixture.train(config, ddp, optimizer, scheduler, 1, seed=11))
    out["losses"] = [x for rank in losses for x in rank]
    out["moved"] = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, _steps(optimizer))
    out["step_after"] = sorted({s for rank in steps for s in rank})
    return out


VOCABULARY = ("embedding.word_embeddings.weight", "output_layer.weight")


def _padded(key, tensor, rows):
    """A vocabulary-sized truth tensor at `rows` rows as Megatron-LM's tools/checkpoint re-pads one (saver_base's
    pad_weight: cut, or the last row replicated)."""
    import torch
    if rows is None or not key.endswith(VOCABULARY) or tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows].clone()
    return torch.cat((tensor, tensor[-1].unsqueeze(0).expand(rows - tensor.shape[0], -1)))


def _params_as_masters(got):
    """An fp32 run's params are its masters: the plain FP32Optimizer keeps no copy, the truth names the param."""
    import torch
    masters = {f"fp32/{k[len('module/'):]}": v for k, v in got.items()
               if k.startswith("module/") and v.dtype == torch.float32}
    return {**masters, **got}


def _inners(optimizer):
    """The torch optimizers under Megatron's (a mixture of experts chains the dense params' and the experts')."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _zero_state(optimizer) -> None:
    """Zero Adam state before a load, as a resumed run that never stepped holds none: the distributed optimizer's
    state_dict() (which its sharded_state_dict calls) wants one step count."""
    import torch
    for inner, group in ((i, g) for i in _inners(optimizer) for g in i.param_groups):
        for p in group["params"]:
            if not inner.state[p]:
                inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                      exp_avg_sq=torch.zeros_like(p.data))


def _steps_from_groups(optimizer) -> None:
    """Test-only, as the CPU shim's: give torch's AdamW, which megatron-core falls back to without Transformer Engine
    or Apex, the step the distributed optimizer restored into its param groups (where TE's and Apex's FusedAdam
    keep it). Without it the load leaves every parameter's step at the placeholder it was given before the load (its
    dp_reshardable path copies the placeholder back) and one step tensor shared by all parameters."""
    import torch
    for inner, group in ((i, g) for i in _inners(optimizer) for g in i.param_groups):
        for p in group["params"]:
            inner.state[p]["step"] = torch.tensor(float(group["step"]))


def _steps(optimizer) -> list:
    """The Adam step counts this rank's optimizer holds (one per parameter)."""
    return sorted({float(inner.state[p]["step"]) for inner in _inners(optimizer) for g in inner.param_groups
                   for p in g["params"] if "step" in inner.state[p]})


if __name__ == "__main__":
    run_main(main, 2)
