"""Accelerate's save_state(dir) with a DeepSpeed plugin.

Observed (accelerate 1.15, DeepSpeed 0.19, ZeRO-2, 2 processes): the folder is DeepSpeed's save dir, its tag
`pytorch_model` (Accelerate's MODEL_NAME; `pytorch_model_I` for an I-th model), `latest` and DeepSpeed's
scripts; Accelerate's own: random_states_K.pkl per process (always numbered, also at one process; it holds
the RNG states and the accelerator's step, and a process without one keeps its seed's), scheduler.bin (an LR
scheduler Accelerate steps, not DeepSpeed), custom_checkpoint_I.pkl (objects registered for checkpointing),
and, when the dataloaders have them, sampler.bin (a seedable sampler: its seed and epoch) and dl_state_dict.bin
(a stateful dataloader's position, written once, by process 0's dataloader: per process in meaning).

With an FSDP plugin and SHARDED_STATE_DICT (observed, accelerate 1.16, FSDP2, torch 2.13, 2 processes;
tools/fixture_accelerate_fsdp.py) the same files of Accelerate's stand beside FSDP's pytorch_model_fsdp_0/ and
optimizer_0/ (framework/fsdp.py) instead of DeepSpeed's `latest` and tag folder; load_state reads each by the
distributed type of the Accelerator that loads, so a folder of the other kind fails there. With FULL_STATE_DICT
(observed, the same versions and run) they stand beside pytorch_model_fsdp.bin (the gathered model state dict) and
optimizer.bin (FSDP's full optimizer state dict, keyed by parameter FQN), both torch.save'd by process 0 and read by
the single-process reader (hf/trainer.py); load_state has every process read them whole. (FSDP1 through
Accelerate does not run on CPU: "Inconsistent compute device and device_id: cpu vs cpu:0"; not observed.) Without
either, its model and optimizer files stand beside the same files of Accelerate's (PLAIN).
"""
from __future__ import annotations

import os
import re

from reshard.formats.deepspeed import files as deepspeed_files
from reshard.formats.framework import fsdp
from reshard.formats.framework.files import UNKNOWN, Framework, PerRank, framework_files
from reshard.formats.hf import files as hf_files, weights as hf_weights
from reshard.storage import files as fs

NAME = "Accelerate"
SCHEDULER = hf_files.ACCELERATE_SCHEDULER     # the first LR scheduler's (scheduler_I.bin the I-th's)
# DeepSpeed's tag under Accelerate: save_state's ckpt_id for the first model (MODEL_NAME), which load_state asks for
DEEPSPEED_TAG = "pytorch_model"
RANDOM_STATES = PerRank("RNG states and the accelerator's step", "random_states_{rank}.pkl",
                        fresh="load_state finds none: the process keeps its seed's RNG streams and its "
                              "accelerator's step starts at 0")
KNOWN = [(re.compile(r"^scheduler(_\d+)?\.bin$"), "an LR scheduler's state_dict"),
         (re.compile(r"^sampler(_\d+)?\.bin$"), "a dataloader's seedable sampler (seed, epoch)"),
         (re.compile(r"^dl_state_dict(_\d+)?\.bin$"), ("a stateful dataloader's position, as process 0's "
                                                        "dataloader saved it (per process in meaning: other "
                                                        "processes resume from it as it is)")),
         (re.compile(r"^custom_checkpoint_\d+\.pkl$"), "a registered custom object's state"),
         (re.compile(r"^scaler\.pt$"), "the grad scaler's state")]
# Without DeepSpeed or FSDP (DDP, one process) save_state writes the first model's state dict as model.safetensors
# (pytorch_model.bin with safe_serialization=False) and the first optimizer's torch.optim state_dict as optimizer.bin
# (observed, accelerate 1.16, torch 2.13; read by the single-process reader, hf/trainer.py)
PLAIN = "DDP or one process"
PLAIN_MODELS = (hf_weights.SAFE, hf_weights.BIN)
OPTIMIZER = hf_files.FSDP_FULL_OPTIMIZER     # optimizer.bin, the same name as FSDP's full optimizer state dict's
OTHER_MODELS = re.compile(r"^(model|pytorch_model|optimizer)_\d+\.(safetensors|bin)$")     # the I-th's, I >= 1
# Accelerate passes the plugin's config to DeepSpeed as it is; its scheduler steps once per process per step.
BATCH = ("Accelerate takes them from the DeepSpeed plugin's config and Accelerator(gradient_accumulation_steps=); "
         "its LR scheduler steps once per process each step, so the schedule advances by the world size")


FSDP_BATCH = ("Accelerate takes them from the DataLoader's batch_size and Accelerator(gradient_accumulation_steps=); "
              "its LR scheduler steps once per process each step, so the schedule advances by the world size")


def detect(folder: str) -> Framework | None:
    """A DeepSpeed save dir (`latest`), FSDP's sharded folders (framework/fsdp.py) or its full state dict's
    pytorch_model_fsdp.bin, or a plain save_state's model and optimizer files (PLAIN), with Accelerate's
    random_states_K.pkl beside it."""
    if not any(RANDOM_STATES.rank_of(n) is not None for n in fs.listdir(folder)):
        return None
    deepspeed = fs.isfile(os.path.join(folder, deepspeed_files.LATEST))
    full = fs.isfile(os.path.join(folder, fsdp.FULL_MODEL))
    plain = next((n for n in PLAIN_MODELS if fs.isfile(os.path.join(folder, n))), None)
    if not (deepspeed or full or fsdp.is_sharded(folder) or plain):
        return None
    if (full or plain) and not deepspeed:      # its model and optimizer files are the checkpoint, the rest Accelerate's
        ours = (fsdp.FULL_MODEL, fsdp.FULL_OPTIMIZER) if full else (plain, OPTIMIZER)
        # a second model's or optimizer's files are checkpoint data the reader does not read (the first's alone):
        # not Accelerate's own, so the checkpoint is not proven whole while they are there
        files = tuple(f for f in framework_files(folder, (RANDOM_STATES,), _what)
                      if f.name not in ours and not OTHER_MODELS.match(f.name))
        return Framework(NAME, folder, files, (RANDOM_STATES,), batch_note=FSDP_BATCH,
                         backend=fsdp.FULL if full else PLAIN, deepspeed_tag=DEEPSPEED_TAG)
    return Framework(NAME, folder, framework_files(folder, (RANDOM_STATES,), _what), (RANDOM_STATES,),
                     batch_note=BATCH if deepspeed else FSDP_BATCH, backend="" if deepspeed else fsdp.SHARDED,
                     deepspeed_tag=DEEPSPEED_TAG)


def _what(name: str) -> str:
    return next((what for pattern, what in KNOWN if pattern.match(name)), UNKNOWN)
