"""The proof of convert through object storage: a DeepSpeed checkpoint uploaded to a real S3 server (SeaweedFS),
converted bucket → bucket and bucket → disk by reshard, is resumed by the unmodified DeepSpeed engine bit-exactly
(tests/scripts/engine_resume.py, in the launches shared with tests/formats/deepspeed/test_engine_resume.py). The engine
loads from a local folder: what reshard wrote to the bucket is fetched by boto3 (tools/s3_server.py), not by reshard's
reader. The negative control: another run's state, converted the same way, is told apart. And the engine loads the
bucket's checkpoint at another dp straight from its URL through reshard.deepspeed_engine.load_checkpoint (the control:
one with a rank file missing is one line on every rank).
"""
import atexit
import contextlib
import os
from unittest import mock

import pytest

import s3_server as servers
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES, fixture_dir

pytestmark = [pytest.mark.engine, pytest.mark.s3]
FIXTURE = "z2_fp32_dp2"
ROUTES = [("s3-to-s3", 3), ("s3-to-disk", 1)]


@shares("engine_resume.py")
def s3_direct_jobs(out):
    """reshard.deepspeed_engine.load_checkpoint(engine, "s3://...") on every rank, at dp 3, straight from the
    bucket, and the control: the same with a rank file missing is one line on every rank. The server must answer
    during the launch, which runs after this returns: it is stopped when this process ends (atexit)."""
    server = _LIVE.enter_context(servers.running(str(out / "s3-data")))
    source = servers.upload(server, str(fixture_dir(FIXTURE)), f"direct/{FIXTURE}")
    broken = servers.upload(server, str(fixture_dir(FIXTURE)), f"broken/{FIXTURE}")
    servers.delete(server, f"broken/{FIXTURE}/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    job = {"fixture": FIXTURE, "stage": 2, "fixtures": str(FIXTURES), "direct": True, "env": server.env()}
    return [(3, None, {**job, "checkpoint": source, "route": "direct"}),
            (3, None, {**job, "checkpoint": broken, "route": "direct-broken", "broken": True})]


_LIVE = contextlib.ExitStack()
atexit.register(_LIVE.close)


@shares("engine_resume.py")
def s3_resume_jobs(out):
    """Its own server (a provider runs whenever any module of its launches asks first), stopped once the
    converted checkpoints are on local disk for the engine."""
    jobs = []
    with servers.running(str(out / "s3-data")) as server, mock.patch.dict(os.environ, server.env()):
        source = servers.upload(server, str(fixture_dir(FIXTURE)), f"src/{FIXTURE}")
        for route, dp in ROUTES:
            local = out / route
            if route == "s3-to-s3":
                run_cli("convert", source, server.url(f"out/{route}"), "--to", f"dp={dp}", "--quiet", check=0)
                servers.download(server, f"out/{route}", str(local))
            else:
                run_cli("convert", source, local, "--to", f"dp={dp}", "--quiet", check=0)
            jobs.append((dp, None, {"fixture": FIXTURE, "checkpoint": str(local), "stage": 2,
                                    "fixtures": str(FIXTURES), "route": route}))
        control = out / "control"
        run_cli("convert", source, server.url("out/control"), "--to", "dp=2", "--quiet", check=0)
        servers.download(server, "out/control", str(control))
    # the control: the dp4 run's truth held against the dp2 run's state (as
    # tests/formats/deepspeed/test_engine_resume.py's CONTROL)
    jobs.append((2, None, {"fixture": "z2_fp32_dp4", "checkpoint": str(control), "stage": 2,
                           "fixtures": str(FIXTURES), "route": "control"}))
    return jobs


@pytest.fixture(scope="module")
def resumed(engine_launches):
    return {result["route"]: result for provider in (s3_resume_jobs, s3_direct_jobs)
            for result in engine_launches.results(provider)}


def test_the_engine_loads_a_bucket_directly_through_reshard(resumed):
    """reshard.deepspeed_engine.load_checkpoint given the s3:// URL: every value the engine holds after is the
    saved one, and it trains on."""
    assert "error" not in resumed["direct"], resumed["direct"]["error"]
    assert resumed["direct"]["problems"] == [], "\n".join(resumed["direct"]["problems"])


def test_a_broken_bucket_checkpoint_is_one_line_on_every_rank(resumed):
    error = resumed["direct-broken"].get("error", "")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in error and "s3://" in error and "\n" not in error, error


@pytest.mark.parametrize("route", [r for r, _ in ROUTES])
def test_the_engine_resumes_what_was_converted_through_the_bucket_bit_exactly(resumed, route):
    assert resumed[route]["problems"] == [], "\n".join(resumed[route]["problems"])


def test_the_resume_check_sees_another_runs_state(resumed):
    problems = resumed["control"]["problems"]
    assert any("differs from the saved engine's value" in p for p in problems), problems
