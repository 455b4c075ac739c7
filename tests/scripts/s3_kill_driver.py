"""Run the reshard CLI with a fault at the N-th part an S3 multipart upload sends, for tests/storage/test_s3.py.

    python tests/scripts/s3_kill_driver.py kill:N|fail:N|journaled:N [reshard arguments...]

kill: SIGKILL this process there; fail: that part's upload raises (a refused request, as a full or failing store
gives). Parts are made 4 KiB (reshard.storage.s3.PART_BYTES) so the tiny fixtures' files are multipart uploads.
journaled: SIGKILL once the N-th finished file is journaled (parts as they are: the files are whole objects).
The fault is injected from outside, reshard's code is not changed.
"""
import os
import signal
import sys

from reshard.cli import main
from reshard.storage import s3

mode, at = sys.argv[1].split(":")
sent = [0]
original = s3.UploadStream.send_part
appended = s3.ObjectOutput.append


def faulty_send_part(self, number, part):
    sent[0] += 1
    if sent[0] == int(at):
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(5, "injected upload failure", self.name)
    return original(self, number, part)


def killing_append(self, path, data):
    appended(self, path, data)
    sent[0] += 1
    if sent[0] == int(at):
        os.kill(os.getpid(), signal.SIGKILL)


if mode == "journaled":
    s3.ObjectOutput.append = killing_append
else:
    s3.PART_BYTES = 4096
    s3.UploadStream.send_part = faulty_send_part
sys.exit(main(sys.argv[2:]))
