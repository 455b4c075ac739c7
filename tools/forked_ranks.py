"""Ranks forked from one interpreter that has imported torch, DeepSpeed and the frameworks once.

A torchrun launch costs its agent and every rank an interpreter that imports torch (and DeepSpeed, transformers,
Lightning: 2-5 CPU-seconds each on the 2-core machine) before the first job runs; the test suite makes dozens of
launches. Here one server process per test process (`Server`) imports them once, and each launch forks its ranks
from it: every rank starts with those modules imported and nothing of them used, as a fresh interpreter would
after its imports. The ranks get what torchrun gives them: the environment variables a torchrun worker sees
(RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT ...; the TCP store hosted by rank 0, as with any
launcher but torchrun's agent), `sys.argv`, `sys.path[0]` the script's folder, and a fresh `__main__`; one rank
failing stops the others, as torchrun's agent does; their output is the launch's output.

The request protocol (one JSON line in, JSON lines out, on the server's stdin and a private copy of its stdout):
  {"world", "argv", "env", "cwd", "stdout", "stderr", "port"} -> {"pid": the launch's process group}, then
  {"status": its exit status}
`launch` below is the client side, with torchrun_jobs.launch's signature and result.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading

# Imported once by the server: what the launched scripts import, heaviest first. A module missing here is
# imported by each rank as usual.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "deepspeed", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral",
           "accelerate", "lightning", "safetensors.torch")


LOAD_OP_SECONDS = 300     # a first build of DeepSpeed's CPU comm op takes ~1 min on 2 cores


def _rank_env(env: dict, world: int, rank: int, port: int) -> dict:
    """What torchrun's agent sets for each worker (torch/distributed/elastic/agent/server/local_elastic_agent.py),
    one node; but TORCHELASTIC_USE_AGENT_STORE is False: rank 0 hosts the store, as under any other launcher, and
    the agent's own TORCHELASTIC_ERROR_FILE and TORCHELASTIC_SIGNALS_TO_HANDLE are not set."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


# ---------------------------------------------------------------------------------------------- the server side

def _run_rank(request: dict, rank: int, port: int) -> None:
    """In a forked child: become rank `rank` of the request's launch and run its script; never returns."""
    status = 1
    try:
        out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (out, err, null):
            os.close(fd)
        os.environ.clear()
        os.environ.update(_rank_env(request["env"], request["world"], rank, port))
        os.chdir(request["cwd"])
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _run_launch(request: dict) -> None:
    """In a forked child, the leader of a new session: fork the ranks, wait for them; the first that fails stops
    the others (torchrun's agent does the same). Exits with the first failure's status, else 0."""
    os.setsid()
    ranks = {}
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, request["port"])
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, waited = os.wait()
        ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(waited)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            with open(request["stderr"], "a") as err:
                print(f"[forked_ranks] rank {pid} exited with {code}; stopping the others", file=err)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    os._exit(status)


def _load_deepspeed_comm_op() -> None:
    """DeepSpeed's CPU communication op (deepspeed.comm.torch.build_shm_op), loaded once here, so the ranks forked
    from this server find it loaded (OpBuilder's class-level cache). Otherwise every rank loads it, and each load
    takes the JIT build's file lock (torch.utils.cpp_extension), even when nothing is rebuilt: a rank killed while
    it holds that lock (a test's timeout) would leave every later DeepSpeed launch on the machine waiting on it.
    Where it cannot be loaded here within LOAD_OP_SECONDS (a build failing, or another process's stale lock), the
    ranks load it as before, where what goes wrong is reported."""
    if "deepspeed" not in sys.modules:
        return

    def give_up(signum, frame):
        raise TimeoutError("loading DeepSpeed's comm op")
    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(LOAD_OP_SECONDS)
    try:
        from deepspeed.comm.torch import build_shm_op
        build_shm_op()
    except Exception:
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def serve() -> None:
    """Import PRELOAD, then answer launch requests read from stdin until it closes."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                   # what the imports print goes to stderr, never into the answers
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    _load_deepspeed_comm_op()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    answers.write(json.dumps({"ready": True, "threads": threads}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _run_launch(request)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, waited = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(waited)}) + "\n")


# ---------------------------------------------------------------------------------------------- the client side

class Server:
    """The forking server of this process, started on first use with the environment of its launch, and started
    anew (the old one stopped) for a launch with another environment: modules read some of it as they are
    imported. Stopped when this process ends."""

    # Set by pytest for each test: not read at import, so no reason for a new server.
    VOLATILE = ("PYTEST_CURRENT_TEST",)
    _running: Server | None = None
    _lock = threading.Lock()

    def __init__(self, env: dict):
        self.key = self._key(env)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise RuntimeError(f"forked_ranks: the server did not start (exit {self.proc.poll()})")
        if ready["threads"] != 1:       # fork would copy a process whose other threads may hold locks
            self.stop()
            raise RuntimeError(f"forked_ranks: the server runs {ready['threads']} threads after its imports")
        atexit.register(self.stop)

    @classmethod
    def _key(cls, env: dict) -> str:
        return json.dumps({k: v for k, v in env.items() if k not in cls.VOLATILE}, sort_keys=True)

    @classmethod
    def for_env(cls, env: dict) -> Server:
        running = cls._running
        if running is None or running.key != cls._key(env) or running.proc.poll() is not None:
            if running is not None:
                running.stop()
                atexit.unregister(running.stop)
            cls._running = running = cls(env)
        return running

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def run(self, request: dict, timeout: float) -> int:
        """Send a launch; its exit status. On `timeout`, its ranks are killed and TimeoutExpired raised."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            os.killpg(pid, signal.SIGKILL)
            self.proc.stdout.readline()
            raise subprocess.TimeoutExpired(request["argv"], timeout)
        return json.loads(self.proc.stdout.readline())["status"]


def launch(world: int, args, env: dict, port: int, timeout: float = 1800, cwd=None) -> subprocess.CompletedProcess:
    """`args` (a script and its arguments, or "-m" module ...) at `world` forked ranks, rank 0's store on `port`;
    a CompletedProcess with every rank's output."""
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="forked-ranks-") as tmp, Server._lock:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        request = {"world": world, "argv": argv, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                   "stdout": out, "stderr": err, "port": port}
        status = Server.for_env(env).run(request, timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(argv, status, o.read(), e.read())


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
