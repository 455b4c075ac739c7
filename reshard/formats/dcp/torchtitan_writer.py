"""Catalog x target Layout -> a torchtitan checkpoint folder (`step-N/`, torchtitan.py) that its CheckpointManager
loads (`CheckpointManager.load`, dcp.load of its flat state dict): the model under its bare FQNs, the optimizer as
torchtitan's flat FQN-keyed dict (`optimizer.state.<fqn>.<state>`, `optimizer.param_groups.<fqn>.<hyper>`), each
tensor cut along dim 0 over the target's dp ranks as FSDP2 shards it (dcp/writer.py), and a torchtitan source's own
entries (lr_scheduler, dataloader, train_state) copied as they were saved. A source that is not torchtitan's has
none: torchtitan's load then needs them excluded (`checkpoint.exclude_from_loading`). What reshard's DCP output
carries beyond (`reshard.*` counters) is left out: torchtitan keeps its counters in train_state.

A model alone (a Hugging Face Llama folder brought to torchtitan's FQNs by `--names torchtitan-llama` read backwards,
reshard.rules.import_names) has no optimizer and no entries of torchtitan's own: the folder is the model's state dict
alone, in the model's dtype, which is what `checkpoint.last_save_model_only` writes and what torchtitan's model-only
load (`checkpoint.initial_load_path`) starts a run from.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from reshard.core.catalog import Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import Output
from reshard.errors import ReshardError
from reshard.formats.dcp import keys, writer as dcp_writer
from reshard.formats.dcp.reader import DcpNotes
from reshard.formats.dcp.torchtitan import OPTIMIZER
from reshard.rules.export_names import ModelFacts

PLACES_EXPERTS = False
RESUMED_BY_FRAMEWORKS = False
SAVES_OWN_NAMES = False        # it saves under the model's own FQNs
OWN_RANK_STATE = False
TIED = "tie_word_embeddings"   # a Hugging Face config's tie, which a model imported from one carries (import_names)


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    dcp_writer.check_target(target)
    fused = catalog.notes.fused if isinstance(catalog.notes, DcpNotes) else ()
    if fused:       # its optimizer keys the fused parameter: q, k and v would have to be interleaved back
        raise ReshardError.at(catalog.root, f"torchtitan's fused q/k/v ({len(fused)} wqkv parameters) is not written "
                                            "back to torchtitan yet: its optimizer keeps wqkv's state, not wq's, wk's "
                                            "and wv's (--format dcp writes the three)")
    facts: Mapping[str, Any] = catalog.notes.hyperparameters() if isinstance(catalog.notes, ModelFacts) else {}
    if facts.get(TIED):     # (the Hugging Face folder holds the embedding once; torchtitan's model both names)
        raise ReshardError.at(catalog.root, f"{TIED}: a model whose output layer is its embedding is not written to "
                                            "torchtitan yet (its lm_head.weight would be missing)")
    tensors: list[tuple] = []
    for entry in keys.tensor_entries(catalog):
        if entry.key.startswith(f"{keys.MODEL}."):
            tensors.append((replace(entry, key=entry.name), (entry.name,)))
            continue
        state = entry.key[len(f"{keys.OPTIM}.state.{entry.name}."):]      # the name is the entry's, not split out
        flat = f"state.{entry.name}.{state}"
        tensors.append((replace(entry, key=f"{OPTIMIZER}.{flat}"), (OPTIMIZER, flat)))
    values = []
    for group in catalog.param_groups:         # torchtitan's get_flat_optim_state_dict: each param its group's
        for name in group["params"]:
            for hyper, value in group.items():
                if hyper != "params":
                    flat = f"param_groups.{name}.{hyper}"
                    values.append(keys.ValueEntry(f"{OPTIMIZER}.{flat}", (OPTIMIZER, flat), value))
    own = catalog.notes.own if isinstance(catalog.notes, DcpNotes) else ()
    return dcp_writer.folder_files(catalog, target.dp, tag, "", tensors, values,
                                   [(e.key, e.path, e.blob) for e in own])


output_tag = dcp_writer.output_tag     # (a DCP folder has no tag)


def describe(target: Layout, tag: str) -> Output:
    """torchtitan's step-N folder for dp ranks; no ZeRO stage, no tag."""
    return Output("torchtitan", f"dp={target.dp}")


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    if catalog.layout.dp == target.dp:
        return None
    return (f"the global batch follows the data-parallel ranks ({catalog.layout.dp} -> {target.dp}) unless "
            "training.global_batch_size is set; torchtitan resumes its data loaders only at the size that saved "
            "them: exclude them (checkpoint.exclude_from_loading = [\"dataloader\"])")
