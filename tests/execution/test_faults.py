"""Interruption, resumption, locking and disk failures: never a half-written destination."""
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys

import pytest

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir
from tests.helpers.repo import REPO, SCRIPTS

SRC = fixture_dir("z3_bf16_dp4")
ARGS = ["--to", "dp=3,zero=2", "--quiet"]
DRIVER = str(SCRIPTS / "fault_driver.py")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _driver(mode, n, *args, **kwargs):
    return subprocess.run([sys.executable, DRIVER, mode, str(n), *map(str, args)], capture_output=True, text=True,
                          env=ENV, **kwargs)


@pytest.fixture(scope="module")
def served():
    """`served(MODE, N, *args)`: fault_driver.py's MODE run in a child forked from one server that imported
    reshard once (the Ctrl-C test runs hundreds); (exit status or "hung", stderr)."""
    server = subprocess.Popen([sys.executable, DRIVER, "serve", "120"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=ENV)

    def run(mode, n, *args):
        server.stdin.write(json.dumps([mode, str(n), *map(str, args)]) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, f"the fault driver's server ended (exit {server.wait()})"
        return tuple(json.loads(answer))

    yield run
    server.stdin.close()
    server.wait(timeout=60)


def _tree(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    run_cli("convert", SRC, out, *ARGS, check=0)
    return _tree(out)




KILL_POINTS = [1, 3, 8, 15, 25, 40, 60, 80, 100, 120, 140, 160]


@pytest.mark.parametrize("at", KILL_POINTS)
def test_sigkill_leaves_no_destination_and_resume_completes_identically(at, tmp_path, reference):
    dst = tmp_path / "out"
    proc = _driver("kill", at, "convert", SRC, dst, *ARGS)
    staging = tmp_path / ".out.reshard-tmp"
    if proc.returncode == 0:
        pytest.fail(f"the run finished before write {at}; lower the kill points")
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists() and staging.is_dir()
    journal = staging / ".reshard-journal"
    journaled = journal.read_text().splitlines() if journal.exists() else []
    inodes = {line.split('"path": "')[1].split('"')[0]: None for line in journaled}
    for rel in inodes:
        inodes[rel] = os.stat(staging / rel).st_ino
    # without --resume a rerun starts afresh; with it, finished files are kept (checked by their digest)
    run_cli("convert", SRC, dst, *ARGS, "--resume", check=0)
    assert _tree(dst) == reference
    for rel, inode in inodes.items():
        assert os.stat(dst / rel).st_ino == inode, f"{rel} was rewritten instead of reused"
    assert not staging.exists() and not (tmp_path / ".out.reshard-lock").exists()


def test_a_rerun_without_resume_starts_afresh(tmp_path, reference):
    dst = tmp_path / "out"
    assert _driver("kill", 60, "convert", SRC, dst, *ARGS).returncode == -signal.SIGKILL
    run_cli("convert", SRC, dst, *ARGS, check=0)
    assert _tree(dst) == reference


def test_sigint_exits_cleanly(tmp_path):
    dst = tmp_path / "out"
    proc = _driver("int", 30, "convert", SRC, dst, *ARGS)
    assert proc.returncode == 130 and proc.stderr.strip().splitlines()[-1] == "reshard: interrupted"
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def many_blocks(tmp_path_factory):
    """A torch.save training checkpoint (model + Adam after one step) of ~3 MiB per state: with a tiny
    memory budget every storage is written in many blocks, read ahead and hashed behind."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).square().mean().backward()
    optimizer.step()
    path = tmp_path_factory.mktemp("many_blocks") / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_anywhere_in_the_executor_exits_130_and_leaves_nothing(workers, tmp_path, many_blocks, served):
    """Ctrl-C (SIGINT to the process group, workers included) at many points from staging to the commit,
    wherever it lands (a lock, a futures call, a zip member being closed, a worker between jobs): exit 130,
    the one line `reshard: interrupted`, and no destination, staging area or lock left."""
    args = ["convert", many_blocks, tmp_path / "out", "--to", "dp=2,zero=2", "--format", "deepspeed",
            "--memory-budget", "64KiB", "--workers", workers, "--quiet"]
    status, stderr = served("calls", 0, *args)
    assert status == 0, stderr
    calls = int(stderr.strip().splitlines()[-1].split()[1])
    shutil.rmtree(tmp_path / "out")
    # the first calls, then drawn (seeded) over the run, short of the commit (a Ctrl-C once it has begun lets
    # it finish); counts vary a little from run to run with how long the main thread waits
    points = [*range(1, 11), *sorted(random.Random(workers).sample(range(11, int(calls * 0.9)), 200 // workers))]
    failures = []
    for at in points:
        outcome = served("ctrlc", at, *args)        # "hung": a lock the interrupt left held, not a slow run
        if outcome != (130, "reshard: interrupted\n") or os.listdir(tmp_path):
            failures.append(f"Ctrl-C at call {at}: exit {outcome[0]}, left {os.listdir(tmp_path)}, "
                            f"stderr {outcome[1][-300:]!r}")
            shutil.rmtree(tmp_path), tmp_path.mkdir()
    assert failures == [], f"{len(failures)} of {len(points)}:\n" + "\n".join(failures)


def test_two_converts_into_one_destination(tmp_path, reference):
    dst = tmp_path / "out"
    first = subprocess.Popen([sys.executable, DRIVER, "pause", "120", "convert", str(SRC), str(dst), *ARGS],
                             env=ENV, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert first.stderr.readline() == "paused\n"      # the first holds the lock, mid-write
    second = run_cli("convert", SRC, dst, *ARGS, check=1)
    first.stdin.close()
    assert "another reshard is writing it" in second.stderr
    assert first.wait(timeout=60) == 0
    assert _tree(dst) == reference


def test_short_disk_is_refused_with_the_numbers(tmp_path):
    for command in (["convert", SRC, tmp_path / "out", *ARGS], ["export", SRC, tmp_path / "m.safetensors", "--quiet"]):
        proc = _driver("disk", 1000, *command)
        assert proc.returncode == 1
        assert "needs" in proc.stderr and "GiB free" in proc.stderr, proc.stderr
        assert os.listdir(tmp_path) == []
    proc = _driver("disk", 1000, "plan", SRC, "--to", "dp=3")
    assert proc.returncode == 1 and "NOT ENOUGH" in proc.stdout and "free, the conversion writes" in proc.stderr


def test_write_error_midway_cleans_up_and_says_so(tmp_path):
    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", str(SRC), str(tmp_path / "out"), *ARGS],
                          capture_output=True, text=True, env=ENV, preexec_fn=small_files)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "write failed" in lines[0] and "File too large" in lines[0], proc.stderr
    assert os.listdir(tmp_path) == []
    assert reshard.validate(reshard.open_checkpoint(SRC)).ok
