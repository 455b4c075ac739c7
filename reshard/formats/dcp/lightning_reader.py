"""Lightning's sharded checkpoints -> one Catalog: FSDPStrategy's (framework/lightning.py: a DCP folder of
`model.<fqn>` and `optimizer_0.*` with Lightning's meta.pt beside it) and ModelParallelStrategy's (its model under
`state_dict.<fqn>`). The DCP folder is read as any other (dcp/reader.py, the optimizer's keys meeting the model's
through planner_data's FQNs); the model's key says the strategy; Lightning's global step and LR scheduler come from
meta.pt, read through the restricted unpickler (nothing in it is executed).
"""
from __future__ import annotations

import os
from dataclasses import replace

from reshard.core.catalog import Catalog, CatalogBuilder
from reshard.core.layout import Layout
from reshard.errors import CheckpointError
from reshard.formats.dcp import metadata as md, reader as dcp_reader
from reshard.formats.dcp.chunks import METADATA, Chunks
from reshard.formats.framework import lightning
from reshard.formats.protocol import NoOptions
from reshard.storage import files as fs

FORMAT = "fsdp"      # written back by the fsdp writer, in the layout of the framework around it
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = False      # the framework is this reader's: its strategy is told by the DCP items' keys


def sniff(path: str, tag: str | None) -> bool:
    return lightning.is_fsdp_sharded(path)


def read(path: str, options: NoOptions) -> Catalog:
    root = fs.abspath(path)
    meta = md.read(os.path.join(root, METADATA))
    builder = CatalogBuilder(root, FORMAT, Layout.of(1), save_dir=root)
    catalog = dcp_reader.build(builder, meta, Chunks(root, meta, builder))
    tops = {key.split(".", 1)[0] for key in meta.state_dict_metadata}
    model_key = next((k for k in dcp_reader.MODEL_KEYS if k in tops), None)
    if model_key is None:
        raise CheckpointError(os.path.join(root, METADATA), "Lightning's folder holds no model (no 'model.' or "
                                                            "'state_dict.' items)")
    frame = lightning.sharded_framework(root, model_key)
    return replace(catalog, framework=frame, training=replace(catalog.training, **counters(frame.state or {})))


def counters(meta: dict) -> dict:
    """Lightning's global step and its one LR scheduler's state_dict (DeepSpeed's engine and reshard's other writers
    carry one), from meta.pt."""
    out: dict = {}
    step = meta.get("global_step")
    if isinstance(step, int) and not isinstance(step, bool):
        out["global_steps"] = step
    schedulers = meta.get("lr_schedulers")
    if isinstance(schedulers, list) and len(schedulers) == 1:
        out["lr_scheduler"] = schedulers[0]
    return out
