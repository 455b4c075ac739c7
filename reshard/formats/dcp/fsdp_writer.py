"""Catalog x target Layout -> the folders Accelerate's FSDP writes with SHARDED_STATE_DICT (framework/fsdp.py), which
the Hugging Face Trainer (`trainer.train(resume_from_checkpoint=)`) and Accelerate (`load_state`) load with FSDP:
`pytorch_model_fsdp_0/` holding `model.<fqn>` (planner path ("model", fqn)) and `optimizer_0/` holding
`optimizer.state.<fqn>.<state>` and `optimizer.param_groups.<g>.<hyper>` (planner paths ("optimizer", ...)), each a
DCP folder cut along dim 0 over the target's dp ranks (dcp/writer.py). The framework's own files (trainer state,
scheduler, per-process RNG) are the registry's to add (formats.with_framework): this writer is RESUMED_BY_FRAMEWORKS.
What reshard's DCP output carries beyond the two state dicts (`reshard.*` counters) is left out: the Trainer keeps
its counters in trainer_state.json.
"""
from __future__ import annotations

from dataclasses import replace

from reshard.core.catalog import Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import Output
from reshard.formats.dcp import keys, writer as dcp_writer
from reshard.formats.framework.fsdp import MODEL_DIR, OPTIM_DIR

MODEL, OPTIMIZER = "model", "optimizer"      # accelerate's save_fsdp_model / save_fsdp_optimizer top-level keys
PLACES_EXPERTS = False
RESUMED_BY_FRAMEWORKS = True
SAVES_OWN_NAMES = False


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    dcp_writer.check_target(target)
    model, optim = [], []
    for entry in keys.tensor_entries(catalog):
        if entry.key.startswith(f"{keys.MODEL}."):
            model.append((replace(entry, key=f"{MODEL}.{entry.name}"), (MODEL, entry.name)))
            continue
        state = entry.key[len(f"{keys.OPTIM}.state.{entry.name}."):]      # the name is the entry's, not split out
        optim.append((replace(entry, key=f"{OPTIMIZER}.state.{entry.name}.{state}"),
                      (OPTIMIZER, "state", entry.name, state)))
    values = []
    for value in keys.value_entries(catalog):
        if value.path[0] == keys.OPTIM:
            path = (OPTIMIZER, *value.path[1:])
            values.append(replace(value, key=".".join(str(p) for p in path), path=path))
    return [*dcp_writer.folder_files(catalog, target.dp, tag, MODEL_DIR, model, []),
            *dcp_writer.folder_files(catalog, target.dp, tag, OPTIM_DIR, optim, values)]


def output_tag(catalog, tag: str) -> str:
    return tag


def describe(target: Layout, tag: str) -> Output:
    """The framework's FSDP folders (the sharded state dict) for dp ranks; no ZeRO stage, no tag."""
    return Output("fsdp", f"dp={target.dp}")


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    """The global batch is the per-process batch times the processes (and accumulation): it follows dp unless the
    framework's settings change (formats.framework adds where it sets them)."""
    if catalog.layout.dp == target.dp:
        return None
    return (f"the global batch changes with the processes ({catalog.layout.dp} -> {target.dp}) unless the batch "
            "settings change")
