"""The layout of a live DeepSpeed engine: what a checkpoint must look like for its `load_checkpoint`.

The engine's own config is the target's (zero settings, precision, AutoTP size), so the files written for it
follow what this engine does, not what the source's engine did.
"""
from __future__ import annotations

from reshard.errors import ReshardError
from reshard.core.layout import Layout

LIVE_FORMAT = "deepspeed"       # the files a live engine loads are DeepSpeed's own, whatever the source's format


def engine_layout(engine) -> Layout:
    """The topology, precision and ZeRO options of `engine` (a deepspeed.DeepSpeedEngine, PipelineEngine too)."""
    # DeepSpeed keeps the config it was given, parsed, here; it has no public accessor
    config = dict(engine._config._param_dict)
    options = {"ds_config": config}
    if engine.zero_elastic_checkpoint():
        options["elastic"] = True
    if type(engine.optimizer).__name__ == "BF16_Optimizer":
        options["bf16_optimizer"] = True
    method = getattr(engine.module, "partition_method", None)
    if isinstance(method, str):                  # a PipelineModule: how its layers were cut into stages
        options["partition_method"] = method
    heads = getattr(getattr(engine.module, "config", None), "num_key_value_heads", None)
    if isinstance(heads, int):                   # AutoTP cuts attention by key-value heads
        options["kv_heads"] = heads
    if getattr(engine, "has_moe_layers", False):
        options["ep"] = _expert_parallel_degree(engine)
    dtype = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else "float32"
    grid = getattr(engine, "grid", None)
    if grid is not None:        # a PipelineEngine: its model parallelism is pipe x tensor (slice)
        tp, pp = grid.get_slice_parallel_world_size(), grid.get_pipe_parallel_world_size()
    else:
        tp, pp = engine.mp_world_size, 1
    return Layout(dp=engine.dp_world_size, tp=tp, pp=pp, zero=engine.zero_optimization_stage(), dtype=dtype,
                  options=options)


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
