"""The torchrun launches of the tests and tools (tools/torchrun_jobs.py): a free port, once more when it was
taken; DeepSpeed's comm op built once; every script leaving its process group, also on an error; and the ranks the
tests fork instead (tools/forked_ranks.py): what torchrun's workers see, one failure stopping the others, a timeout
killing the launch whole."""
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

import torchrun_jobs
from tests.helpers.repo import REPO
from tests.helpers.torchrun import torchrun, torchrun_env

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
    proc = torchrun(2, script, check=False, deepspeed=False, forked=False)
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


@pytest.mark.parametrize("forked", [False, True], ids=["torchrun", "forked"])
def test_a_port_taken_before_torchrun_binds_it_is_retried_once_on_another(tmp_path, monkeypatch, forked):
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
        proc = torchrun_jobs.launch(2, [script], torchrun_env(), log=logged.append, forked=forked)
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
    scripts = [p for p in (*REPO.glob("tests/scripts/*.py"), *REPO.glob("tools/*.py"))
               if re.search(r"init_distributed\(|init_process_group\(", p.read_text())
               and p.name not in ("test_torchrun_jobs.py", "torchrun_jobs.py")]
    assert len(scripts) >= 8, scripts
    for path in scripts:
        # run_rank directly, or through the scripts' base (tests/helpers/rank_main.py)
        assert re.search(r"\brun_(rank|main)\(", path.read_text()), f"{path.name} can exit with its process group up"
    for path in (*REPO.glob("tests/scripts/*.py"), *REPO.glob("tools/*.py")):
        if path.name not in ("test_torchrun_jobs.py", "torchrun_jobs.py"):
            assert "--master_port" not in path.read_text(), f"{path.name} picks its own torchrun port"


# The forked ranks (tools/forked_ranks.py) the tests' launches use instead of torchrun's.
PROBE = """
import json, os, sys
seen = {{"env": {{k: v for k, v in os.environ.items() if k not in {base!r} or {base!r}[k] != v}},
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "torch_preloaded": "torch" in sys.modules,
        "leaked": hasattr(sys, "forked_ranks_mark")}}
sys.forked_ranks_mark = True      # set in this launch only: the next one must not see it
with open(os.path.join({out!r}, "seen" + os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
"""


def _probe(tmp_path, forked: bool, name: str):
    out = tmp_path / name
    out.mkdir()
    script = out / "probe.py"
    script.write_text(PROBE.format(base=torchrun_env(), out=str(out)))
    proc = torchrun(2, script, "an-argument", check=False, deepspeed=False, forked=forked)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return script, [json.loads((out / f"seen{rank}").read_text()) for rank in (0, 1)]


def test_forked_ranks_see_what_torchruns_workers_see_and_nothing_of_another_launch(tmp_path):
    real_script, real = _probe(tmp_path, forked=False, name="torchrun")
    forked_script, forked = _probe(tmp_path, forked=True, name="forked")
    _, again = _probe(tmp_path, forked=True, name="again")
    # what only torchrun's agent sets: its error file and signals, its own store (rank 0 hosts it here)
    agent_only = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE", "_"}
    for theirs, ours in zip(real, forked, strict=True):
        assert {k: v for k, v in ours["env"].items() if k not in agent_only | {"MASTER_PORT"}} == \
               {k: v for k, v in theirs["env"].items() if k not in agent_only | {"MASTER_PORT"}}
        assert ours["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert (ours["argv"][1:], ours["cwd"]) == (theirs["argv"][1:], theirs["cwd"]) == (["an-argument"], str(REPO))
        assert (Path(ours["path0"]), Path(theirs["path0"])) == (forked_script.parent, real_script.parent)
    # the control: torchrun's ranks start without torch; forked ones with it imported, and nothing left from
    # the launch before
    assert [s["torch_preloaded"] for s in real + forked] == [False, False, True, True]
    assert [s["leaked"] for s in forked + again] == [False] * 4


def test_a_failing_forked_rank_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n    raise RuntimeError('failed on purpose')\n"
                      "time.sleep(3600)\n")
    proc = torchrun_jobs.launch(2, [script], torchrun_env(), timeout=600, forked=True)
    assert proc.returncode == 1 and "RuntimeError: failed on purpose" in proc.stderr
    assert "stopping the others" in proc.stderr


def test_a_forked_launch_past_its_timeout_is_killed_whole(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\ntime.sleep(3600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun_jobs.launch(2, [script], torchrun_env(), timeout=20, forked=True)
    pids = [int((tmp_path / rank).read_text()) for rank in ("0", "1")]
    for _ in range(600):        # SIGKILL is delivered, not awaited: until both are gone (or zombies), a minute at most
        if all(_gone(pid) for pid in pids):
            break
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_torchrun_launch_ends_with_torchrun_though_a_rank_left_a_process_holding_its_output(tmp_path):
    """A rank that leaves a process behind with its output open (torch_dist's writer helpers, orphaned when a rank
    fails) once held the captured pipe open until the launch's timeout; the launch now ends when torchrun does and
    kills what its session left."""
    script = tmp_path / "orphan.py"
    script.write_text("import os, subprocess, sys\n"
                      "if os.environ['RANK'] == '0':\n"
                      f"    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
                      f"    open(os.path.join({str(tmp_path)!r}, 'orphan'), 'w').write(str(p.pid))\n"
                      "print('rank done', flush=True)\n")
    proc = torchrun_jobs.launch(2, [script], torchrun_env(), timeout=300)     # (TimeoutExpired when it hangs)
    assert proc.returncode == 0 and proc.stdout.count("rank done") == 2
    orphan = int((tmp_path / "orphan").read_text())
    for _ in range(600):        # SIGKILL is delivered, not awaited
        if _gone(orphan):
            break
        time.sleep(0.1)
    assert _gone(orphan)
