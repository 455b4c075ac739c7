"""The torchrun launches of the tests and tools (tools/torchrun_jobs.py): a free port, once more when it was
taken; DeepSpeed's comm op built once; every script leaving its process group, also on an error."""
import re
import socket
import sys

from conftest import REPO, torchrun, torchrun_env

sys.path.insert(0, str(REPO / "tools"))
import torchrun_jobs

# A rank of SCRIPT notes when it destroys its process group, and whether the interpreter's teardown ran.
SCRIPT = """
import atexit, os, sys
sys.path.insert(0, {tools!r})
import torch.distributed as dist
from torchrun_jobs import run_rank

def note(what):
    with open(os.path.join({out!r}, what + os.environ["RANK"]), "w") as f:
        f.write("up" if dist.is_initialized() else "left")

destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *a: (note("destroyed"), destroy(*a))
atexit.register(note, "teardown")

def main(fail):
    dist.init_process_group("gloo")
    keep = dist.group.WORLD     # a reference that keeps gloo's threads running past destroy_process_group
    dist.barrier()
    if fail:
        raise RuntimeError("failed on purpose")

if {helper}:
    run_rank(main, {fail})
main({fail})
"""


def _run(tmp_path, helper: bool, fail: bool):
    out = tmp_path / f"{helper}-{fail}"
    out.mkdir()
    script = out / "script.py"
    script.write_text(SCRIPT.format(tools=str(REPO / "tools"), out=str(out), helper=helper, fail=fail))
    proc = torchrun(2, script, check=False, deepspeed=False)
    return proc, {p.name: p.read_text() for p in out.iterdir() if p.name != "script.py"}


def test_a_rank_leaves_its_process_group_and_skips_the_teardown_also_when_it_fails(tmp_path):
    proc, notes = _run(tmp_path, helper=True, fail=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert notes == {"destroyed0": "up", "destroyed1": "up"}     # destroyed, and no teardown after it
    proc, notes = _run(tmp_path, helper=True, fail=True)
    assert proc.returncode != 0 and "RuntimeError: failed on purpose" in proc.stderr
    assert notes == {"destroyed0": "up", "destroyed1": "up"}
    # the control: without run_rank the ranks reach the teardown with the group up (where gloo's threads
    # can abort them)
    _, notes = _run(tmp_path, helper=False, fail=False)
    assert notes == {"teardown0": "up", "teardown1": "up"}


def test_a_port_taken_before_torchrun_binds_it_is_retried_once_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports = iter([port, torchrun_jobs.free_port()])
    monkeypatch.setattr(torchrun_jobs, "free_port", lambda: next(ports))
    logged = []
    script = tmp_path / "ok.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
                      "dist.destroy_process_group()\n")
    with taken:
        proc = torchrun_jobs.launch(2, [script], torchrun_env(), log=logged.append)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert logged == [f"torchrun: port {port} was taken before its store bound it (EADDRINUSE); "
                      "once more on another"]


def test_a_failed_op_build_is_logged_and_retried_once(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")      # the torch_extensions cache cannot be created under a file
    logged = []
    env = {**torchrun_env(), "TORCH_EXTENSIONS_DIR": str(blocker / "cache")}
    assert torchrun_jobs.build_deepspeed_ops(env, log=logged.append) is False
    assert len(logged) == 2 and all("deepspeed_shm_comm op failed" in line for line in logged), logged
    assert "attempt 1 of 2" in logged[0] and "attempt 2 of 2" in logged[1]
    assert "Not a directory" in logged[0] or "NotADirectoryError" in logged[0], logged


def test_every_torchrun_script_leaves_its_group_and_no_port_is_fixed():
    scripts = [p for p in (*REPO.glob("tests/*.py"), *REPO.glob("tools/*.py"))
               if re.search(r"init_distributed\(|init_process_group\(", p.read_text())
               and p.name not in ("test_torchrun_jobs.py", "torchrun_jobs.py")]
    assert len(scripts) >= 8, scripts
    for path in scripts:
        assert "run_rank(" in path.read_text(), f"{path.name} can exit with its process group up"
    for path in (*REPO.glob("tests/*.py"), *REPO.glob("tools/*.py")):
        if path.name not in ("test_torchrun_jobs.py", "torchrun_jobs.py"):
            assert "--master_port" not in path.read_text(), f"{path.name} picks its own torchrun port"
