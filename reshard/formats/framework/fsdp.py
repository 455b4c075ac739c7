"""The folders Accelerate's FSDP save writes in a framework's folder (HF Trainer's checkpoint-N/, Accelerate's
save_state dir) with FSDP's SHARDED_STATE_DICT: one DCP folder for the model, one for the optimizer.

Observed in the HF Trainer's (transformers 5.21, accelerate 1.16, torch 2.13); Accelerate's save_state calls the
same accelerate/utils/fsdp_utils.py save_fsdp_model and save_fsdp_optimizer, not yet run here.
`pytorch_model_fsdp_0/` holds `{"model": model.state_dict()}` (keys `model.<fqn>`, planner path ("model", fqn)),
`optimizer_0/` holds `{"optimizer": get_optimizer_state_dict(...)}` (FSDP2, the Trainer's default: its
fsdp_config "version" defaults to 2; FSDP1 was not run here) (keys `optimizer.state.<fqn>.<state>`,
`optimizer.param_groups.<g>.<hyper>`, `params` the group's FQNs), each with its own `.metadata` and
`__<rank>_0.distcp` per process. The index is the model's (and optimizer's) in the Accelerator: the Trainer has one
of each.
"""
from __future__ import annotations

import os

from reshard.formats import weights_only
from reshard.formats.hf import files as hf_files
from reshard.storage import files as fs

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_0", "optimizer_0"
SHARDED = "FSDP (sharded state dict)"
FULL = "FSDP (full state dict)"
# FULL_STATE_DICT's two files, torch.save'd by process 0 (read by single/hf_trainer.py): the gathered model state dict
# (accelerate's FSDP_MODEL_NAME, the first model's) and FSDP's full optimizer state dict keyed by parameter FQN
FULL_MODEL, FULL_OPTIMIZER = hf_files.FSDP_FULL_MODEL, hf_files.FSDP_FULL_OPTIMIZER


def is_sharded(folder: str) -> bool:
    """Does `folder` hold the model's and the optimizer's sharded DCP folders, or the model's alone with `reshard
    thin`'s record (its weights-only form)? Without the record, a model's folder alone is a save that stopped
    between the two: no sharded save read."""
    if not fs.isdir(os.path.join(folder, MODEL_DIR)):
        return False
    return fs.isdir(os.path.join(folder, OPTIM_DIR)) or is_model_only(folder)


def is_model_only(folder: str) -> bool:
    """Is `folder` FSDP's sharded save thinned to its model's DCP folder (weights_only.PROVENANCE, no optimizer's)?"""
    return not fs.isdir(os.path.join(folder, OPTIM_DIR)) and weights_only.is_thinned(folder)


def own(name: str) -> bool:
    """Is entry `name` of a framework's folder FSDP's part (read as the checkpoint, not carried as a file)?"""
    return name in (MODEL_DIR, OPTIM_DIR)
