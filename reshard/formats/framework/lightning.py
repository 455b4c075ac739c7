"""Lightning's `*.ckpt/` folders: DeepSpeedStrategy's and FSDPStrategy's with its sharded state dict.

DeepSpeedStrategy: the folder is DeepSpeed's save dir (tag `checkpoint`), with nothing of Lightning's beside it.
Lightning hands engine.save_checkpoint its whole checkpoint dict less weights and optimizer states (epoch,
global_step, loops, callbacks, lr_schedulers, hparams) as DeepSpeed's client state, which every conversion
carries; so it has no files of its own to carry, rename or drop at another size.

FSDPStrategy(state_dict_type="sharded") (observed, lightning 2.6.6, torch 2.13, FSDP1 at 2 processes): one DCP
folder holding `{"model": the module's sharded state dict, "optimizer_0": FSDP.optim_state_dict(...)}` (keys
`model.<fqn>`, `optimizer_0.state.<fqn>.<state>` with each param's own `step`, `optimizer_0.param_groups.<g>.<hyper>`
and `.params` the group's FQNs; FSDP1 keys its optimizer by FQN as FSDP2 does), `.metadata`, `__<rank>_0.distcp`
per process, and `meta.pt`, written by rank 0: the rest of the checkpoint dict (epoch, global_step,
pytorch-lightning_version, loops, callbacks, lr_schedulers, hyper_parameters when saved), which Lightning's
load_checkpoint returns as it is. It is the same whatever the world size, so it is carried byte for byte.
ModelParallelStrategy (FSDP2) writes the same folder, its model under `state_dict.<fqn>`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from reshard.errors import CheckpointError
from reshard.formats import torchsave_read
from reshard.formats.dcp.chunks import METADATA
from reshard.formats.framework.files import Framework, FrameworkFile
from reshard.storage import files as fs

NAME = "Lightning"
DEEPSPEED_TAG = "checkpoint"     # DeepSpeedStrategy.save_checkpoint's tag
# always in the client state Lightning's DeepSpeedStrategy.save_checkpoint hands DeepSpeed
VERSION_KEY = "pytorch-lightning_version"
BATCH = "Lightning takes them from Trainer(accumulate_grad_batches=) and the DataLoader's batch_size"


def detect(folder: str, client_state: Mapping[str, Any]) -> Framework | None:
    """Lightning, when the DeepSpeed save's client state is its checkpoint dict."""
    if VERSION_KEY not in client_state:
        return None
    return Framework(NAME, folder, (), (), batch_note=BATCH, state=dict(client_state), deepspeed_tag=DEEPSPEED_TAG)

# FSDPStrategy's sharded folder (lightning.fabric.utilities.load._METADATA_FILENAME; save_checkpoint's keys)
FSDP_META = "meta.pt"
FSDP_MODEL, FSDP_OPTIMIZER = "model", "optimizer_0"
FSDP_SHARDED = "FSDP (sharded)"
# ModelParallelStrategy (FSDP2 and DCP; observed, lightning 2.6.6 at 2 CPU processes, fully_shard in configure_model):
# the same folder, its model under "state_dict" (save_checkpoint's key) instead of "model"
MODEL_PARALLEL = "ModelParallelStrategy (FSDP2, sharded)"
MODEL_KEY = {FSDP_SHARDED: FSDP_MODEL, MODEL_PARALLEL: "state_dict"}     # backend -> the DCP items' model key
META_WHAT = ("Lightning's checkpoint less model and optimizer (epoch, global_step, loops, callbacks, lr_schedulers, "
             "hyper-parameters)")


def is_fsdp_sharded(folder: str) -> bool:
    """Is `folder` FSDPStrategy's sharded checkpoint (a DCP folder with Lightning's meta.pt)?"""
    return fs.isdir(folder) and all(fs.isfile(os.path.join(folder, n)) for n in (METADATA, FSDP_META))


def sharded_framework(folder: str, model_key: str) -> Framework:
    """Lightning around a sharded DCP folder whose model is under `model_key` (which says the strategy); its one
    file of its own is meta.pt."""
    backend = next((b for b, key in MODEL_KEY.items() if key == model_key), None)
    if backend is None:
        raise CheckpointError(os.path.join(folder, METADATA), f"Lightning's folder holds its model under "
                                                              f"{model_key!r}, which no strategy reshard knows writes")
    meta = FrameworkFile(FSDP_META, META_WHAT, fs.getsize(os.path.join(folder, FSDP_META)))
    return Framework(NAME, folder, (meta,), (), batch_note=BATCH, backend=backend, state=load_meta(folder),
                     deepspeed_tag=DEEPSPEED_TAG)


def load_meta(folder: str) -> dict:
    """meta.pt, through the restricted unpickler (nothing in it runs; a tensor in it is a TensorRef)."""
    path = os.path.join(folder, FSDP_META)
    meta = torchsave_read.load(path)
    if not isinstance(meta, dict) or VERSION_KEY not in meta:
        raise CheckpointError(path, f"not Lightning's checkpoint dict (no {VERSION_KEY!r})")
    return meta


def crosses(frame: Framework, format_name: str) -> bool:
    """Does an output of `format_name` (one a framework resumes from) put Lightning's run under the other strategy
    (DeepSpeed <-> FSDP), its state moving between DeepSpeed's client state and meta.pt?"""
    return frame.name == NAME and (format_name == "fsdp") != (frame.backend in MODEL_KEY)


def model_key(frame: Framework) -> str:
    """The model's top-level key in the DCP folder written for `frame`'s run: its own strategy's, FSDPStrategy's
    for a run coming from DeepSpeedStrategy."""
    return MODEL_KEY.get(frame.backend, FSDP_MODEL)
