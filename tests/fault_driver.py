"""Run the reshard CLI with a fault injected, for the interruption and disk tests.

    python tests/fault_driver.py MODE N [reshard arguments...]

MODE kill: SIGKILL this process at the N-th write to an output file; int: SIGINT there;
pause: at the first write (holding the destination's lock) print `paused` on stderr and wait until
stdin is closed (at most N seconds); disk: report N bytes
free on every filesystem; ctrlc: SIGINT the whole process group, as a terminal's Ctrl-C does, at the
N-th function call or return the main thread makes once the executor has started staging (so it lands
anywhere: inside a lock, a futures call, a zip member); calls: count those calls up to the commit and
print `calls C` as the last line on stderr; fs: SIGKILL this process at its N-th rename, unlink or rmdir
(what `prune --yes` deletes with). The faults are injected from outside: reshard's code is not changed.
"""
import os
import select
import shutil
import signal
import sys

from reshard.cli import main
from reshard.staging import Staging
from reshard.storage import posix_sink as sink

mode, n = sys.argv[1], int(sys.argv[2])
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
status = main(sys.argv[3:])
sys.setprofile(None)
if mode == "calls":
    print(f"calls {calls[1]}", file=sys.stderr)
sys.exit(status)
