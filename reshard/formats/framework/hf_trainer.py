"""The Hugging Face Trainer's checkpoint-N/ folder when the Trainer drives DeepSpeed, or FSDP with its sharded state
dict (framework/fsdp.py: the same files of the Trainer's beside pytorch_model_fsdp_0/ and optimizer_0/; observed,
transformers 5.21: trainer_state.json, scheduler.pt, rng_state_K.pth, and no config, weights or training_args.bin).

Observed (transformers 5, DeepSpeed 0.19, ZeRO-2, 2 processes): `latest`, `global_stepN/` and DeepSpeed's
zero_to_fp32.py / zero_to_torch.py (DeepSpeed's own, written by its writer), and the Trainer's: config.json,
generation_config.json, model.safetensors (the module weights, gathered by rank 0), trainer_state.json,
scheduler.pt, training_args.bin and rng_state_K.pth per process (rng_state.pth at one process; the Trainer
reads rng_state.pth at a world size of one, rng_state_K.pth above, and starts a process without its file
from a fresh seed). trainer_state.json records the position in the data globally (global step, epoch): it
is carried as it is, and the global batch size decides whether the Trainer's arithmetic still holds.
"""
from __future__ import annotations

import os
import re

from reshard.formats.deepspeed import files as deepspeed_files
from reshard.formats.framework import fsdp
from reshard.formats.framework.files import UNKNOWN, Framework, PerRank, framework_files
from reshard.formats.hf import files as hf_files
from reshard.formats.hf.trainer import ARGS, FSDP_MODEL, FSDP_OPTIMIZER, SCHEDULER, TRAINER_STATE
from reshard.storage import files as fs

NAME = "HF Trainer"
RNG = PerRank("RNG states", "rng_state_{rank}.pth", "rng_state.pth",
              "the Trainer finds none and keeps the RNG streams of its seed (TrainingArguments.seed)")
WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
# DeepSpeed's batch settings are "auto" under the Trainer, filled from TrainingArguments.
BATCH = ("the Trainer fills them from TrainingArguments (gradient_accumulation_steps, per_device_train_batch_size) "
         "into DeepSpeed's \"auto\" values; the same global batch keeps its epoch and data-skip arithmetic")
FSDP_BATCH = ("the Trainer takes them from TrainingArguments (gradient_accumulation_steps, "
              "per_device_train_batch_size); the same global batch keeps its epoch and data-skip arithmetic")
WHAT = {TRAINER_STATE: "the Trainer's state (global step, epoch, log history: a global position)",
        SCHEDULER: "the LR scheduler's state_dict",
        ARGS: "the pickled TrainingArguments",
        "config.json": "the model's config", "generation_config.json": "the generation config",
        "scaler.pt": "the AMP grad scaler's state"}


def detect(folder: str) -> Framework | None:
    """A DeepSpeed save dir (`latest`), or FSDP's sharded folders (framework/fsdp.py), holding the Trainer's
    trainer_state.json; or the Trainer's folder with FSDP's full state dict (pytorch_model_fsdp.bin), whose
    weights and optimizer files are the checkpoint (the single-process reader's) and the rest the Trainer's."""
    if fs.isfile(os.path.join(folder, FSDP_MODEL)) and fs.isfile(os.path.join(folder, TRAINER_STATE)):
        files = tuple(f for f in framework_files(folder, (RNG,), _what)
                      if f.name not in (FSDP_MODEL, FSDP_OPTIMIZER) and not WEIGHTS.match(f.name))
        return Framework(NAME, folder, files, (RNG,), model_files=hf_files.present(folder), batch_note=FSDP_BATCH,
                         backend=fsdp.FULL)
    deepspeed = fs.isfile(os.path.join(folder, deepspeed_files.LATEST))
    if not ((deepspeed or fsdp.is_sharded(folder)) and fs.isfile(os.path.join(folder, TRAINER_STATE))):
        return None
    return Framework(NAME, folder, framework_files(folder, (RNG,), _what), (RNG,),
                     model_files=hf_files.present(folder), batch_note=BATCH if deepspeed else FSDP_BATCH,
                     backend="" if deepspeed else fsdp.SHARDED)


def _what(name: str) -> str:
    if name in WHAT:
        return WHAT[name]
    if WEIGHTS.match(name):
        return "the model's weights as the Trainer saved them"
    if name in hf_files.TOKENIZER:
        return "a tokenizer file"
    return UNKNOWN
