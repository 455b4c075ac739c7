"""The proof of convert: the unmodified DeepSpeed engine resumes our output at the new topology.

Every fixture is converted to dp 1, 2, 3 and 5 (and a few ZeRO stage changes); for each target
world size one torchrun launch (shared with the other modules' jobs of tests/scripts/engine_resume.py,
tests/helpers/engine_launches.py) loads all of its checkpoints with `engine.load_checkpoint(DST)`,
reads back full fp32 params and every optimizer state, and trains one more step
(tests/scripts/engine_resume.py). Everything must equal the truth the engine reported when it saved. The same
launches load each fixture itself through reshard.deepspeed_engine.load_checkpoint (issue #15).
"""
import shutil

import pytest

import reshard
from reshard.commands.convert import make_plan
from reshard.execution.executor import execute
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURE_NAMES, FIXTURES, fixture_dir, truth_json

pytestmark = pytest.mark.engine
TARGET_DPS = [1, 2, 3, 5]
STAGE_CHANGES = [("z1_fp32_dp2", 3, 3), ("z1_bf16_frozen_tied_dp2", 3, 2), ("z3_fp32_dp4", 1, 2),
                 ("z3_bf16_dp2", 1, 3), ("z3_fp32_frozen_tied_dp2", 1, 3), ("z2_fp32_dp2", 3, 3),
                 ("z2_bf16_dp4", 3, 2), ("z2_fp32_frozen_tied_dp2", 3, 1), ("z3_fp32_subgroup_dp2", 2, 5)]
JOBS = [(name, truth_json(name)["zero_stage"], dp) for name in FIXTURE_NAMES for dp in TARGET_DPS] + STAGE_CHANGES
# A negative control: a checkpoint that is complete and loads, but is another run's state.
CONTROL = ("z2_fp32_dp4", 2, 2)
# (issue #15) The fixtures themselves, loaded by the live engine at another dp (and stage) through
# reshard.deepspeed_engine.load_checkpoint, with no conversion step: each fixture at one of dp 1, 3, 5, and the
# stage changes.
DIRECT = [(name, truth_json(name)["zero_stage"], (1, 3, 5)[i % 3]) for i, name in enumerate(FIXTURE_NAMES)] + \
    [(name, stage, dp) for name, stage, dp in STAGE_CHANGES if dp in (1, 3, 5)]


@shares("engine_resume.py")
def resume_jobs(out):
    """Every conversion, direct load, the broken source and the control: (world, None, job)."""
    jobs = []
    for name, stage, dp in JOBS:
        dst = out / f"{name}-zero{stage}-dp{dp}"
        execute(make_plan(reshard.open_checkpoint(fixture_dir(name)), f"dp={dp},zero={stage}"), str(dst),
                progress=False)
        jobs.append((dp, None, {"fixture": name, "checkpoint": str(dst), "stage": stage, "fixtures": str(FIXTURES)}))
    for name, stage, dp in DIRECT:
        jobs.append((dp, None, {"fixture": name, "checkpoint": str(fixture_dir(name)), "stage": stage,
                                "fixtures": str(FIXTURES), "direct": True}))
    broken = out / "broken"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), broken)
    (broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    jobs.append((3, None, {"fixture": "z2_fp32_dp2", "checkpoint": str(broken), "stage": 2, "fixtures": str(FIXTURES),
                           "direct": True, "broken": True}))
    name, stage, dp = CONTROL
    jobs.append((dp, None, {"fixture": name, "checkpoint": str(out / f"z2_fp32_dp2-zero2-dp{dp}"), "stage": stage,
                            "fixtures": str(FIXTURES), "control": True}))
    return jobs


@pytest.fixture(scope="module")
def resumed(engine_launches):
    results = {}
    for result in engine_launches.results(resume_jobs):
        key = ("control",) if result.get("control") else ("broken",) if result.get("broken") else \
            (result["fixture"], result["stage"], result["world"], bool(result.get("direct")))
        results[key] = result
    return results


@pytest.mark.parametrize("name, stage, dp", JOBS, ids=[f"{n}-to-zero{s}-dp{d}" for n, s, d in JOBS])
def test_engine_resumes_converted_checkpoint_bit_exactly(resumed, name, stage, dp):
    result = resumed[(name, stage, dp, False)]
    assert result["problems"] == [], "\n".join(result["problems"])


@pytest.mark.parametrize("name, stage, dp", DIRECT, ids=[f"{n}-as-zero{s}-dp{d}" for n, s, d in DIRECT])
def test_engine_loads_the_source_directly_through_reshard(resumed, name, stage, dp):
    result = resumed[(name, stage, dp, True)]
    assert result["problems"] == [], "\n".join(result["problems"])


def test_a_broken_source_is_one_line_on_every_rank(resumed):
    """A missing rank file: every rank raised the same ReshardError (the launch ended: none hung waiting in
    DeepSpeed's load for another)."""
    error = resumed[("broken",)].get("error", "")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in error and "\n" not in error, error


def test_the_resume_check_sees_a_wrong_state(resumed):
    problems = resumed[("control",)]["problems"]
    assert any("differs from the saved engine's value" in p for p in problems), problems
