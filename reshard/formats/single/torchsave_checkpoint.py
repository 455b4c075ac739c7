"""A torch.save file (.pt/.pth/.bin) holding a model state dict, alone or with its optimizer.

Recognised shapes: the state dict itself ({name: tensor}); or a dict holding it under one of
MODEL_KEYS, with optionally a torch.optim state dict under one of OPTIMIZER_KEYS; everything else
in the dict is kept as plain data (`catalog.notes.extra`). The legacy (non-zip) format is
refused by torchsave_read with a one-line message.
"""
from __future__ import annotations

from typing import TypeGuard

from reshard.core.catalog import Catalog, CatalogBuilder, TrainingState
from reshard.core.layout import Layout
from reshard.errors import CheckpointError
from reshard.formats import torchsave_read
from reshard.formats.protocol import NoOptions
from reshard.formats.single import model
from reshard.formats.single.notes import SingleNotes
from reshard.formats.torchsave_read import TensorRef
from reshard.formats.unpartitioned import UNPARTITIONED
from reshard.storage import files as fs

SUFFIXES = (".pt", ".pth", ".bin")
MODEL_KEYS = ("state_dict", "model", "module", "model_state_dict")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim")
SCHEDULER_KEYS = ("lr_scheduler", "scheduler")
ZIP_MAGIC, LEGACY_MAGIC = b"PK\x03\x04", b"\x80\x02"
FORMAT = "torch"
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = False


def sniff(path: str, tag: str | None) -> bool:
    if not (fs.isfile(path) and path.endswith(SUFFIXES)):
        return False
    with fs.open(path, "rb") as f:
        head = f.read(4)
    return head == ZIP_MAGIC or head[:2] == LEGACY_MAGIC or fs.getsize(path) == 0


def is_state_dict(obj) -> TypeGuard[dict]:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, TensorRef) for v in obj.values())


def is_optimizer(obj) -> bool:
    return isinstance(obj, dict) and "param_groups" in obj and "state" in obj


def split(path: str, obj) -> tuple:
    """(model state dict, optimizer state dict or None, the other entries) of a loaded torch.save file."""
    if is_state_dict(obj):
        return obj, None, {}
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"holds a {type(obj).__name__}, not a state dict")
    found = [k for k in MODEL_KEYS if is_state_dict(obj.get(k))]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} candidate"
        raise CheckpointError(path, f"{what} model state dict found (a dict of tensors, alone or under one of "
                              f"{', '.join(MODEL_KEYS)})")
    optim = [k for k in OPTIMIZER_KEYS if obj.get(k) is not None]
    if optim and not is_optimizer(obj[optim[0]]):
        raise CheckpointError(path, f"'{optim[0]}' is not a torch.optim state_dict (state, param_groups)")
    used = {found[0], *optim[:1]}
    return obj[found[0]], obj[optim[0]] if optim else None, {k: v for k, v in obj.items() if k not in used}


def read(path: str, options: NoOptions) -> Catalog:
    path = fs.abspath(path)
    module, optimizer, extra = split(path, torchsave_read.load(path))
    catalog = CatalogBuilder(root=path, format="torch", layout=Layout.of(1, format_topology=UNPARTITIONED))
    model.add_file(catalog, path, "state_dict")
    model.build(catalog, module, path, optimizer, path)
    catalog.notes = SingleNotes(extra=extra)
    scheduler = next((extra[k] for k in SCHEDULER_KEYS if isinstance(extra.get(k), dict)), None)
    step = catalog.freeze().contents().step
    catalog.training = TrainingState(global_steps=step or 0, lr_scheduler=scheduler)
    return catalog.freeze()
