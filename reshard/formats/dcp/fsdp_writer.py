"""Catalog x target Layout -> the folders Accelerate's FSDP writes with SHARDED_STATE_DICT (framework/fsdp.py), which
the Hugging Face Trainer (`trainer.train(resume_from_checkpoint=)`) and Accelerate (`load_state`) load with FSDP:
`pytorch_model_fsdp_0/` holding `model.<fqn>` (planner path ("model", fqn)) and `optimizer_0/` holding
`optimizer.state.<fqn>.<state>` and `optimizer.param_groups.<g>.<hyper>` (planner paths ("optimizer", ...)), each a
DCP folder cut along dim 0 over the target's dp ranks (dcp/writer.py). The framework's own files (trainer state,
scheduler, per-process RNG) are the registry's to add (formats.with_framework): this writer is RESUMED_BY_FRAMEWORKS.
What reshard's DCP output carries beyond the two state dicts (`reshard.*` counters) is left out: the Trainer keeps
its counters in trainer_state.json.

Where the framework around the source is Lightning, the output is FSDPStrategy's sharded folder instead
(framework/lightning.py): one DCP folder of `model.<fqn>` and `optimizer_0.*` (planner paths ("model", fqn) and
("optimizer_0", ...)), which `trainer.fit(ckpt_path=)` loads with FSDPStrategy(state_dict_type="sharded"); its
meta.pt is the framework's file, carried as the registry says.
"""
from __future__ import annotations

from dataclasses import replace

from reshard.core.catalog import Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import Output
from reshard.formats import weights_only
from reshard.formats.dcp import keys, writer as dcp_writer
from reshard.formats.framework import framework_of, lightning
from reshard.formats.framework.fsdp import MODEL_DIR, OPTIM_DIR
from reshard.formats.torchsave_write import TorchFileBuilder

MODEL, OPTIMIZER = "model", "optimizer"      # accelerate's save_fsdp_model / save_fsdp_optimizer top-level keys
PLACES_EXPERTS = False
RESUMED_BY_FRAMEWORKS = True
SAVES_OWN_NAMES = False
OWN_RANK_STATE = False


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    dcp_writer.check_target(target)
    weights_only.needs_optimizer(catalog, "a framework's FSDP folder")
    frame = framework_of(catalog)
    if frame is not None and frame.name == lightning.NAME:
        model, optim, values = _entries(catalog, lightning.model_key(frame), lightning.FSDP_OPTIMIZER)
        files = dcp_writer.folder_files(catalog, target.dp, tag, "", model + optim, values)
        if lightning.crosses(frame, "fsdp") and frame.state:
            # from DeepSpeedStrategy: its client state is the dict FSDPStrategy saves as meta.pt (rank 0's)
            meta = TorchFileBuilder(lightning.FSDP_META, archive=lightning.FSDP_META.removesuffix(".pt"))
            files.append(meta.build(dict(frame.state)))
        return files
    model, optim, values = _entries(catalog, MODEL, OPTIMIZER)
    return [*dcp_writer.folder_files(catalog, target.dp, tag, MODEL_DIR, model, []),
            *dcp_writer.folder_files(catalog, target.dp, tag, OPTIM_DIR, optim, values)]


def _entries(catalog: Catalog, model_key: str, optim_key: str) -> tuple[list, list, list]:
    """The model's and the optimizer's tensor entries (with their planner paths) and the optimizer's values, under
    the framework's top-level keys."""
    model, optim = [], []
    for entry in keys.tensor_entries(catalog):
        if entry.key.startswith(f"{keys.MODEL}."):
            model.append((replace(entry, key=f"{model_key}.{entry.name}"), (model_key, entry.name)))
            continue
        state = entry.key[len(f"{keys.OPTIM}.state.{entry.name}."):]      # the name is the entry's, not split out
        optim.append((replace(entry, key=f"{optim_key}.state.{entry.name}.{state}"),
                      (optim_key, "state", entry.name, state)))
    values = []
    for value in keys.value_entries(catalog):
        if value.path[0] == keys.OPTIM:
            path = (optim_key, *value.path[1:])
            values.append(replace(value, key=".".join(str(p) for p in path), path=path))
    return model, optim, values


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
