#!/usr/bin/env python
"""torchtitan fixture: a tiny Llama 3 trained and saved by torchtitan 0.3.0's own components on CPU, 2 processes.

Usage::

    python tools/fixture_torchtitan.py [--out DIR]

Made with torchtitan 0.3.0 (``pip install --no-deps torchtitan==0.3.0`` and the dependencies pyproject's dev extras
name), torch 2.13.0+cpu, gloo. torchtitan's Trainer does not run on a CPU-only torch (tools/torchtitan_cpu.py says
why), so this launches ``torchrun --nproc_per_node 2 tools/fixture_torchtitan.py --worker`` and each rank builds what
the Trainer builds (tools/torchtitan_cpu.components: torchtitan's Llama 3 model code with fused QKV as every llama3
flavor, wrapped by torchtitan's apply_fsdp_to_decoder (FSDP2) on a 2-rank mesh; OptimizersContainer (AdamW),
LRSchedulersContainer (linear warmup), ParallelAwareDataloader, the Trainer's train_state counters) and its
CheckpointManager, trains ``STEPS`` steps as the Trainer does and lets the CheckpointManager save ``step-3/``:
one DCP folder holding the model (torchtitan's keys: the fused ``wqkv`` saved as ``wq``/``wk``/``wv`` by its
state_dict hook), the optimizer (flattened, FQN-keyed: ``optimizer.state.<fqn>.<state>``), ``lr_scheduler``,
``dataloader`` (per dp rank) and ``train_state``.

Beside ``checkpoint/step-3/`` rank 0 writes ``truth_forward.safetensors``: torchtitan's own forward (FSDP2, both
ranks) of the saved weights on a fixed batch (``tokens``, 2×8 ids) and its ``logits``, what an export to Hugging Face
must reproduce; and ``truth.json`` (versions, world size, steps, losses, model shape).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torchrun_jobs

REPO = Path(__file__).resolve().parent.parent

WORLD, SAVE_STEP, FORWARD_SEED = 2, 3, 99
# name -> fuse_qkv: torchtitan's llama3 flavors fuse q, k and v into one `wqkv` parameter (FusedQKVLinear), whose
# optimizer state reshard places on the model's wq/wk/wv given the key-value head count, which the save does not
# record (`--config`, tests/formats/dcp/test_torchtitan.py); `_build_llama3_layers(fuse_qkv=False)` holds them as three
# (QKVLinear), and the model and optimizer name the same parameters. Both are one run (same seeds and batches).
CONFIGS = {"torchtitan_llama_fsdp2": False, "torchtitan_llama_fused_fsdp2": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "fixtures" / "torchtitan"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torchrun_jobs.run_rank(worker, Path(args.worker), CONFIGS[args.name])   # (leaves the group, ends the rank)
    for name in CONFIGS:
        final = Path(args.out) / name
        stage = Path(tempfile.mkdtemp(prefix=f"{name}."))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        torchrun_jobs.make_fixture(name, WORLD, [__file__, "--worker", stage, "--name", name], env, args.timeout,
                                   stage, final)
    return 0


def worker(out: Path, fuse_qkv: bool) -> None:
    import torchtitan_cpu
    torchtitan_cpu.install()
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    dist.init_process_group("gloo")
    model, optimizers, lr_schedulers, dataloader, train_state, checkpointer = torchtitan_cpu.components(
        str(out / "checkpoint"), fuse_qkv=fuse_qkv)
    losses = torchtitan_cpu.train_steps(model, optimizers, lr_schedulers, iter(dataloader), train_state, SAVE_STEP)
    checkpointer.save(curr_step=SAVE_STEP)
    checkpointer.close()
    tokens = torch.randint(0, torchtitan_cpu.VOCAB, (2, torchtitan_cpu.SEQ),
                           generator=torch.Generator().manual_seed(FORWARD_SEED))
    with torch.no_grad():
        logits = torchtitan_cpu.forward(model, tokens)
    if dist.get_rank() == 0:
        save_file({"tokens": tokens, "logits": logits.contiguous()}, str(out / "truth_forward.safetensors"))
        import torchtitan
        t = torchtitan_cpu
        (out / "truth.json").write_text(json.dumps({
            "torchtitan": getattr(torchtitan, "__version__", "0.3.0"), "torch": torch.__version__,
            "world": dist.get_world_size(), "fuse_qkv": fuse_qkv, "step": SAVE_STEP, "losses": losses,
            "ntokens_seen": train_state.ntokens_seen,
            "model": {"dim": t.DIM, "n_heads": t.HEADS, "n_kv_heads": t.KV_HEADS, "n_layers": t.LAYERS,
                      "hidden_dim": t.HIDDEN, "vocab_size": t.VOCAB, "rope_theta": t.ROPE_THETA,
                      "norm_eps": t.NORM_EPS}}, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    raise SystemExit(main())
