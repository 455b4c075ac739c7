"""The end every torchrun script of the tests (tests/scripts/) shares: DeepSpeed on the CPU, the script's `main`
run on this rank with its command-line arguments, the rank then ended by tools/torchrun_jobs.run_rank (the process
group left, also after an error, and the process exited at once). tests/ and tools/ are found by the PYTHONPATH the
launchers give (tests/helpers/torchrun.py's torchrun_env, the fixture tools' own)."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from torchrun_jobs import run_rank


def run_main(main: Callable[..., object], arguments: int | None = None) -> None:
    """`main` on sys.argv's first `arguments` arguments (all where None), then this rank ends."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")      # before main imports deepspeed: its CPU accelerator
    given = sys.argv[1:]
    run_rank(main, *(given if arguments is None else given[:arguments]))


def gloo_jobs(job: Callable[[dict], object], jobs_path: str, results_path: str) -> None:
    """A launch running several jobs on every rank (gloo): `job` of each of JOBS_PATH's JSON list in turn, rank 0's
    results written to RESULTS_PATH as a JSON list, the ranks together at the end."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    results = [job(each) for each in json.loads(open(jobs_path).read())]
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
