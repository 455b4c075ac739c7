"""A Hugging Face Trainer `checkpoint-N/` folder (also a save_pretrained folder of pytorch_model.bin, and Accelerate's
save_state folder with FSDP's FULL_STATE_DICT: the same torch.save files under Accelerate's names).

Holds: the weights (see hf_weights), optimizer.pt (torch.optim state dict), scheduler.pt (the LR
scheduler's state dict), rng_state*.pth (RNG states: numpy's is a pickled numpy object, so they are
recorded, never unpickled), trainer_state.json (global_step, log history), training_args.bin (a
pickled TrainingArguments object: recorded as present, never unpickled), config.json.
The Trainer's optimizer has two groups (weight decay, no weight decay), each in named_parameters()
order; optim_map resolves them against the model order.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace

from reshard.core.catalog import Catalog, CatalogBuilder, TrainingState
from reshard.core.layout import Layout
from reshard.errors import CheckpointError
from reshard.formats import torchsave_read, weights_only
from reshard.formats.hf import files as hf_files, weights as hf_weights
from reshard.formats.protocol import NoOptions
from reshard.formats.single import model
from reshard.formats.single.notes import SingleNotes
from reshard.formats.single.torchsave_checkpoint import is_optimizer
from reshard.formats.unpartitioned import UNPARTITIONED
from reshard.storage import files as fs

TRAINER_STATE, OPTIMIZER, SCHEDULER, ARGS = "trainer_state.json", "optimizer.pt", "scheduler.pt", "training_args.bin"
# With FSDP's FULL_STATE_DICT (accelerate's save_fsdp_model / save_fsdp_optimizer, observed with transformers 5.21,
# accelerate 1.16) the Trainer writes pytorch_model_fsdp.bin (the gathered module state dict, the same weights as
# model.safetensors) and optimizer.bin: FSDP's optim_state_dict, its params and state keyed by parameter FQN
# Accelerate's save_state with FSDP's FULL_STATE_DICT writes the same two files (observed, accelerate 1.16, FSDP2,
# torch 2.13) beside its scheduler.bin and random_states_K.pkl, and no other weights
FSDP_MODEL, FSDP_OPTIMIZER = hf_files.FSDP_FULL_MODEL, hf_files.FSDP_FULL_OPTIMIZER
# per-process RNG files: the Trainer's rng_state_K.pth, Accelerate's random_states_K.pkl
RNG = re.compile(r"^(?:rng_state(?:_(\d+))?\.pth|random_states_(\d+)\.pkl)$")
OPAQUE = (ARGS, *hf_files.CONFIGS)
FORMAT = "hf-trainer"
OPTIONS = NoOptions
# the registry asks formats.framework whose folder it is: the Trainer's with FSDP's full state dict is named
# (framework/hf_trainer.py), a plain one is nobody's
IN_FRAMEWORK_FOLDERS = True


def sniff(path: str, tag: str | None) -> bool:
    """A folder of HF weights with a trainer state, an optimizer or the per-process RNG files of the Trainer or
    Accelerate (a save_state thinned to its weights); or of pytorch_model.bin (or FSDP's full
    pytorch_model_fsdp.bin) weights (save_pretrained folders of safetensors alone are safetensors_reader's)."""
    if not fs.isdir(path):
        return False
    weights = hf_weights.present(path)
    return weights is not None and (fs.isfile(os.path.join(path, TRAINER_STATE)) or
                                    fs.isfile(os.path.join(path, OPTIMIZER)) or
                                    fs.isfile(os.path.join(path, FSDP_OPTIMIZER)) or
                                    weights in (hf_weights.BIN, hf_weights.BIN_INDEX, hf_weights.FSDP_BIN) or
                                    any(RNG.match(n) for n in fs.listdir(path)))


def read(path: str, options: NoOptions) -> Catalog:
    folder = fs.abspath(path)
    has_state = fs.isfile(os.path.join(folder, TRAINER_STATE))
    safe = hf_weights.present(folder) in (hf_weights.SAFE, hf_weights.SAFE_INDEX)
    weights_format = "safetensors" if safe else "torch"
    # the run's world size is what its per-process files say: one RNG file per process, numbered from 0 (the
    # highest number, so that a lost file is a hole the framework's files report, not a smaller run)
    processes = 1 + max((int(m.group(1) or m.group(2) or 0) for m in map(RNG.match, fs.listdir(folder)) if m),
                        default=0)
    catalog = CatalogBuilder(root=folder, format="hf-trainer" if has_state else weights_format,
                             layout=Layout.of(processes, format_topology=UNPARTITIONED))
    fsdp_full = fs.isfile(os.path.join(folder, FSDP_MODEL))
    # the Trainer's optimizer.pt; Accelerate's optimizer.bin, FSDP's full optimizer state dict or (a plain
    # save_state's) torch.optim's
    names = (FSDP_OPTIMIZER,) if fsdp_full else (OPTIMIZER, FSDP_OPTIMIZER)
    optim_path = next((p for p in (os.path.join(folder, n) for n in names) if fs.isfile(p)),
                      os.path.join(folder, names[0]))
    optimizer = None
    if fs.isfile(optim_path):      # first: a hostile or foreign file fails before any other work
        optimizer = torchsave_read.load(optim_path)
        if not is_optimizer(optimizer):
            raise CheckpointError(optim_path, "not a torch.optim state_dict (state, param_groups)")
    weights = hf_weights.read(folder)
    for file, role in weights.files:
        model.add_file(catalog, file, role)
    if fsdp_full and hf_weights.present(folder) != hf_weights.FSDP_BIN:
        _check_fsdp_copy(catalog, os.path.join(folder, FSDP_MODEL), weights.tensors)
    if optimizer is not None:
        model.add_file(catalog, optim_path, "optimizer")
    elif fs.isfile(os.path.join(folder, hf_files.ACCELERATE_SCHEDULER)) and not weights_only.is_thinned(folder):
        # save_state writes the optimizer before the scheduler that steps it: a save that stopped between them,
        # or a file lost, unless `reshard thin` dropped it (its record)
        catalog.problem(os.path.join(folder, FSDP_OPTIMIZER), "missing (save_state writes it with the "
                        f"{hf_files.ACCELERATE_SCHEDULER} that is here; no record of `reshard thin` dropping it)")
    # the weights keep no model order (safetensors, no config.json transformers can build): the optimizer's entries
    # are told apart by their shapes alone, where that proves which is which (single/optim_map.by_shapes)
    model.build(catalog, weights.tensors, weights.files[-1][0], optimizer, optim_path, weights.aliases, weights.order,
                weights.buffers, order_known=weights.order is not None)
    _training_state(catalog, folder)
    step = catalog.training.global_steps or catalog.freeze().contents().step
    # a folder `reshard thin` left without the optimizer's step and no trainer state (Accelerate's FSDP full state
    # dict) records none: unknown, not 0
    if catalog.training.global_steps is None and (step is not None or not weights_only.is_thinned(folder)):
        catalog.training = replace(catalog.training, global_steps=step or 0)
    catalog.model_files = hf_files.present(folder)
    return catalog.freeze()


def _check_fsdp_copy(catalog: CatalogBuilder, path: str, tensors: dict) -> None:
    """The Trainer's folder with FSDP's full state dict holds the weights twice: model.safetensors (read) and
    pytorch_model_fsdp.bin, the file its resume loads. That one is checked as a metadata-only load too, the same
    keys and shapes, so a truncated or foreign copy is a problem of this checkpoint, not a file nobody opened."""
    copy = torchsave_read.load(path)
    if not isinstance(copy, dict) or {k: tuple(getattr(v, "shape", ())) for k, v in copy.items()} != \
            {k: tuple(v.shape) for k, v in tensors.items()}:
        raise CheckpointError(path, "not the same weights as the model's safetensors (keys or shapes differ)")
    model.add_file(catalog, path, "weights (FSDP copy)")


def read_trainer_state(folder: str):
    """The Trainer's trainer_state.json in `folder` (None: there is none); unreadable, one line naming it."""
    state_path = os.path.join(folder, TRAINER_STATE)
    if not fs.isfile(state_path):
        return None
    try:
        with fs.open(state_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(state_path, f"unreadable trainer state ({e})") from None


def global_step(state) -> int | None:
    """trainer_state.json's global step, where it records one."""
    return state["global_step"] if isinstance(state, dict) and isinstance(state.get("global_step"), int) else None


def _training_state(catalog: CatalogBuilder, folder: str) -> None:
    lr_scheduler = None
    trainer_state = read_trainer_state(folder)
    global_steps = global_step(trainer_state)
    if trainer_state is not None:
        model.add_file(catalog, os.path.join(folder, TRAINER_STATE), "trainer_state")
    for name in (SCHEDULER, hf_files.ACCELERATE_SCHEDULER):     # the Trainer's scheduler.pt, Accelerate's
        scheduler = os.path.join(folder, name)
        if fs.isfile(scheduler):
            model.add_file(catalog, scheduler, "scheduler")
            lr_scheduler = torchsave_read.load(scheduler)
            break
    opaque = []
    for name in sorted(fs.listdir(folder)):
        if RNG.match(name) or name in OPAQUE:
            model.add_file(catalog, os.path.join(folder, name), "rng_state" if RNG.match(name) else "opaque")
            opaque.append(name)
    catalog.training = TrainingState(global_steps=global_steps, lr_scheduler=lr_scheduler)
    # opaque files: present, not read (pickles of Python objects or plain config)
    catalog.notes = SingleNotes(trainer_state=trainer_state, opaque_files=opaque)
