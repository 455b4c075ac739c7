"""torchrun launches of the test scripts (tests/scripts/) on free ports (tools/torchrun_jobs.py)."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torchrun_jobs
from tests.helpers.repo import REPO


def torchrun_env() -> dict:
    """The ranks' environment: the repository's root and tools/ importable (tests.helpers, torchrun_jobs)."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tools")]),
            "PYTHONHASHSEED": "0"}  # every rank orders universal optimizer states alike (engine_resume.py)


@functools.cache
def deepspeed_ops_ready() -> bool:
    """DeepSpeed's CPU comm op built once, in this one process, before the first ranks start: ranks that
    compile and load it side by side on a busy machine start their process groups minutes apart."""
    return torchrun_jobs.build_deepspeed_ops(torchrun_env())


def torchrun(world: int, *args, check: bool = True, deepspeed: bool = True, timeout: float = 1800,
             forked: bool = True):
    """`torchrun ARGS` at `world` ranks on a free port (tools/torchrun_jobs.py); the CompletedProcess.
    With `check`, a failure shows the end of its output; `deepspeed=False` for ranks that never import it.
    The ranks are forked from one server that imported torch and the frameworks once (tools/forked_ranks.py:
    what torchrun's workers see, without an agent and ~10 CPU-seconds of imports per launch); `forked=False`
    where torchrun itself is what a test is about."""
    if deepspeed:
        deepspeed_ops_ready()
    proc = torchrun_jobs.launch(world, args, torchrun_env(), timeout=timeout, forked=forked)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_torchrun(script: str, world: int, jobs, out: Path, stem: str):
    """Run tests/scripts/`script` under torchrun at `world` ranks on `jobs` (written as JSON); what it writes back."""
    jobs_path, results_path = out / f"jobs-{stem}.json", out / f"results-{stem}.json"
    jobs_path.write_text(json.dumps(jobs))
    torchrun(world, REPO / "tests" / "scripts" / script, jobs_path, results_path)
    return json.loads(results_path.read_text())
