"""Load-time resharding, measured (issue #15): an FSDP2 model + AdamW loads a checkpoint with `dcp.load`.

    torchrun --nproc_per_node N tools/bench_load.py reader SRC OUT.json [--save-native DIR]
    torchrun --nproc_per_node N tools/bench_load.py native DCP_DIR OUT.json
    torchrun --nproc_per_node N tools/bench_load.py ds-reshard SRC OUT.json
    torchrun --nproc_per_node N tools/bench_load.py ds-native CONVERTED OUT.json
    torchrun --nproc_per_node N tools/bench_load.py ds-universal UNIVERSAL OUT.json
    torchrun --nproc_per_node N tools/bench_load.py moe-native CONVERTED OUT.json [EP]
    torchrun --nproc_per_node N tools/bench_load.py moe-universal UNIVERSAL OUT.json [EP]

`reader` loads SRC (any format reshard reads) through reshard.dcp_reader.Reader; `native` loads a DCP directory with
torch's own FileSystemReader. With --save-native, the loaded state is then saved by `dcp.save` (torch's own
writer): the same state, natively as DCP, for `native` to load. The model is an nn.Sequential of bias-free
Linear layers shaped like the checkpoint's `0.weight`, `1.weight`, ... (tools/bench.py make-synthetic).

`ds-reshard` / `ds-native`: a DeepSpeed ZeRO-3 bf16 engine of that model (tools/bench.py's config) at N ranks
loads SRC, saved at any topology, with reshard.deepspeed_engine.load_checkpoint, or, natively, with its own
engine.load_checkpoint a checkpoint already converted for N ranks; `ds-universal`: DeepSpeed's own
universal path, the engine with "load_universal" loading what its ds_to_universal made of SRC.
`moe-native` / `moe-universal`: the AutoEP Mixtral of tools/bench.py make-moe at ep EP (default 1) on N ranks
loads, with its own engine.load_checkpoint, a save converted for that ep and N, or (load_universal) a universal tree.

Each rank measures the load alone: wall time, bytes it read from disk (/proc/self/io read_bytes), bytes of the
tensors it loaded (its shards of params and optimizer states), its RSS before the load (the model and optimizer
states it loads into) and its peak RSS; rank 0 writes them to OUT.json.
"""
import json
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from torchrun_jobs import run_rank


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _model(shapes):
    with torch.device("meta"):      # each rank allocates only its shards
        layers = torch.nn.Sequential(*[torch.nn.Linear(shape[1], shape[0], bias=False) for shape in shapes])
    fully_shard(layers)
    return layers.to_empty(device="cpu")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def _local_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    return 0


def main(mode, src, out, *rest):
    torch.set_num_threads(1)
    if mode.startswith(("ds-", "moe-")):
        return deepspeed_load(mode, src, out, *rest)
    dist.init_process_group("gloo")
    if mode == "reader":
        import reshard.dcp_reader
        reader = reshard.dcp_reader.Reader(src)
        metadata = reader.read_metadata()
    else:
        reader = dcp.FileSystemReader(src)
        metadata = reader.read_metadata()
    weights = sorted((k for k in metadata.state_dict_metadata if k.startswith("model.")),
                     key=lambda k: int(k.split(".")[1]))
    model = _model([tuple(metadata.state_dict_metadata[k].size) for k in weights])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, optim)         # (makes the optimizer's states: their memory is the target)
    state = {"model": msd, "optim": osd}
    dist.barrier()
    rss = _rss_mib()
    before, start = _read_bytes(), time.perf_counter()
    dcp.load(state, storage_reader=reader)
    wall, read = time.perf_counter() - start, _read_bytes() - before
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    mine = {"wall_s": wall, "read_bytes": read, "loaded_bytes": _local_bytes(state),
            "rss_before_load_mib": rss, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rest and rest[0] == "--save-native":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=rest[1])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode, "source": src, "world": dist.get_world_size(), "ranks": everyone}, f, indent=1)


def deepspeed_load(mode, src, out, ep=1):
    import deepspeed

    import reshard.deepspeed_engine

    deepspeed.init_distributed(dist_backend="gloo")
    engine = _moe_engine(mode, int(ep)) if mode.startswith("moe-") else _stack_engine(mode, src)
    dist.barrier()
    rss = _rss_mib()
    before, start = _read_bytes(), time.perf_counter()
    if mode == "ds-reshard":
        reshard.deepspeed_engine.load_checkpoint(engine, src)
    else:
        engine.load_checkpoint(src)
    wall, read = time.perf_counter() - start, _read_bytes() - before
    mine = {"wall_s": wall, "read_bytes": read, "rss_before_load_mib": rss,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode, "source": src, "world": dist.get_world_size(), "ranks": everyone}, f, indent=1)


def _stack_engine(mode, src):
    import deepspeed

    import reshard
    from bench import HIDDEN, engine_config

    layers = len(reshard.open_checkpoint(src).order)     # (reshard reads universal trees too)
    config = engine_config(3, "bf16")
    if mode == "ds-universal":
        config["checkpoint"] = {"load_universal": True}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)])
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def _moe_engine(mode, ep):
    import deepspeed
    from transformers import MixtralForCausalLM

    from bench_checkpoints import moe_config, moe_engine_config

    config = moe_engine_config(ep)
    if mode == "moe-universal":
        config["checkpoint"] = {"load_universal": True}
    model = MixtralForCausalLM(moe_config())
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


if __name__ == "__main__":
    run_rank(main, *sys.argv[1:])
