"""Load verl FSDP checkpoints (an actor's or a critic's) with verl 0.9.1's own FSDPCheckpointManager at this launch's
world size (torchrun, gloo, CPU), every job of the launch in turn.

    torchrun --nproc_per_node W tests/scripts/verl_load.py JOBS.json RESULTS.json

JOBS.json lists {"label", "folder": a role folder (global_step_N/actor), or "run": a run folder, whose step verl's own
`find_latest_ckpt_path` finds from its tracker (the role folder inside it then loaded), "role": "actor" (the default)
or "critic", "fsdp": 1 or 2, "truth": a role folder (optional), "full": where rank 0 writes the loaded weights whole
(safetensors; optional), "full_optim": where it writes the loaded optimizer state whole, `<parameter>.<state>`
(FSDP1's flat parameters split as FSDP's own metadata says; optional), "rng_of": an extra-state file whose torch RNG
state each rank's, right after the load, is compared with (optional)}.
For each job every rank builds the role tools/fixture_verl.py saved (tools/verl_cpu.role: a fresh seed, so its
weights differ from the saved ones until loaded) and calls `FSDPCheckpointManager.load_checkpoint(folder)`. The truth
is the truth folder's files of this rank as torch.load reads them (no reshard): what verl's manager saves of the
loaded model (its sharded model and optimizer state dicts, the lr scheduler) must equal it exactly. Then one more
training step runs. Rank 0 writes {"label", "loaded", "error", "found", "problems", "last_epoch", "scheduler",
"step_after", "loss", "rng_equal": per rank, whether its RNG state is rng_of's} per job, the problems of every rank
gathered.
"""
import os

from tests.helpers.rank_main import gloo_jobs, run_main


def main(jobs_path, results_path):
    gloo_jobs(_job, jobs_path, results_path)


def _local(value):
    """A saved value's tensor on this rank: a DTensor's local shard, else the value."""
    return value.to_local() if hasattr(value, "to_local") else value


def _differences(prefix: str, live, truth) -> list:
    import torch
    if isinstance(truth, dict):
        if not isinstance(live, dict) or set(live) != set(truth):
            return [f"{prefix}: keys differ"]
        return [p for key in truth for p in _differences(f"{prefix}.{key}", live[key], truth[key])]
    if isinstance(truth, (list, tuple)):
        if len(live) != len(truth):
            return [f"{prefix}: lengths differ"]
        return [p for i, (a, b) in enumerate(zip(live, truth, strict=True))
                for p in _differences(f"{prefix}.{i}", a, b)]
    a, b = _local(live), _local(truth)
    if torch.is_tensor(b):
        same = torch.is_tensor(a) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    else:
        same = a == b
    return [] if same else [f"{prefix}: differs from the truth"]


def _save_whole(tensors: dict, path: str, rank: int) -> None:
    """`tensors` gathered whole (a collective: every rank calls it) and written by rank 0 (safetensors)."""
    from safetensors.torch import save_file
    whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().contiguous()
             for k, v in tensors.items()}
    if rank == 0:
        save_file(whole, path)


def _flat_states(model, optimizer, world: int) -> dict:
    """FSDP1's optimizer state by parameter name: each flat parameter's state gathered whole from the ranks and split
    as FSDP's own metadata of it says (its parameters' names and sizes, the padding entries skipped)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, FullyShardedDataParallel) or module._handle is None:
            continue
        prefix = path.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        flat = module._handle.flat_param
        names = [f"{prefix}.{fqn}" if prefix else fqn for fqn in flat._fqns]
        for key, value in optimizer.state[flat].items():
            if value.dim() == 0:    # the step, one for the flat parameter
                out.update({f"{name}.{key}": value for name in names})
                continue
            blocks = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(blocks, value.contiguous())
            whole, offset, held = torch.cat(blocks), 0, iter(names)
            for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
                if not padding:
                    out[f"{next(held)}.{key}"] = whole[offset:offset + numel]
                offset += numel
    return out


def _job(job) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    import verl_cpu
    verl_cpu.install()
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
    from verl.utils.fsdp_utils import get_fsdp_state_ctx
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"label": job["label"], "loaded": False, "error": None, "found": None, "problems": [],
              "last_epoch": None, "scheduler": None, "step_after": None, "loss": None, "rng_equal": None}
    role = job.get("role", "actor")
    model, optimizer, scheduler, manager = verl_cpu.role(role, job["fsdp"], seed=1)
    folder = job.get("folder")
    if job.get("run"):      # verl's trainer's resume: the step its tracker names
        result["found"] = find_latest_ckpt_path(job["run"])
        folder = os.path.join(result["found"], role) if result["found"] else None
    try:
        if folder is None:
            raise FileNotFoundError(f"find_latest_ckpt_path({job['run']}) found no checkpoint")
        manager.load_checkpoint(folder)
    except Exception as error:   # the negative control's failure, reported for the test to judge
        result["error"] = f"{type(error).__name__}: {error}"
        dist.barrier()
        return result
    result["loaded"] = True
    if job.get("rng_of"):       # before anything draws from it
        saved = torch.load(job["rng_of"], weights_only=False)["rng"]["cpu"]
        equal = [None] * world
        dist.all_gather_object(equal, bool(torch.equal(torch.get_rng_state(), saved)))
        result["rng_equal"] = equal
    truth = job.get("truth")
    name = f"world_size_{world}_rank_{rank}.pt"
    with get_fsdp_state_ctx(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                            ShardedOptimStateDictConfig()):
        live = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    problems = []
    if truth:
        for kind in ("model", "optim"):
            saved = torch.load(os.path.join(truth, f"{kind}_{name}"), weights_only=False)
            problems += _differences(kind, live[kind], saved)
        saved_extra = torch.load(os.path.join(truth, f"extra_state_{name}"), weights_only=False)
        problems += _differences("lr_scheduler", scheduler.state_dict(), saved_extra["lr_scheduler"])
    if job.get("full"):     # the live weights, whole: what an export must hold
        _save_whole(live["model"], job["full"], rank)
    if job.get("full_optim") and job["fsdp"] == 2:      # FSDP2's moments and steps, whole, by parameter name
        names = [k for k, v in live["model"].items() if hasattr(v, "full_tensor")]
        _save_whole({f"{names[i]}.{k}": v for i, state in live["optim"]["state"].items() for k, v in state.items()},
                    job["full_optim"], rank)
    elif job.get("full_optim"):
        _save_whole(_flat_states(model, optimizer, world), job["full_optim"], rank)
    gathered = [None] * world
    dist.all_gather_object(gathered, problems)
    result["problems"] = sorted({p for rank_problems in gathered for p in rank_problems})
    result["last_epoch"] = scheduler.last_epoch
    result["scheduler"] = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    result["loss"] = verl_cpu.train_step(model, optimizer, scheduler, 4, rank)
    steps = {float(s["step"]) for s in optimizer.state_dict()["state"].values()}
    result["step_after"] = sorted(steps)
    dist.barrier()
    return result


if __name__ == "__main__":
    run_main(main, 2)
