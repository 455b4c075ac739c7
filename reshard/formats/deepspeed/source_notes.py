"""What the DeepSpeed writers read of a source's notes beyond its tensors: one accessor per note.

Readers leave these on the Catalog (its `state` dict, `tp_splits`, `stages`); the writers take them only
through the functions here, so where the notes live can change in this one place.
"""
from __future__ import annotations

from reshard.catalog import Catalog

# the source's training state a model-states file carries over, as the engine names it
TRAINING_STATE = ("lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps", "global_samples",
                  "client_state", "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")


def ds_config(catalog: Catalog) -> dict:
    """The ds_config the source was saved with ({} when none)."""
    return catalog.state.get("ds_config") or {}


def ds_version(catalog: Catalog, default: str) -> str:
    return catalog.state.get("ds_version", default)


def training_state(catalog: Catalog) -> dict:
    """The source's counters, scheduler and loss-scaler state that the target's files carry (absent keys left out)."""
    return {key: catalog.state[key] for key in TRAINING_STATE if key in catalog.state}


def frozen_or_buffer(catalog: Catalog) -> list:
    """Names the source cannot tell frozen parameters from floating-point buffers by."""
    return catalog.state.get("frozen_or_buffer") or []


def pipe_layer_files(catalog: Catalog) -> dict:
    """A PipelineModule save's layer files: layer index -> [(key in the file, param name)] ({}: not a pipeline)."""
    return catalog.state.get("pipe_layer_files") or {}


def mp_rank_extra(catalog: Catalog) -> dict:
    """Per model-parallel rank, the keys its model-states file adds (universal_checkpoint_info, shared_params)."""
    return catalog.state.get("mp_rank_extra") or {}


def tp_rules(catalog: Catalog) -> str | None:
    """The rule file (--layout-rules) the source was read with."""
    return catalog.state.get("tp_rules")


def tp_splits(catalog: Catalog) -> dict:
    """name -> tp_geometry.Split: how the source's tensor parallelism cut each parameter."""
    return catalog.tp_splits


def stages(catalog: Catalog) -> dict:
    """name -> the source's pipeline stages whose optimizer trains it."""
    return catalog.stages
