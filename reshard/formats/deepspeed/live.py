"""The layout of a live DeepSpeed engine: what a checkpoint must look like for its `load_checkpoint`.

The engine's own config is the target's (zero settings, precision, AutoTP size), so the files written for it
follow what this engine does, not what the source's engine did.
"""
from __future__ import annotations

from reshard.core.layout import Layout
from reshard.errors import ReshardError
from reshard.formats.deepspeed.topology import DeepSpeedTopology

LIVE_FORMAT = "deepspeed"       # the files a live engine loads are DeepSpeed's own, whatever the source's format


def engine_layout(engine) -> Layout:
    """The topology, precision and ZeRO options of `engine` (a deepspeed.DeepSpeedEngine, PipelineEngine too)."""
    # DeepSpeed keeps the config it was given, parsed, here; it has no public accessor
    config = dict(engine._config._param_dict)
    method = getattr(engine.module, "partition_method", None)      # a PipelineModule's: how its layers were cut
    heads = getattr(getattr(engine.module, "config", None), "num_key_value_heads", None)    # AutoTP cuts by them
    own = DeepSpeedTopology(zero=engine.zero_optimization_stage(), ds_config=config,
                            elastic=bool(engine.zero_elastic_checkpoint()),
                            bf16_optimizer=type(engine.optimizer).__name__ == "BF16_Optimizer",
                            partition_method=method if isinstance(method, str) else None,
                            kv_heads=heads if isinstance(heads, int) else None,
                            ep=_expert_parallel_degree(engine) if getattr(engine, "has_moe_layers", False) else None)
    dtype = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else "float32"
    grid = getattr(engine, "grid", None)
    if grid is not None:        # a PipelineEngine: its model parallelism is pipe x tensor (slice)
        tp, pp = grid.get_slice_parallel_world_size(), grid.get_pipe_parallel_world_size()
    else:
        tp, pp = engine.mp_world_size, 1
    return Layout.of(engine.dp_world_size, tp, pp, dtype=dtype, format_topology=own)


def _expert_parallel_degree(engine) -> int:
    """The size of the expert-parallel group of this engine's expert param groups (`moe: True`, named by DeepSpeed),
    looked up by name: the process's table of those groups keeps every other engine's too."""
    import torch.distributed as dist
    names = {group["name"] for group in engine.optimizer.param_groups if group.get("moe")}
    sizes = {dist.get_world_size(engine.expert_parallel_group[name]) for name in names}
    if len(sizes) != 1:
        raise ReshardError(f"the engine's expert param groups {sorted(names)} do not have one expert-parallel "
                           "degree; reshard writes one ep for all")
    return sizes.pop()
