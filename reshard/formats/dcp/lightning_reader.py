"""Lightning FSDPStrategy's sharded checkpoint (framework/lightning.py: a DCP folder of `model.<fqn>` and
`optimizer_0.*` with Lightning's meta.pt beside it) -> one Catalog: the DCP folder read as any other (dcp/reader.py,
the optimizer's keys meeting the model's through planner_data's FQNs), with Lightning's global step and LR scheduler
from meta.pt, read through the restricted unpickler (nothing in it is executed).
"""
from __future__ import annotations

from dataclasses import replace

from reshard.core.catalog import Catalog
from reshard.formats.dcp import reader as dcp_reader
from reshard.formats.framework.lightning import is_fsdp_sharded, load_meta
from reshard.formats.protocol import ConfigOption, NoOptions

FORMAT = "fsdp"      # written back by the fsdp writer, in the layout of the framework around it
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = True


def sniff(path: str, tag: str | None) -> bool:
    return is_fsdp_sharded(path)


def read(path: str, options: NoOptions) -> Catalog:
    catalog = dcp_reader.read(path, ConfigOption())
    return replace(catalog, format=FORMAT, training=replace(catalog.training, **counters(catalog.root)))


def counters(root: str) -> dict:
    """Lightning's global step and its one LR scheduler's state_dict (DeepSpeed's engine and reshard's other writers
    carry one), from meta.pt."""
    meta = load_meta(root)
    out: dict = {}
    step = meta.get("global_step")
    if isinstance(step, int) and not isinstance(step, bool):
        out["global_steps"] = step
    schedulers = meta.get("lr_schedulers")
    if isinstance(schedulers, list) and len(schedulers) == 1:
        out["lr_scheduler"] = schedulers[0]
    return out
