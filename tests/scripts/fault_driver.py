"""Run the reshard CLI with a fault injected, for the interruption and disk tests.

    python tests/scripts/fault_driver.py MODE N [reshard arguments...]
    python tests/scripts/fault_driver.py serve TIMEOUT

MODE kill: SIGKILL this process at the N-th write to an output file; int: SIGINT there;
pause: at the first write (holding the destination's lock) print `paused` on stderr and wait until
stdin is closed (at most N seconds); disk: report N bytes
free on every filesystem; ctrlc: SIGINT the whole process group, as a terminal's Ctrl-C does, at the
N-th function call or return the main thread makes once the executor has started staging (so it lands
anywhere: inside a lock, a futures call, a zip member); calls: count those calls up to the commit and
print `calls C` as the last line on stderr; fs: SIGKILL this process at its N-th rename, unlink or rmdir
(what `prune --yes` deletes with). The faults are injected from outside: reshard's code is not changed.

serve: for tests that run hundreds of drivers. Each line on stdin, a JSON list [MODE, N, arguments...], is
run in a child forked from this process, which has imported reshard once: the child leads a session of
its own (as `start_new_session` makes a process), its stdout is /dev/null, and it ends as the process
above would, through the interpreter's own exit. The answer, one JSON line on stdout, is [exit status as
subprocess gives it, or "hung" once the child and its group ran past TIMEOUT seconds and were killed,
the child's stderr].
"""
import json
import os
import select
import shutil
import signal
import sys
import tempfile

from reshard.cli import main
from reshard.execution.staging import Staging
from reshard.storage import posix_sink as sink

mode, n = "", 0
writes = [0]
calls = [0, None]       # calls counted so far, calls counted when the commit began
original_write = sink.HashingSink.write
original_prepare, original_commit = Staging.prepare, Staging.commit
DRIVER = os.getpid()    # forked workers inherit the profile hook: only this process counts


def faulty_write(self, data):
    writes[0] += 1
    if mode == "kill" and writes[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "int" and writes[0] == n:
        os.kill(os.getpid(), signal.SIGINT)
    if mode == "pause" and writes[0] == 1:
        print("paused", file=sys.stderr, flush=True)
        select.select([sys.stdin], [], [], n)       # the test closes our stdin when it is done with the lock
    return original_write(self, data)


def count_call(frame, event, arg):
    if os.getpid() != DRIVER:
        sys.setprofile(None)
        return
    calls[0] += 1
    if mode == "ctrlc" and calls[0] == n:
        sys.setprofile(None)
        # the test starts the driver as the leader of its own process group: the workers get it too
        os.killpg(os.getpgrp(), signal.SIGINT) if os.getpgrp() == DRIVER else os.kill(DRIVER, signal.SIGINT)


def counting_prepare(self, *args):
    sys.setprofile(count_call)
    return original_prepare(self, *args)


def counting_commit(self, *args):
    calls[1] = calls[0]
    return original_commit(self, *args)


def killing_at_nth(call):
    def counted(*args, **kwargs):
        writes[0] += 1
        if writes[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return call(*args, **kwargs)
    return counted


def run(argv: list) -> None:
    """Run `reshard ARGV[2:]` with fault ARGV[0] at ARGV[1], and exit with its status."""
    global mode, n, DRIVER
    mode, n, DRIVER = argv[0], int(argv[1]), os.getpid()
    sink.HashingSink.write = faulty_write
    if mode == "fs":
        os.rename, os.unlink, os.rmdir = (killing_at_nth(f) for f in (os.rename, os.unlink, os.rmdir))
    if mode in ("ctrlc", "calls"):
        Staging.prepare, Staging.commit = counting_prepare, counting_commit
    # As in a terminal: a shell starting jobs in the background (CI, nohup) makes them ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode == "disk":
        usage = shutil.disk_usage
        shutil.disk_usage = lambda path: usage(path)._replace(free=n)
    status = main(argv[2:])
    sys.setprofile(None)
    if mode == "calls":
        print(f"calls {calls[1]}", file=sys.stderr)
    sys.exit(status)


def serve(timeout: float) -> None:
    import reshard.api  # noqa: F401  (what a command imports on first use, imported once for every child)
    while line := sys.stdin.readline():
        with tempfile.TemporaryFile() as stderr:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os.setsid()
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0), os.dup2(null, 1), os.dup2(stderr.fileno(), 2)
                run(json.loads(line))
            status = exit_status(pid, timeout)
            stderr.seek(0)
            print(json.dumps([status, stderr.read().decode(errors="replace")]), flush=True)


def exit_status(pid: int, timeout: float):
    """The child's exit status (-SIGNAL where a signal ended it), or "hung" past `timeout` (then its group
    is killed: a hang is a lock the fault left held, not a slow run)."""
    ended = os.pidfd_open(pid)
    try:
        if not select.select([ended], [], [], timeout)[0]:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
    finally:
        os.close(ended)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    serve(float(sys.argv[2])) if sys.argv[1] == "serve" else run(sys.argv[1:])
