"""A model alone (weights without optimizer state: a Hugging Face folder, a safetensors file) as the weights-only
DeepSpeed ZeRO-1/2 tag folder that `engine.load_checkpoint(dir, load_module_only=True)` starts a run from.

DeepSpeed 0.19.8's module-only load of a ZeRO-1/2 save reads the model-states file alone: `module` (loaded strict
into the engine's module), `dp_world_size`, and, for frozen params, `frozen_param_fragments`; the optimizer's fp32
masters are then taken from the loaded weights (`refresh_fp32_params`, `_restore_from_bit16_weights`), so no
`*_optim_states.pt` file is read and none is written. The model-states file is the one a DeepSpeed engine training
every param in one param group writes (the weights in the model's dtype, `param_shapes` of that group, no frozen
params: the training script decides what it trains and how it groups it), beside `latest`. The model's dtype is
that of most of its elements; a tensor of another dtype (an int64 position table, an fp32 scale beside bf16
weights: what a module's state dict holds as buffers) is written as it is, outside the param group. The tag folder holds
reshard's weights-only record (weights_only.PROVENANCE), by which it is read back as weights-only on purpose and
not as a save whose optimizer files are missing.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

from reshard.core.catalog import MODULE, Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import TextFile
from reshard.errors import ReshardError
from reshard.formats import weights_only
from reshard.formats.deepspeed import rank_params, topology, zero12_writer
from reshard.formats.deepspeed.zero_target import ZeroTarget, closing_files

LOAD = "engine.load_checkpoint(dir, load_module_only=True, load_optimizer_states=False)"


def target_files(catalog: Catalog, target: Layout, tag: str) -> list:
    zero = topology.of(target).zero
    if zero not in (1, 2):
        raise ReshardError.at(catalog.root, f"no optimizer state (weights only): written as DeepSpeed's ZeRO-1/2 "
                              f"module files, which {LOAD} starts from (asked: zero={zero}; ZeRO-3 keeps its "
                              "weights in the optimizer's fp32 partitions)")
    if (target.tp, target.pp) != (1, 1) or catalog.experts is not None:
        raise ReshardError.at(catalog.root, "no optimizer state (weights only): written at tp=1, pp=1 without "
                              f"expert parallelism only (asked: tp={target.tp}, pp={target.pp})")
    dtype = _model_dtype(catalog)
    # (the config the model-states file records names the stage, whose module files the reader then takes)
    own = topology.of(target)
    config = own.ds_config or {"zero_optimization": {"stage": zero}}
    target = dataclasses.replace(target, dtype=dtype, format_topology=dataclasses.replace(own, ds_config=config))
    whole = rank_params.whole(catalog)
    trained = tuple(dataclasses.replace(p, kind="trainable", group=0) if p.module_dtype == dtype else
                    dataclasses.replace(p, kind="buffer", group=None) for p in whole.params)
    params = dataclasses.replace(whole, params=trained,
                                 groups=(tuple(p.name for p in trained if p.kind == "trainable"),))
    zt = ZeroTarget(catalog, target)
    model = zero12_writer.model_states(zt, params, zero12_writer.flat_groups(zt, params), tag, {})
    record = weights_only.written_record(f"a weights-only {catalog.format} checkpoint", LOAD,
                                         weights_only.Trained(len(params.groups[0]), 0))
    return [model, TextFile(f"{tag}/{weights_only.PROVENANCE}", record), *closing_files(tag, None)]


def _model_dtype(catalog: Catalog) -> str:
    """The dtype most of the model's elements are in: the weights'."""
    elements: Counter[str] = Counter()
    for key, tensor in catalog.tensors.items():
        if key.state == MODULE:
            elements[tensor.dtype] += math.prod(tensor.shape)
    if not elements:
        raise ReshardError.at(catalog.root, "holds no model weights to write")
    return elements.most_common(1)[0][0]
