"""Run the reshard CLI and SIGKILL it at the N-th part an S3 multipart upload sends, for tests/test_s3.py.

    python tests/s3_kill_driver.py N [reshard arguments...]

Parts are made 4 KiB (reshard.storage.s3.PART_BYTES) so the tiny fixtures' files are multipart uploads; the
fault is injected from outside, reshard's code is not changed.
"""
import os
import signal
import sys

from reshard.cli import main
from reshard.storage import s3

s3.PART_BYTES = 4096
sent = [0]
original = s3.UploadStream.send_part


def killing_send_part(self, number, part):
    sent[0] += 1
    if sent[0] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, number, part)


s3.UploadStream.send_part = killing_send_part
sys.exit(main(sys.argv[2:]))
