"""Make fixtures/accelerate_{fsdp_sharded,fsdp_full,deepspeed_z2}_dp2: what the real Accelerate save_state writes at 2
processes with FSDP2 (sharded and full state dict) and with DeepSpeed ZeRO-2, for the same run.

    python tools/fixture_accelerate_fsdp.py [--out fixtures]
    python tools/fixture_accelerate_fsdp.py --bench DIR     # only docs/performance.md's FSDP sharded save, DIR/state

One torchrun launch (2 processes, CPU, gloo) of tests/scripts/accelerate_strategies.py: the tiny random Llama of
tests/scripts/hf_trainer_fsdp.py (vocab 64, hidden 16, 2 layers), AdamW in two param groups and a linear-warmup
scheduler, trained 3 steps on the same data by an Accelerate loop with a registered custom object, then
accelerator.save_state(dir). FSDP on CPU through the test-only shim tests/helpers/cpu_fsdp.py (the GPU branch of
AcceleratorState); every file is Accelerate's, DeepSpeed's and torch's own:

    accelerate_fsdp_sharded_dp2/state       FullyShardedDataParallelPlugin(fsdp_version=2, SHARDED_STATE_DICT):
                                            pytorch_model_fsdp_0/, optimizer_0/ (DCP), scheduler.bin,
                                            random_states_{0,1}.pkl, custom_checkpoint_0.pkl
    accelerate_fsdp_full_dp2/state          the same with FULL_STATE_DICT: pytorch_model_fsdp.bin (the gathered model
                                            state dict) and optimizer.bin (FSDP's full optimizer state dict, keyed by
                                            FQN), torch.save'd by process 0, beside Accelerate's same four files
    accelerate_deepspeed_z2_dp2/state       DeepSpeedPlugin(ZeRO-2): latest, pytorch_model/ (DeepSpeed's tag),
                                            zero_to_fp32.py, zero_to_torch.py and Accelerate's same four files
    accelerate_deepspeed_z2_dp2/truth.safetensors   the live engine's fp32 params and Adam moments right after
                                            the save (engine_state.engine_tensors): a ZeRO-2 folder's flat
                                            partitions have no reader of torch's own to take the truth from

The FSDP folders' truth is read by the tests with torch's dcp_to_torch_save and torch.load, independently of reshard.
Versions: accelerate 1.16.0, transformers 5.21.0, torch 2.13.0, DeepSpeed 0.19.8.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torchrun_jobs
from fixture_hf_fsdp import BENCH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = 3
# FSDP's first: Accelerate's state, reset between jobs, takes an FSDP plugin after a DeepSpeed job no more
FOLDERS = {"fsdp": "accelerate_fsdp_sharded_dp2", "fsdp_full": "accelerate_fsdp_full_dp2",
           "deepspeed": "accelerate_deepspeed_z2_dp2"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "fixtures"))
    parser.add_argument("--bench", help="write only the benchmark's FSDP sharded save (the 60M Llama of "
                                        "tools/fixture_hf_fsdp.py, one step), DIR/state")
    args = parser.parse_args()
    if args.bench:
        os.makedirs(args.bench, exist_ok=True)
        return 0 if launch([{"mode": "save", "strategy": "fsdp", "dir": os.path.join(args.bench, "state"), "steps": 1,
                             "config": BENCH}], args.bench) else 1
    with tempfile.TemporaryDirectory() as work:
        jobs = [{"mode": "save", "strategy": strategy.removesuffix("_full"),
                 "dir": os.path.join(work, strategy, "state"), "steps": STEPS,
                 "truth": os.path.join(work, strategy, "truth.safetensors") if strategy == "deepspeed" else None,
                 "state_dict_type": "FULL_STATE_DICT" if strategy.endswith("_full") else "SHARDED_STATE_DICT"}
                for strategy in FOLDERS]
        done = launch(jobs, work)
        if done is None:
            return 1
        assert [r["distributed_type"] for r in done] == ["DistributedType.FSDP", "DistributedType.FSDP",
                                                         "DistributedType.DEEPSPEED"], done
        assert all(r["problems"] == [] and r["counter"] == STEPS for r in done), done
        for strategy, folder in FOLDERS.items():
            target = os.path.join(args.out, folder)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(work, strategy), target)
            print("wrote", target)
    return 0


def launch(jobs: list, work: str) -> list | None:
    """One torchrun launch of tests/scripts/accelerate_strategies.py at 2 processes doing `jobs`: their results (None:
    it
    failed, its output's end on stderr)."""
    with open(os.path.join(work, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tools")])}
    proc = torchrun_jobs.launch(2, [os.path.join(REPO, "tests", "scripts", "accelerate_strategies.py"),
                                    os.path.join(work, "jobs.json"), os.path.join(work, "results.json")], env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return None
    with open(os.path.join(work, "results.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
