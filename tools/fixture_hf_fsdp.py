"""Make fixtures/hf_fsdp_*_dp2/checkpoint-3: what the real Hugging Face Trainer writes with FSDP at 2 processes.

    python tools/fixture_hf_fsdp.py [--out fixtures]
    python tools/fixture_hf_fsdp.py --bench DIR     # DIR/checkpoint-1: a 60M-parameter Llama, sharded (benchmarks)

One torchrun launch (2 processes, CPU, gloo) of tests/scripts/hf_trainer_fsdp.py: a tiny random Llama (vocab 64, hidden
16, 2 layers) trained 3 steps by transformers.Trainer with `fsdp=True` and each of FSDP's state dict types, the tiny
word-level tokenizer as its processing_class; Accelerate's FSDP on CPU through the test-only shim
tests/helpers/cpu_fsdp.py (the GPU branch of AcceleratorState), so every file is the Trainer's and Accelerate's own:

    hf_fsdp_sharded_dp2/checkpoint-3   SHARDED_STATE_DICT: pytorch_model_fsdp_0/, optimizer_0/ (DCP), scheduler.pt,
                                       rng_state_{0,1}.pth, trainer_state.json
    hf_fsdp_full_dp2/checkpoint-3      FULL_STATE_DICT: pytorch_model_fsdp.bin, optimizer.bin, model.safetensors,
                                       config.json, generation_config.json, the tokenizer's files, scheduler.pt,
                                       rng_state_{0,1}.pth, trainer_state.json, training_args.bin

No truth is written beside them: the tests read it from the files with torch's own tools (dcp_to_torch_save,
torch.load), independently of reshard. Versions: transformers 5.21.0, accelerate 1.16, torch 2.13.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torchrun_jobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KINDS = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}
STEPS = 3
# docs/performance.md's FSDP figures: 60,039,680 parameters, 230 MB of weights and 459 MB of Adam moments
BENCH = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 64}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "fixtures"))
    parser.add_argument("--bench", help="write only the benchmark's checkpoint, DIR/checkpoint-1")
    args = parser.parse_args()
    if args.bench:
        return run([{"out": args.bench, "state_dict_type": KINDS["sharded"], "max_steps": 1, "save_steps": 1,
                     "config": BENCH}], args.bench)
    with tempfile.TemporaryDirectory() as work:
        runs = [{"out": os.path.join(work, kind), "state_dict_type": sdt, "max_steps": STEPS, "save_steps": STEPS,
                 "tokenizer": True} for kind, sdt in KINDS.items()]
        if run(runs, work):
            return 1
        for kind in KINDS:
            target = os.path.join(args.out, f"hf_fsdp_{kind}_dp2", f"checkpoint-{STEPS}")
            shutil.rmtree(os.path.dirname(target), ignore_errors=True)
            shutil.copytree(os.path.join(work, kind, f"checkpoint-{STEPS}"), target)
            print("wrote", target)
    return 0


def run(runs: list, work: str) -> int:
    """One torchrun launch of tests/scripts/hf_trainer_fsdp.py at 2 processes doing `runs`; 0 when each trained FSDP."""
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "job.json"), "w") as f:
        json.dump({"runs": runs}, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tools")])}
    proc = torchrun_jobs.launch(2, [os.path.join(REPO, "tests", "scripts", "hf_trainer_fsdp.py"),
                                    os.path.join(work, "job.json"),
                                    os.path.join(work, "result.json")], env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return 1
    with open(os.path.join(work, "result.json")) as f:
        done = json.load(f)["runs"]
    assert all(r["distributed_type"] == "DistributedType.FSDP" for r in done), done
    return 0


if __name__ == "__main__":
    sys.exit(main())
