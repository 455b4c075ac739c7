"""Run the reshard CLI with a fault injected, for the interruption and disk tests.

    python tests/fault_driver.py MODE N [reshard arguments...]

MODE kill: SIGKILL this process at the N-th write to an output file; int: SIGINT there;
pause: sleep N seconds at the first write (to hold the destination's lock); disk: report N bytes
free on every filesystem. The faults are injected from outside: reshard's code is not changed.
"""
import os
import shutil
import signal
import sys
import time

from reshard.cli import main
from reshard.formats import torchsave

mode, n = sys.argv[1], int(sys.argv[2])
writes = [0]
original_write = torchsave.HashingSink.write


def faulty_write(self, data):
    writes[0] += 1
    if mode == "kill" and writes[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "int" and writes[0] == n:
        os.kill(os.getpid(), signal.SIGINT)
    if mode == "pause" and writes[0] == 1:
        time.sleep(n)
    return original_write(self, data)


torchsave.HashingSink.write = faulty_write
# As in a terminal: a shell starting jobs in the background (CI, nohup) makes them ignore SIGINT.
signal.signal(signal.SIGINT, signal.default_int_handler)
if mode == "disk":
    usage = shutil.disk_usage
    shutil.disk_usage = lambda path: usage(path)._replace(free=n)
sys.exit(main(sys.argv[3:]))
