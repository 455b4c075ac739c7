#!/usr/bin/env python
"""verl fixtures: a tiny Qwen2 actor and its critic trained and saved by verl 0.9.1's own FSDPCheckpointManager, CPU,
2 processes.

Usage::

    python tools/fixture_verl.py [--out DIR]

Made with verl 0.9.1 (``pip install --no-deps verl==0.9.1`` and the modules pyproject's dev extras name), torch
2.13.0+cpu, gloo. verl's trainer runs its workers under Ray; here each rank builds what verl's FSDP worker builds for
its actor (tools/verl_cpu.actor: FSDP1 with ``use_orig_params=False`` or FSDP2 by verl's ``apply_fsdp2``, AdamW,
a warmup schedule) and for its critic (tools/verl_cpu.critic: the same model as verl's value model, a token
classifier of one label, wrapped alike), trains each ``STEPS`` steps and calls its
``FSDPCheckpointManager.save_checkpoint`` as verl's trainer does (``RayPPOTrainer._save_checkpoint``: the actor's into
``<run>/global_step_3/actor``, then the critic's into ``global_step_3/critic``), then writes what the trainer writes
beside them: ``global_step_3/data.pt`` (the data loader's state) and, last, ``latest_checkpointed_iteration.txt``.
Written, per fixture:

    verl_fsdp{1,2}_dp2/global_step_3/{actor,critic}/{model,optim,extra_state}_world_size_2_rank_{0,1}.pt
    verl_fsdp{1,2}_dp2/global_step_3/{actor,critic}/huggingface/   (config, tokenizer; rank 0)
    verl_fsdp{1,2}_dp2/global_step_3/{actor,critic}/fsdp_config.json
    verl_fsdp{1,2}_dp2/global_step_3/data.pt
    verl_fsdp{1,2}_dp2/latest_checkpointed_iteration.txt
    verl_fsdp{1,2}_dp2/truth.json                         (versions, world size, FSDP version, step, losses)
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torchrun_jobs

REPO = Path(__file__).resolve().parent.parent

WORLD, STEPS = 2, 3
CONFIGS = {"verl_fsdp1_dp2": 1, "verl_fsdp2_dp2": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "fixtures" / "verl"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.worker:
        torchrun_jobs.run_rank(worker, Path(args.worker), CONFIGS[args.name])   # (leaves the group, ends the rank)
    for name in CONFIGS:
        stage = Path(tempfile.mkdtemp(prefix=f"{name}."))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "VERL_LOGGING_LEVEL": "WARNING"}
        torchrun_jobs.make_fixture(name, WORLD, [__file__, "--worker", stage, "--name", name], env, args.timeout,
                                   stage, Path(args.out) / name)
        print("wrote", Path(args.out) / name)
    return 0


def worker(out: Path, fsdp: int) -> None:
    import verl_cpu
    verl_cpu.install()
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step_dir = out / f"global_step_{STEPS}"
    losses = {}
    for role in verl_cpu.ROLES:     # the trainer's order: the actor's save, then the critic's
        model, optimizer, scheduler, manager = verl_cpu.role(role, fsdp)
        losses[role] = [verl_cpu.train_step(model, optimizer, scheduler, step, rank) for step in range(1, STEPS + 1)]
        manager.save_checkpoint(str(step_dir / role), global_step=STEPS)
        dist.barrier()
    if rank == 0:
        verl_cpu.save_trainer_files(out, STEPS)
        import transformers
        (out / "truth.json").write_text(json.dumps({
            "verl": verl_cpu.VERL, "torch": torch.__version__, "transformers": transformers.__version__,
            "world": dist.get_world_size(), "fsdp": fsdp, "step": STEPS, "losses": losses}, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    raise SystemExit(main())
