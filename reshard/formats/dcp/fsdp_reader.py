"""A framework's folder saved by Accelerate's FSDP with SHARDED_STATE_DICT (HF Trainer's checkpoint-N/, Accelerate's
save_state dir) -> one Catalog: the model's DCP folder and the optimizer's (framework/fsdp.py) read as one DCP
checkpoint, each item where its own `.metadata` puts it, with the Trainer's step and the LR scheduler (the Trainer's
or Accelerate's) where it saved them. The optimizer's keys (`optimizer.state.<fqn>.<state>`) meet the model's
(`model.<fqn>`) through planner_data's paths, the parameter's FQN in both. The framework's own files (trainer state,
scheduler, per-process RNG) are the registry's (formats.framework.detect). A folder `reshard thin` left (its record,
no `optimizer_0/`: fsdp.is_model_only) is the model's DCP folder alone, its weights-only form.
"""
from __future__ import annotations

import os
from dataclasses import replace

from reshard.core.catalog import Catalog, CatalogBuilder
from reshard.core.layout import Layout
from reshard.errors import CheckpointError
from reshard.formats import torchsave_read
from reshard.formats.dcp import metadata as md, reader as dcp_reader
from reshard.formats.dcp.chunks import METADATA, Chunks, joined
from reshard.formats.framework import accelerate
from reshard.formats.framework.fsdp import MODEL_DIR, OPTIM_DIR, is_model_only, is_sharded
from reshard.formats.hf.trainer import SCHEDULER, global_step, read_trainer_state
from reshard.formats.protocol import NoOptions
from reshard.storage import files as fs

FORMAT = "fsdp"
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = True


def sniff(path: str, tag: str | None) -> bool:
    return fs.isdir(path) and is_sharded(path)


def read(path: str, options: NoOptions) -> Catalog:
    root = fs.abspath(path)
    parts = []
    for folder in (MODEL_DIR,) if is_model_only(root) else (MODEL_DIR, OPTIM_DIR):
        meta_path = os.path.join(root, folder, METADATA)
        if not fs.isfile(meta_path):
            raise CheckpointError(meta_path, "missing: DCP writes .metadata last, so the save did not finish")
        parts.append((folder, md.read(meta_path)))
    meta, meta_paths = joined(root, parts)
    catalog = CatalogBuilder(root, FORMAT, Layout.of(1), save_dir=root)
    read = dcp_reader.build(catalog, meta, Chunks(root, meta, catalog, meta_paths))
    return replace(read, training=replace(read.training, **_trainer_counters(root)))


def _trainer_counters(root: str) -> dict:
    """The HF Trainer's global step (trainer_state.json) and the LR scheduler (the Trainer's scheduler.pt,
    Accelerate's scheduler.bin, through the restricted unpickler), where the folder has them: what `diff` and a
    conversion's plan compare. (Accelerate's step is in its pickled random_states_K.pkl, never unpickled.)"""
    out: dict = {}
    step = global_step(read_trainer_state(root))
    if step is not None:
        out["global_steps"] = step
    for name in (SCHEDULER, accelerate.SCHEDULER):
        scheduler = os.path.join(root, name)
        if fs.isfile(scheduler):
            out["lr_scheduler"] = torchsave_read.load(scheduler)
            break
    return out
