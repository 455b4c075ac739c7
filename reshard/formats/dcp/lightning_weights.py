"""Lightning's weights-only form of FSDPStrategy's sharded checkpoint and ModelParallelStrategy's: what
`ModelCheckpoint(save_weights_only=True)` writes with that strategy (lightning 2.x:
`_CheckpointConnector.dump_checkpoint(weights_only=True)` leaves out callbacks, optimizer_states, lr_schedulers and
the precision plugin's state; `FSDPStrategy.save_checkpoint` then saves `{"model": state_dict}` alone by DCP, no
`optimizer_<i>` entry, and the rest, epoch, global_step, the version, loops and hyper-parameters, as meta.pt;
ModelParallelStrategy's the same under "state_dict", lightning 2.6.6's save_checkpoint).

The DCP folder is written again by the DCP writer (dcp/weights_only.py) under the strategy's model key, and meta.pt
again without those keys. The strategy's own load takes it where it loads no optimizer:
`trainer.validate/test/predict(model, ckpt_path=)` (FSDPStrategy.load_checkpoint loads `optimizer_<i>` only when
fitting, ModelParallelStrategy's only for the optimizers the strategy holds, none outside a fit; a fit from it fails,
as Lightning's weights-only checkpoints do).
"""
from __future__ import annotations

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.dcp import weights_only
from reshard.formats.framework import framework_of, lightning
from reshard.formats.torchsave_write import TorchFileBuilder
from reshard.formats.weights_only import Form

LOAD = ("trainer.validate(model, ckpt_path=<ckpt>) (or test, predict) with FSDPStrategy(state_dict_type=\"sharded\") "
        "or ModelParallelStrategy, as it was saved")
NOT_WEIGHTS = ("callbacks", "optimizer_states", "lr_schedulers")    # dump_checkpoint's, with weights_only=False only


def form(catalog: Catalog, path: str, keep_masters: bool) -> Form:
    """The `*.ckpt/` folder `path` written again as the model alone, with meta.pt less what weights_only drops."""
    weights_only.check_full(catalog, path)
    frame = framework_of(catalog)
    if frame is None or frame.backend not in lightning.MODEL_KEY or frame.state is None:
        raise ReshardError.at(path, "thinning is built for FSDPStrategy's sharded folder and ModelParallelStrategy's "
                                    "(model key \"model\" or \"state_dict\", and meta.pt) only")
    model, master = catalog.weight_dtypes()
    if keep_masters and master and model != master:
        raise ReshardError.at(path, f"--keep-masters: the strategy saves the {model} weights its module holds; "
                                    "writing its fp32 masters there is not built")
    # (the precision plugin's state is saved under its class name: a key holding "Precision")
    meta = TorchFileBuilder(lightning.FSDP_META, archive=lightning.FSDP_META.removesuffix(".pt")).build(
        {k: v for k, v in frame.state.items() if k not in NOT_WEIGHTS and "Precision" not in k})
    files = [*weights_only.model_files(catalog, lightning.model_key(frame)), meta]
    return Form((), (*weights_only.replaced(catalog), lightning.FSDP_META),
                "the optimizer state (optimizer_0), its LR schedulers and callbacks' state: the model's state dict "
                "written alone", LOAD, tuple(files))
