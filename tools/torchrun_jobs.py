"""torchrun launches that survive a busy machine and a torchrun job beside them (tests and tools share this).

- `launch(world, args, env)`: torchrun on a free port, once more on another if that port was taken
  between `free_port` closing it and torchrun's store binding it (the reason is logged); with `forked`, the
  ranks forked from a server that imported torch and the frameworks once (tools/forked_ranks.py) instead.
- `make_fixture(...)`: a fixture tool's launch, failing in one line, its staged output moved into place.
- `build_deepspeed_ops(env)`: DeepSpeed's JIT-built CPU op (`deepspeed_shm_comm`, built by every rank's
  `deepspeed.init_distributed`) built and loaded once in one process, so ranks only load it.
- `run_rank(main, *args)`: how every script run under torchrun calls its main: the process group is
  destroyed however main ends, and the rank exits without the interpreter teardown that gloo's worker
  threads race with (a SIGABRT, "terminate called without an active exception": 9 of 15 runs of a
  3-rank gloo script that never destroys its group; 2 of 4 of tests/scripts/dcp_fsdp2.py, which does, beside
  another job).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
import warnings

_GIVEN = set()      # ports handed out by this process: two concurrent launches never share one


def free_port() -> int:
    """A port no one listens on now (on every interface, as torchrun's store binds)."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def launch(world: int, args, env: dict, timeout: float = 1800, log=None, cwd=None,
           forked: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node WORLD --master_port <free> ARGS...`, output captured; with `forked`, the same
    ranks forked by tools/forked_ranks.py (rank 0's store on the free port)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def run(port):
        if forked:
            import forked_ranks
            return forked_ranks.launch(world, args, env, port, timeout=timeout, cwd=cwd)
        return _run_alone([torchrun, "--nproc_per_node", str(world), "--master_port", str(port), *map(str, args)],
                          env, timeout, cwd)

    port = free_port()
    proc = run(port)
    if proc.returncode != 0 and _port_taken(proc.stderr):
        (log or _warn)(f"torchrun: port {port} was taken before its store bound it (EADDRINUSE); "
                       "once more on another")
        proc = run(free_port())
    return proc


def make_fixture(name: str, world: int, args, env: dict, timeout: float, staged, final) -> None:
    """A fixture tool's launch: `launch` the ranks that write `staged`, the output and a one-line exit where they
    fail, else `staged` moved to `final` (what was there before replaced)."""
    import shutil
    proc = launch(world, args, env, timeout=timeout)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{name}: the ranks failed (exit {proc.returncode})")
    if os.path.exists(final):
        shutil.rmtree(final)
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    shutil.move(str(staged), str(final))

def _run_alone(command: list, env: dict, timeout: float, cwd) -> subprocess.CompletedProcess:
    """`command` in a session of its own, its output through files: done when it exits, even where a process it
    started outlives it holding its output open (torch_dist's writer helpers, orphaned when a rank fails, kept
    a pipe open until the timeout); then whatever is left is killed: its session's group, and every process
    still holding its output (torchrun's workers run in sessions of their own)."""
    import signal
    import tempfile
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, cwd=cwd, start_new_session=True)
        code = None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:    # (a Ctrl-C too: the session does not get the terminal's signals)
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # the session's group: the launcher and anything it left
            except ProcessLookupError:
                pass
            proc.wait()
            for pid in _holding(out) | _holding(err):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def _holding(file) -> set[int]:
    """The other processes with `file` open (Linux's /proc; none found elsewhere)."""
    mine = os.fstat(file.fileno())
    found = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino) and int(pid) != os.getpid():
                    found.add(int(pid))
                    break
        except OSError:     # (gone, or not ours to look into)
            continue
    return found


def _port_taken(stderr: str) -> bool:
    return "EADDRINUSE" in stderr or "address already in use" in stderr.lower()


BUILD_OPS = ("from deepspeed.comm.torch import build_shm_op\n"
             "print('deepspeed_shm_comm:', 'built' if build_shm_op() is not None else 'not used here')")


def build_deepspeed_ops(env: dict, log=None) -> bool:
    """Build (or load, once built) DeepSpeed's shm comm op in one process, as the ranks would (same
    environment, same torch_extensions cache); a failure is logged and retried once. True when ready."""
    for attempt in (1, 2):
        try:
            proc = subprocess.run([sys.executable, "-c", BUILD_OPS], capture_output=True, text=True,
                                  env=env, timeout=1800)
            if proc.returncode == 0:
                return True
            reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            reason = "no result in 30 minutes"
        (log or _warn)(f"building DeepSpeed's deepspeed_shm_comm op failed (attempt {attempt} of 2): {reason}")
    return False


def run_rank(main, *args) -> None:
    """Run a torchrun script's `main(*args)`, then end this rank: leave the process group (also after an
    error: the traceback is printed, the exit status is 1) and exit at once, with os._exit.

    destroy_process_group does not stop gloo's worker threads while anything still references the group
    (a DeviceMesh, an FSDP module, a DeepSpeed engine or its module globals). Such a thread that drops the
    last reference to a Python tensor once interpreter teardown has begun cannot take the GIL, is unwound
    through a noexcept frame and aborts the rank ("terminate called without an active exception",
    SIGABRT; seen in a core of tests/scripts/dcp_fsdp2.py: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork ->
    decref_pyobject -> take_gil -> pthread_exit). With the output flushed and the group destroyed,
    ending without that teardown leaves nothing to race with.
    """
    status = 1
    try:
        main(*args)
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
