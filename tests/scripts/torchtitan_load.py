"""Resume torchtitan step-N folders with torchtitan 0.3.0's own CheckpointManager at this launch's world size
(torchrun, gloo, CPU).

    torchrun --nproc_per_node 3 tests/scripts/torchtitan_load.py JOBS.json RESULTS.json

JOBS.json lists {"label", "folder": a checkpoint folder holding step-N/, "step": N, "truths": {name: a step-N
folder}, "exclude": checkpoint.exclude_from_loading}. For each job every rank builds the run
tools/fixture_torchtitan.py saved (tools/torchtitan_cpu.components: torchtitan's Llama 3, its FSDP2 wrapping over
all ranks, OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader, the Trainer's train_state) and calls
`CheckpointManager.load(step=N)`. Each truth is read by torch's own `dcp_to_torch_save` (no reshard): the live
weights (full tensors), both Adam moments and each parameter's step (torchtitan's OptimizersContainer.state_dict),
the LR scheduler's last_epoch and the train state must equal it exactly; the folder's dataloader entries, read the
same way, must equal the truth's, and where the job loads the data loaders (at the size that saved them) rank 0's
loaded position must be the truth's. Then one more training step runs. Rank 0 writes {"label", "loaded", "error",
"problems": {truth's name: [...]}, "step", "last_epoch", "losses", "step_after"} per job.
"""
import os
import tempfile

from tests.helpers.rank_main import gloo_jobs, run_main


def main(jobs_path, results_path):
    gloo_jobs(_job, jobs_path, results_path)


def _truth(folder: str) -> dict:
    """A step-N folder as torch's own dcp_to_torch_save reads it (one process, no reshard)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, os.path.join(tmp, "state.pt"))
        return torch.load(os.path.join(tmp, "state.pt"), weights_only=False)


def _problems(job, folder, weights, optim, lr_schedulers, train_state, dataloader) -> list:
    import torch
    truth, problems = _truth(folder), []
    problems += [f"{name}: differs from the truth" for name, live in weights.items()
                 if not torch.equal(live, truth[name])]
    problems += [f"optimizer.{key}: differs from the truth" for key, live in optim.items()
                 if not torch.equal(live, truth["optimizer"][key])]
    states = {k for k in truth["optimizer"] if k.startswith("state.")}
    problems += [f"optimizer.{k}: not loaded" for k in sorted(states - set(optim))]
    if {"last_epoch": lr_schedulers.schedulers[0].last_epoch} != truth["lr_scheduler"]:
        problems.append("lr_scheduler: differs from the truth")
    if train_state.state_dict() != truth["train_state"]:
        problems.append("train_state: differs from the truth")
    if _truth(os.path.join(job["folder"], f"step-{job['step']}"))["dataloader"] != truth["dataloader"]:
        problems.append("dataloader: differs from the truth")
    if "dataloader" not in job["exclude"] and dataloader.state_dict() != {
            k: v for k, v in truth["dataloader"].items() if k in ("dp_rank_0", "world_size")}:
        problems.append("dataloader: rank 0 loaded another position")     # (loaded at the size that saved it)
    return problems


def _job(job: dict) -> dict:
    import torch.distributed as dist
    if job.get("model_only"):
        return _model_only(job)

    import torchtitan_cpu
    result = {"label": job["label"], "loaded": False, "error": None, "problems": {}, "losses": []}
    model, optimizers, lr_schedulers, dataloader, train_state, checkpointer = torchtitan_cpu.components(
        job["folder"], fuse_qkv=False, exclude_from_loading=job["exclude"])
    try:
        result["loaded"] = bool(checkpointer.load(step=job["step"]))
    except Exception as e:      # what torchtitan raised, for the negative controls
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if result["loaded"]:
        # every rank gathers (full_tensor is collective); rank 0 compares
        weights = {name: param.full_tensor() for name, param in model.named_parameters()}
        optim = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in optimizers.state_dict().items() if k.startswith("state.")}
        if dist.get_rank() == 0:
            result["problems"] = {name: _problems(job, truth, weights, optim, lr_schedulers, train_state,
                                                  dataloader) for name, truth in job["truths"].items()}
        result["step"], result["last_epoch"] = train_state.step, lr_schedulers.schedulers[0].last_epoch
        result["losses"] = torchtitan_cpu.train_steps(model, optimizers, lr_schedulers, iter(dataloader),
                                                      train_state, 1)
        result["step_after"] = sorted({float(v) for k, v in optimizers.state_dict().items() if k.endswith(".step")})
    checkpointer.close()
    dist.barrier()
    return result


def _model_only(job: dict) -> dict:
    """{"label", "model_only": true, "load": a model-only step-N folder, "truth": a full step-N folder, "tokens":
    [[id, ...], ...], "save": a checkpoint folder}: a fresh run whose CheckpointManager (its own folder empty)
    loads `load` with checkpoint.initial_load_path, the model alone (initial_load_model_only); every weight must
    equal the truth's as dcp_to_torch_save reads it. Optional: with "tokens", torchtitan's forward of them
    ("logits"); with "save", the loaded model saved by the same CheckpointManager as its last step, model only
    (checkpoint.last_save_model_only), as `save`/step-1 ("saved": that folder)."""
    import torch
    import torch.distributed as dist

    import torchtitan_cpu
    result = {"label": job["label"], "load": job["load"], "loaded": False, "error": None, "problems": []}
    with tempfile.TemporaryDirectory() as empty:
        model, _, _, _, _, checkpointer = torchtitan_cpu.components(
            job.get("save") or os.path.join(empty, "checkpoint"), fuse_qkv=False, initial_load_path=job["load"],
            last_save_model_only=True)
        try:
            result["loaded"] = bool(checkpointer.load())
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if result["loaded"]:
            weights = {name: param.full_tensor() for name, param in model.named_parameters()}
            if dist.get_rank() == 0 and "truth" in job:
                truth = _truth(job["truth"])
                result["compared"] = len(weights)
                result["problems"] = [f"{name}: differs from the truth" for name, live in weights.items()
                                      if not torch.equal(live, truth[name])]
            if "tokens" in job:     # (FSDP2's forward gathers: every rank runs it)
                with torch.no_grad():
                    logits = torchtitan_cpu.forward(model, torch.tensor(job["tokens"]))
                result["logits"] = logits.full_tensor().tolist() if hasattr(logits, "full_tensor") else \
                    logits.tolist()
            if job.get("save"):
                checkpointer.save(curr_step=1, last_step=True)
                result["saved"] = os.path.join(job["save"], "step-1")
        checkpointer.close()
    dist.barrier()
    return result


if __name__ == "__main__":
    run_main(main, 2)
