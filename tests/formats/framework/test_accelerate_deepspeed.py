"""Accelerate + DeepSpeed: a real Accelerate loop with a DeepSpeed plugin at 2 processes (torchrun, CPU, gloo)
calls save_state(dir); reshard converts the whole folder to 1 and 3 processes and accelerator.load_state(dir)
at that size resumes exactly (tests/scripts/accelerate_deepspeed.py): the engine's fp32 params, both Adam moments and
module weights equal the truth the live engine gave at save time bit for bit, the engine's step, the LR
scheduler and a registered custom object continue. Without reshard the same load fails with DeepSpeed's error.
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.accelerate_schedule import scheduled_lr
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.pickles import check_pickles

pytestmark = pytest.mark.engine
SCRIPT = "accelerate_deepspeed.py"
STEPS = 3
# What Accelerate wrote beside DeepSpeed's `latest` and its tag folder `pytorch_model/` (accelerate 1.15)
ACCELERATE_FILES = {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"}
DEEPSPEED_FILES = {"latest", "pytorch_model", "zero_to_fp32.py", "zero_to_torch.py"}


@dataclass(frozen=True)
class Source:
    out: Path
    stage: int
    saved: dict         # what the save run reported (lr at save, the next lr at 2 processes)

    def __truediv__(self, name):
        return self.out / name


def job(source_out: Path, stage: int, mode: str, folder: Path) -> dict:
    return {"mode": mode, "dir": str(folder), "stage": stage, "steps": STEPS,
            "truth": str(source_out / "truth.safetensors"), "after": str(source_out / "after.safetensors")}


STAGES = (2, 3)
LOADS = (1, 3)      # the converted folder loaded at dp


@shares(SCRIPT)
def saves(out):
    """One save_state at 2 processes per ZeRO stage, in out/zero{stage}: (2, None, job)."""
    return [(2, None, job(out / f"zero{stage}", stage, "save", out / f"zero{stage}" / "state")) for stage in STAGES]


@pytest.fixture(scope="module", params=STAGES, ids=[f"zero{s}" for s in STAGES])
def source(request, engine_launches):
    """The save of one ZeRO stage, shared by the tests here."""
    result = engine_launches.results(saves)[STAGES.index(request.param)]
    assert result["problems"] == [] and result["world_size"] == 2, result
    return Source(Path(result["dir"]).parent, request.param, result)


@shares(SCRIPT, after=(saves,))
def loads(out, saved):
    """Each stage's folder converted by the command line for 1 and 3 processes, and loaded there; and loaded
    unconverted at 3 (which must fail): (dp, None, job)."""
    jobs = []
    for stage, result in zip(STAGES, saved, strict=True):
        source = Path(result["dir"]).parent
        for dp in LOADS:
            run_cli("convert", source / "state", source / f"dp{dp}", "--to", f"dp={dp}", "--quiet", check=0)
            jobs.append((dp, None, job(source, stage, "load", source / f"dp{dp}")))
    for stage, result in zip(STAGES, saved, strict=True):     # last: the same load of the unconverted folder must fail
        source = Path(result["dir"]).parent
        jobs.append((3, None, {**job(source, stage, "load", source / "state"), "fails": True}))
    return jobs


@pytest.fixture(scope="module")
def converted(source, engine_launches):
    engine_launches.results(loads)
    return {dp: source / f"dp{dp}" for dp in LOADS}


def test_accelerates_folder_is_recognised(source):
    assert set(os.listdir(source / "state")) == ACCELERATE_FILES | DEEPSPEED_FILES
    info = json.loads(run_cli("inspect", source / "state", "--json", check=0).stdout)
    assert info["framework"]["title"] == f"Accelerate + DeepSpeed ZeRO-{source.stage}, dp=2"
    assert {f["path"] for f in info["framework"]["files"]} == ACCELERATE_FILES
    assert source.saved["lr"] == scheduled_lr(2 * STEPS) and source.saved["next_lr"] == scheduled_lr(2 * STEPS + 2)


@pytest.mark.parametrize("dp", LOADS)
def test_load_state_resumes_the_converted_folder_exactly(source, converted, dp, engine_launches):
    assert {f"random_states_{k}.pkl" for k in range(min(dp, 2))} <= set(os.listdir(converted[dp]))
    result = engine_launches.results(loads)[len(LOADS) * STAGES.index(source.stage) + LOADS.index(dp)]
    assert result["dir"] == str(converted[dp])
    assert result["problems"] == [], result["problems"][:5]
    assert result["world_size"] == dp and result["compared"] > 0
    assert result["negative_differences"] > 0             # the state one step later fails the same comparison
    assert (result["global_steps"], result["counter"], result["lr"]) == (STEPS, STEPS, source.saved["lr"])
    assert result["next_global_steps"] == STEPS + 1
    assert result["next_lr"] == scheduled_lr(2 * STEPS + dp)     # the schedule goes on, dp steps per step


def test_load_state_without_reshard_fails_with_deepspeeds_error(source, engine_launches):
    result = engine_launches.results(loads)[len(STAGES) * len(LOADS) + STAGES.index(source.stage)]
    assert result["dir"] == str(source / "state") and "problems" not in result
    assert "Automatic adjustment of ZeRO's optimizer state partitioning" in result["error"], result


def test_converted_pickles_load_where_reshard_is_not_installed(source, converted, tmp_path):
    for folder in converted.values():
        assert check_pickles(source / "state", folder, tmp_path) >= 4
