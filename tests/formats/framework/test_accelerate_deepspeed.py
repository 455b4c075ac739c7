"""Accelerate + DeepSpeed: a real Accelerate loop with a DeepSpeed plugin at 2 processes (torchrun, CPU, gloo)
calls save_state(dir); reshard converts the whole folder to 1 and 3 processes and accelerator.load_state(dir)
at that size resumes exactly (tests/scripts/accelerate_deepspeed.py): the engine's fp32 params, both Adam moments and
module weights equal the truth the live engine gave at save time bit for bit, the engine's step, the LR
scheduler and a registered custom object continue. Without reshard the same load fails with DeepSpeed's error.
"""
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from reshard.formats.weights_only import PROVENANCE
from tests.helpers.accelerate_schedule import scheduled_lr
from tests.helpers.cli import run_cli
from tests.helpers.damage import alter_weight
from tests.helpers.engine_launches import shares
from tests.helpers.lifecycle_runs import age
from tests.helpers.pickles import check_pickles
from tests.helpers.thin_runs import series

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
THIN_LOAD = 1       # the thinned folder loaded at dp: ZeRO-3 module files are per rank, so not above the save's


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
    for stage, result in zip(STAGES, saved, strict=True):     # Accelerate's weights-only load of the thinned folder
        source = Path(result["dir"]).parent
        jobs.append((THIN_LOAD, None, {**job(source, stage, "load", thinned_run(source) / "checkpoint_1"),
                                       "module_only": True}))
    for stage, result in zip(STAGES, saved, strict=True):     # last: the same load of the unconverted folder must fail
        source = Path(result["dir"]).parent
        jobs.append((3, None, {**job(source, stage, "load", source / "state"), "fails": True}))
    return jobs


def thinned_run(source: Path) -> Path:
    """A run of two copies of the save, `reshard thin --yes` run on the older: source/run/checkpoint_{1,2}."""
    run = source / "run"
    if not run.exists():
        series(source / "state", run, ("checkpoint_1", "checkpoint_2"))
        run_cli("thin", run / "checkpoint_1", "--yes", check=0)
    return run


def result_of(engine_launches, kind: str, stage: int, dp: int | None = None) -> dict:
    """The `loads` result of one job: "converted" at dp, "thinned", or "unconverted" (which must fail)."""
    at = {"converted": len(LOADS) * STAGES.index(stage) + LOADS.index(dp or LOADS[0]),
          "thinned": len(STAGES) * len(LOADS) + STAGES.index(stage),
          "unconverted": len(STAGES) * (len(LOADS) + 1) + STAGES.index(stage)}[kind]
    return engine_launches.results(loads)[at]


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
    result = result_of(engine_launches, "converted", source.stage, dp)
    assert result["dir"] == str(converted[dp])
    assert result["problems"] == [], result["problems"][:5]
    assert result["world_size"] == dp and result["compared"] > 0
    assert result["negative_differences"] > 0             # the state one step later fails the same comparison
    assert (result["global_steps"], result["counter"], result["lr"]) == (STEPS, STEPS, source.saved["lr"])
    assert result["next_global_steps"] == STEPS + 1
    assert result["next_lr"] == scheduled_lr(2 * STEPS + dp)     # the schedule goes on, dp steps per step


def test_load_state_without_reshard_fails_with_deepspeeds_error(source, engine_launches):
    result = result_of(engine_launches, "unconverted", source.stage)
    assert result["dir"] == str(source / "state") and "problems" not in result
    assert "Automatic adjustment of ZeRO's optimizer state partitioning" in result["error"], result


def test_converted_pickles_load_where_reshard_is_not_installed(source, converted, tmp_path):
    for folder in converted.values():
        assert check_pickles(source / "state", folder, tmp_path) >= 4


def test_thinned_folder_loads_with_accelerates_weights_only_load(source, engine_launches):
    """`reshard thin` leaves the folder with its tag folder in DeepSpeed's weights-only form (ZeRO-2: the module file
    alone; ZeRO-3: the optimizer files written again without the moments) and Accelerate's files kept; `list` calls
    it complete at the weights tier; Accelerate's weights-only load gives the module weights of the live engine at
    the save, bit for bit, and not those of one step later (the control)."""
    run = thinned_run(source)
    listed = {r["name"]: r for r in json.loads(run_cli("list", run, "--json").stdout)["checkpoints"]}
    assert [(r["status"], r["weights_only"]) for r in listed.values()] == [("complete", True), ("complete", False)]
    assert listed["checkpoint_1"]["bytes"] < listed["checkpoint_2"]["bytes"]
    thinned = run / "checkpoint_1"
    assert ACCELERATE_FILES | {PROVENANCE} <= set(os.listdir(thinned))
    tag = sorted(os.listdir(thinned / "pytorch_model"))
    assert tag == sorted(os.listdir(source / "state" / "pytorch_model")) if source.stage == 3 else \
        tag == ["mp_rank_00_model_states.pt"]
    assert "weights-only (thinned from a full deepspeed checkpoint" in run_cli("inspect", thinned).stdout
    compared = run_cli("diff", run / "checkpoint_2", thinned).stdout
    assert "only A holds optimizer state" in compared and "no difference" in compared, compared
    result = result_of(engine_launches, "thinned", source.stage)
    assert result["dir"] == str(thinned) and result["world_size"] == THIN_LOAD
    assert result["problems"] == [], result["problems"][:5]
    assert result["compared"] > 0 and result["negative_differences"] > 0
    assert result["counter"] == STEPS and result["lr"] == source.saved["lr"]     # Accelerate's own files loaded


def test_thinned_folder_altered_mixed_or_without_its_record_is_caught(source, tmp_path):
    """Controls: one weight element of the thinned folder changed (its zip CRC stale) fails `validate --deep`; the
    thinned folder with its first optimizer file put back from the full folder (a mix of the two forms) is not listed
    complete; ZeRO-2's without thin's record (its module file alone) neither. (ZeRO-3's optimizer files without
    moments say what they are: the form reads as weights-only without the record too.)"""
    run = thinned_run(source)
    altered = Path(shutil.copytree(run / "checkpoint_1", tmp_path / "altered"))
    state = "fp32" if source.stage == 3 else "module"
    alter_weight(altered / "pytorch_model", state, 4, crc=False, name="transformer.h.0.attn.c_attn.weight")
    assert "CRC" in run_cli("validate", altered, "--deep", check=1).stdout
    first = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    for damage in ("mixed", "bare") if source.stage == 2 else ("mixed",):
        copy = series(run / "checkpoint_1", tmp_path / damage, ("checkpoint_1",))
        shutil.copytree(run / "checkpoint_2", copy / "checkpoint_2")
        if damage == "mixed":
            shutil.copy(run / "checkpoint_2" / "pytorch_model" / first, copy / "checkpoint_1" / "pytorch_model")
        else:
            (copy / "checkpoint_1" / PROVENANCE).unlink()
        age(copy)
        listed = {r["name"]: r for r in json.loads(run_cli("list", copy, "--json", check=None).stdout)["checkpoints"]}
        assert listed["checkpoint_1"]["status"] != "complete" and listed["checkpoint_2"]["status"] == "complete", \
            (damage, listed)
