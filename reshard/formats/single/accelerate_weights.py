"""Accelerate's weights-only forms of its save_state folder with FSDP or neither FSDP nor DeepSpeed, each the folder
less the optimizer's files, the model's kept as they are with Accelerate's own (scheduler, RNG states, registered
objects: small):
- FSDP's SHARDED_STATE_DICT: less `optimizer_0/` (dcp/fsdp_weights.py);
- FSDP's FULL_STATE_DICT: less `optimizer.bin` (save_fsdp_optimizer's), `pytorch_model_fsdp.bin` (save_fsdp_model's)
  kept;
- plain (DDP, one process): less `optimizer.bin` (torch.optim's state_dict), `model.safetensors` or
  `pytorch_model.bin` kept.
`accelerator.load_state(dir)` loads the optimizers and schedulers that were prepared: with the model alone prepared
(and the custom objects registered, whose count it checks) it loads the model (through load_fsdp_model, from
`pytorch_model_fsdp_0/` or `pytorch_model_fsdp.bin` as the plugin's state dict type says; without FSDP from the model
file) and no optimizer file (accelerate 1.16).

With DeepSpeed the folder is the engine's save dir (`latest`, the tag folder `pytorch_model/`, DeepSpeed's scripts)
with Accelerate's files beside it: its form is that folder with the tag folder in DeepSpeed's own weights-only form
(deepspeed/weights_only.py: ZeRO-1/2 less the optimizer files, ZeRO-3 with them written again without the moments),
the rest kept. `accelerator.load_state(dir, load_module_only=True, load_optimizer_states=False,
load_lr_scheduler_states=False)` loads it: accelerate 1.16 hands those keyword arguments to the engine's
`load_checkpoint(dir, "pytorch_model", ...)` (and to no other load under DeepSpeed), and loads scheduler.bin, the RNG
states and the registered objects as from the full folder.
"""
from __future__ import annotations

import dataclasses
import os

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.dcp import fsdp_weights
from reshard.formats.deepspeed import weights_only as deepspeed_weights
from reshard.formats.framework import accelerate, framework_of, fsdp
from reshard.formats.weights_only import Form
from reshard.storage import files as fs

LOAD = "accelerator.load_state(dir) with the model alone prepared (accelerate's load_fsdp_model)"
PLAIN_LOAD = "accelerator.load_state(dir) with the model alone prepared"
DEEPSPEED_LOAD = ("accelerator.load_state(dir, load_module_only=True, load_optimizer_states=False, "
                  "load_lr_scheduler_states=False)")
OPTIMIZER = accelerate.OPTIMIZER        # optimizer.bin, under FSDP's full state dict and without FSDP alike
OPTIMIZER_FILE = {fsdp.FULL: "FSDP's full optimizer state dict", accelerate.PLAIN: "torch.optim's state_dict"}


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The save_state folder `path` less its optimizer's files (the weights are the parameters as the model holds
    them: no separate masters, so `keep_masters` changes nothing)."""
    if catalog.format == "fsdp":
        return fsdp_weights.form(catalog, path, LOAD)
    frame = framework_of(catalog)
    if frame is not None and catalog.format == "deepspeed":
        return _deepspeed(catalog, path, keep_masters)
    if frame is None or frame.backend not in OPTIMIZER_FILE:
        raise ReshardError.at(path, "thinning Accelerate's save_state is built for DeepSpeed's, FSDP's sharded and "
                                    "full state dict folders and a plain save_state's")
    folder = fs.normpath(fs.abspath(path))
    found = sorted(fs.listdir(folder))
    if OPTIMIZER not in found:
        raise ReshardError.at(path, f"no {OPTIMIZER}: nothing to thin")
    kept = tuple(n for n in found if n != OPTIMIZER and fs.isfile(os.path.join(folder, n)))
    return Form(kept, (OPTIMIZER,), f"the optimizer state ({OPTIMIZER}: {OPTIMIZER_FILE[frame.backend]})",
                LOAD if frame.backend == fsdp.FULL else PLAIN_LOAD)


def _deepspeed(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The save dir `path` with its tag folder in DeepSpeed's weights-only form, Accelerate's files and DeepSpeed's
    `latest` and scripts kept."""
    folder = fs.normpath(fs.abspath(path))
    tag = os.path.relpath(fs.normpath(catalog.root), folder)
    if tag.startswith(os.pardir) or os.sep in tag:
        raise ReshardError.at(path, f"its DeepSpeed tag folder {catalog.root} is not in it: not thinned")
    engine = deepspeed_weights.form(catalog, catalog.root, keep_masters)
    outside = tuple(n for n in sorted(fs.listdir(folder)) if n != tag and fs.isfile(os.path.join(folder, n)))
    inside = tuple(f"{tag}/{n}" for n in engine.kept)
    written = tuple(dataclasses.replace(f, path=f"{tag}/{f.path}") for f in engine.written)
    return Form((*outside, *inside), tuple(f"{tag}/{n}" for n in engine.dropped), engine.what, DEEPSPEED_LOAD,
                written)
