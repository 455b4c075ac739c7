"""What the DeepSpeed readers keep for the DeepSpeed writers: the catalog's format notes (catalog.FormatNotes).

A ZeRO, tensor/pipeline-parallel or universal save records engine state no other format has (its config,
the ZeRO optimizer's loss scaler, client state) and, when model-parallel, how it was cut (each parameter's
tensor-parallel boxes, its pipeline stages, the layer files). Writers read them through `of(catalog)`, which
gives empty notes for a source of another format (DCP, torch.save): then every field says "not saved".
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reshard.core.catalog import Catalog, CatalogBuilder

EXPERT_GROUP = "ep_size_"       # AutoEP names its expert param group by its ep (auto_ep_layer.ep_group_name)


@dataclass(frozen=True)
class DeepSpeedNotes:
    ds_config: Mapping[str, Any] | None = None      # the engine's config as saved
    ds_version: str | None = None
    data_sampler: object = None
    random_ltd: object = None
    client_state: Mapping[str, Any] = field(default_factory=dict)    # what the caller of save_checkpoint added
    # the ZeRO optimizer's global scalars (defaults: what DeepSpeed starts with)
    loss_scaler: object = None
    dynamic_loss_scale: object = False
    overflow: object = False
    clip_grad: object = 0.0
    saved_scalars: tuple = ()          # which of those four the optimizer file holds (ZeRO-3 keeps no clip_grad)
    tp_rules: str | None = None        # --layout-rules: how AutoTP/Megatron cut each parameter (tp_recut)
    # Model-parallel saves: per mp rank, what its model states add (universal_checkpoint_info, shared_params)
    mp_rank_extra: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    # name -> tp_geometry.Split (boxes each TP rank holds)
    tp_splits: Mapping[str, Any] = field(default_factory=dict)
    # name -> pipeline stages whose optimizer trains it
    stages: Mapping[str, Any] = field(default_factory=dict)
    # name -> (layer index, key in its layer file)
    layers: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    # a PipelineModule save: layer index -> [(key, full name or None when not a tensor)], in file order
    pipe_layer_files: Mapping[int, Any] = field(default_factory=dict)
    # A mixture-of-experts save: the model states' expert keys as saved (num_experts, ds_autoep_layers,
    # universal_checkpoint_info), in file order, which its writer re-derives for the target's expert parallelism
    expert_keys: Mapping[str, Any] = field(default_factory=dict)
    expert_files: tuple = ()        # experts.ExpertFile: every layer_L_expert_E file and what each key holds
    # module tensors that are no parameter of their own (a second name of a registered one, as AutoEP's router
    # alias `gate.gate`), saved as their own copy: ZeRO-2 lists them in no frozen_param_shapes
    unregistered: tuple = ()

    def layout_scalar(self, key: str, value) -> bool:
        """An expert group's name: it follows the expert parallelism (a conversion to another ep renames it)."""
        return bool(self.expert_keys) and key == "name" and isinstance(value, str) and \
            value.startswith(EXPERT_GROUP) and value[len(EXPERT_GROUP):].isdigit()

    def scalars(self) -> dict:
        return {**{key: getattr(self, key) for key in self.saved_scalars}, "client_state": self.client_state}

    def param_details(self, name: str) -> dict:
        out = {}
        if name in self.tp_splits:
            out["tensor_parallel"] = self.tp_splits[name].describe()
        if name in self.stages:
            out["stages"] = self.stages[name]
        return out


NONE = DeepSpeedNotes()
def of(catalog: Catalog | CatalogBuilder) -> DeepSpeedNotes:
    """The catalog's DeepSpeed notes; empty ones when another format's reader made it."""
    return catalog.notes if isinstance(catalog.notes, DeepSpeedNotes) else NONE
