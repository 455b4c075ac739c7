"""The end every torchrun script of the tests (tests/scripts/) shares: DeepSpeed on the CPU, the script's `main`
run on this rank with its command-line arguments, the rank then ended by tools/torchrun_jobs.run_rank (the process
group left, also after an error, and the process exited at once). tests/ and tools/ are found by the PYTHONPATH the
launchers give (tests/helpers/torchrun.py's torchrun_env, the fixture tools' own)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

from torchrun_jobs import run_rank


def run_main(main: Callable[..., object], arguments: int | None = None) -> None:
    """`main` on sys.argv's first `arguments` arguments (all where None), then this rank ends."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")      # before main imports deepspeed: its CPU accelerator
    given = sys.argv[1:]
    run_rank(main, *(given if arguments is None else given[:arguments]))
