"""FSDP saves as torch alone reads them (dcp_to_torch_save of a sharded folder, torch.load of full state dicts and
of Lightning's meta.pt), written as the truths the framework tests compare a resume with; and a truth one step off,
the negative control's."""
from __future__ import annotations

from pathlib import Path

import torch

STATES = ("exp_avg", "exp_avg_sq")


def consolidated(folder, out) -> tuple:
    """A framework's FSDP sharded save (`folder`) as torch's dcp_to_torch_save consolidates it into `out`:
    (model state dict, optimizer state dict)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder / "pytorch_model_fsdp_0", out / "model.pt")
    dcp_to_torch_save(folder / "optimizer_0", out / "optimizer.pt")
    return torch.load(out / "model.pt")["model"], torch.load(out / "optimizer.pt")["optimizer"]


def save_truth(path: Path, model: dict, optim: dict) -> None:
    """A model and optimizer state dict written to `path` under engine_state's keys (fp32/, exp_avg/, ...)."""
    from safetensors.torch import save_file
    truth = {f"fp32/{name}": value for name, value in model.items()}
    for name, states in optim["state"].items():
        truth.update({f"{state}/{name}": states[state] for state in STATES})
    save_file(truth, str(path))


def sharded_truth(source: Path, path: Path) -> None:
    """The sharded save `source` (pytorch_model_fsdp_0/, optimizer_0/) as dcp_to_torch_save reads it."""
    scratch = path.with_suffix(".consolidated")
    scratch.mkdir(exist_ok=True)
    save_truth(path, *consolidated(source, scratch))


def full_truth(source: Path, path: Path) -> None:
    """The full-state-dict save `source` as torch.load reads its pytorch_model_fsdp.bin and optimizer.bin."""
    save_truth(path, torch.load(source / "pytorch_model_fsdp.bin"), torch.load(source / "optimizer.bin"))


def lightning_truth(ckpt: Path, out: Path) -> Path:
    """What Lightning's saved folder holds, read by torch alone: its DCP items gathered by dcp_to_torch_save,
    Lightning's global step and scheduler by torch.load of meta.pt; {"tensors": {"model/<fqn>", "<state>/<fqn>"},
    ...}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    if out.exists():        # read once for both strategies' resumes
        return out
    whole = out.with_suffix(".whole.pt")
    dcp_to_torch_save(ckpt, whole)
    saved = torch.load(whole)
    whole.unlink()
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    model = saved["model"] if "model" in saved else saved["state_dict"]      # ModelParallelStrategy's key
    tensors = {f"model/{k}": v for k, v in model.items()}
    for fqn, states in saved["optimizer_0"]["state"].items():
        tensors.update({f"{s}/{fqn}": v for s, v in states.items()})
    torch.save({"tensors": tensors, "global_step": meta["global_step"], "scheduler": meta["lr_schedulers"][0]}, out)
    return out


def one_step_off(truth: Path, out: Path) -> Path:
    """The negative control's truth: every tensor of `truth` one step off (the next float up, an integer plus one),
    which an exact comparison must find in each."""
    if out.exists():
        return out
    saved = torch.load(truth)
    saved["tensors"] = {k: torch.nextafter(v, torch.full_like(v, float("inf"))) if v.is_floating_point() else v + 1
                        for k, v in saved["tensors"].items()}
    torch.save(saved, out)
    return out
