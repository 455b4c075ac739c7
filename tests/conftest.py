"""Shared helpers: the committed fixtures (real DeepSpeed checkpoints) and their engine truth."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("RESHARD_FIXTURES", REPO / "fixtures"))
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "truth.json").exists()) if FIXTURES.exists() else []


def fixture_dir(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def truth_json(name: str) -> dict:
    return json.loads((FIXTURES / name / "truth.json").read_text())


def truth_tensors(name: str) -> dict:
    from safetensors.torch import load_file
    return load_file(str(FIXTURES / name / "truth.safetensors"))


def copy_fixture(name: str, dest: Path) -> Path:
    """A writable copy of a fixture's save dir, for tests that break it."""
    target = dest / name
    shutil.copytree(fixture_dir(name), target)
    return target


def tag_dir(save_dir: Path) -> Path:
    return save_dir / (save_dir / "latest").read_text().strip()


def run_cli(*args, check=None):
    """Run `python -m reshard ARGS` in a subprocess; returns CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_name(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    if not FIXTURE_NAMES:
        raise pytest.UsageError(f"no fixtures under {FIXTURES}; run tools/make_fixtures.py")


def run_engine_resume(world: int, jobs: list, out: Path, port: int) -> list:
    """Run tests/engine_resume.py under torchrun at `world` ranks on `jobs`; its results, one per job."""
    jobs_path, results_path = out / f"jobs-{world}.json", out / f"results-{world}.json"
    jobs_path.write_text(json.dumps(jobs))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "PYTHONHASHSEED": "0"}   # every rank orders universal optimizer states alike (engine_resume.py)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc_per_node", str(world), "--master_port", str(port + world),
                           str(REPO / "tests" / "engine_resume.py"), str(jobs_path), str(results_path)],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(results_path.read_text())
