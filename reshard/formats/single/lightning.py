"""A Lightning `.ckpt` (Trainer.save_checkpoint / ModelCheckpoint): a torch.save zip of a dict.

`state_dict` is the LightningModule's (keys prefixed by its attributes), `optimizer_states` a list
of torch.optim state dicts (one per optimizer from configure_optimizers), `lr_schedulers` their
scheduler state dicts, `epoch`/`global_step` the loop counters; `loops`, `callbacks`, `hparams`...
are kept as plain data. The LightningModule's parameters() order (= state dict order minus buffers
and ties) is the optimizer's order when configure_optimizers passes self.parameters().
"""
from __future__ import annotations

from reshard.core.catalog import Catalog, CatalogBuilder, TrainingState
from reshard.core.layout import Layout
from reshard.errors import CheckpointError
from reshard.formats import torchsave_read
from reshard.formats.protocol import NoOptions
from reshard.formats.single import model
from reshard.formats.single.notes import SingleNotes
from reshard.formats.single.torchsave_checkpoint import is_optimizer, is_state_dict
from reshard.formats.unpartitioned import UNPARTITIONED
from reshard.storage import files as fs

SUFFIX = ".ckpt"
KNOWN = ("state_dict", "optimizer_states", "lr_schedulers")
FORMAT = "lightning"
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = False


def sniff(path: str, tag: str | None) -> bool:
    return fs.isfile(path) and path.endswith(SUFFIX)


def read(path: str, options: NoOptions) -> Catalog:
    path = fs.abspath(path)
    obj = torchsave_read.load(path)
    if not isinstance(obj, dict) or not is_state_dict(obj.get("state_dict")):
        raise CheckpointError(path, "not a Lightning checkpoint (no 'state_dict' of tensors)")
    optimizers = obj.get("optimizer_states") or []
    if len(optimizers) > 1:
        raise CheckpointError(path, f"{len(optimizers)} optimizers; only checkpoints of one optimizer can be mapped")
    if optimizers and not is_optimizer(optimizers[0]):
        raise CheckpointError(path, "optimizer_states[0] is not a torch.optim state_dict")
    catalog = CatalogBuilder(root=path, format="lightning", layout=Layout.of(1, format_topology=UNPARTITIONED))
    model.add_file(catalog, path, "lightning_checkpoint")
    model.build(catalog, obj["state_dict"], path, optimizers[0] if optimizers else None, path)
    schedulers = list(obj.get("lr_schedulers") or [])
    catalog.notes = SingleNotes(lr_schedulers=schedulers, lightning={k: v for k, v in obj.items() if k not in KNOWN})
    step = obj.get("global_step")
    step = int(step) if isinstance(step, int) else (catalog.freeze().contents().step or 0)
    # one scheduler: the one DeepSpeed's engine keeps and reloads
    catalog.training = TrainingState(global_steps=step, lr_scheduler=schedulers[0] if len(schedulers) == 1 else None)
    return catalog.freeze()
