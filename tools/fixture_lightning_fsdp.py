"""Make fixtures/lightning_fsdp_dp2/step=3.ckpt: what Lightning's FSDPStrategy(state_dict_type="sharded") writes at 2
processes (a DCP folder of `model.*` and `optimizer_0.*`, and Lightning's meta.pt).

    python tools/fixture_lightning_fsdp.py [--out fixtures]

One torchrun launch (2 processes, CPU, gloo) of tests/scripts/lightning_fsdp.py's save job: the TinyLM LightningModule
of tests/scripts/lightning_deepspeed.py trained 3 steps with AdamW and a per-step StepLR, saved by ModelCheckpoint;
FSDP1 on CPU through the test-only shim in tests/helpers/cpu_fsdp.py, so every file is Lightning's and torch's own.
Versions: lightning 2.6.6, torch 2.13.
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

STEPS = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "fixtures"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        jobs, results = os.path.join(work, "jobs.json"), os.path.join(work, "results.json")
        with open(jobs, "w") as f:
            json.dump([{"mode": "save", "dir": os.path.join(work, "run"), "seed": 0, "steps": STEPS}], f)
        proc = torchrun_jobs.launch(2, [os.path.join(REPO, "tests", "scripts", "lightning_fsdp.py"), jobs, results],
                                    {**os.environ, "OMP_NUM_THREADS": "1",
                                     "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tools")])})
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            return 1
        target = os.path.join(args.out, "lightning_fsdp_dp2", f"step={STEPS}.ckpt")
        shutil.rmtree(os.path.dirname(target), ignore_errors=True)
        shutil.copytree(os.path.join(work, "run", f"step={STEPS}.ckpt"), target)
        print("wrote", target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
