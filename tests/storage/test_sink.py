"""reshard.storage.posix_sink.HashingSink: the bytes on disk are the bytes written, its digest (by each algorithm) is
theirs, whatever the sizes of the writes and wherever the file lives (direct I/O or, where refused, buffered)."""
import errno
import hashlib
import itertools
import os
import pathlib
import subprocess
import tempfile

import blake3
import numpy as np
import pytest
import xxhash

from reshard.storage import posix_sink as sink
from reshard.storage.posix_sink import BLOCK, HashingSink


def _write(path, pieces, reserve=0, algorithm="sha256"):
    with HashingSink(str(path), reserve, algorithm) as out:
        for piece in pieces:
            assert out.write(piece) == memoryview(piece).nbytes
        size, digest = out.size, out.digest
    return size, digest


def _pieces():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=2 * BLOCK + 12345, dtype=np.uint8).tobytes()
    # odd sizes, one write across two blocks, one bigger than a block, a numpy view, an empty write
    cuts = [0, 1, 4097, BLOCK - 3, BLOCK + 5, BLOCK + 5, 2 * BLOCK + 100, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(cuts)]
    pieces.append(np.frombuffer(b"\x01\x02\x03\x04\x05\x06\x07\x08", dtype="<u4"))
    return pieces, data + b"\x01\x02\x03\x04\x05\x06\x07\x08"


@pytest.mark.parametrize("reserve", [0, 3 * BLOCK])
@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "xxh3-128"])
def test_bytes_and_digest(tmp_path, reserve, algorithm):
    pieces, data = _pieces()
    size, digest = _write(tmp_path / "f", pieces, reserve, algorithm)
    assert (tmp_path / "f").read_bytes() == data
    reference = {"blake3": blake3.blake3, "sha256": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}[algorithm]
    assert (size, digest) == (len(data), reference(data).hexdigest())
    assert digest != reference(data[:-1]).hexdigest()      # the control: one byte less, another digest


def test_small_and_empty_files(tmp_path):
    assert _write(tmp_path / "e", []) == (0, hashlib.sha256(b"").hexdigest())
    assert (tmp_path / "e").read_bytes() == b""
    assert _write(tmp_path / "s", [b"abc"])[0] == 3 and (tmp_path / "s").read_bytes() == b"abc"


def test_buffered_where_direct_io_is_refused(tmp_path, monkeypatch):
    """A filesystem refusing O_DIRECT at open (tmpfs), or a device refusing page-aligned direct writes
    (EINVAL at the first write): the same bytes, written buffered."""
    pieces, data = _pieces()
    real_open = os.open

    def refusing_open(path, flags, *mode):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *mode)
    monkeypatch.setattr(sink.os, "open", refusing_open)
    assert _write(tmp_path / "a", pieces)[1] == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "a").read_bytes() == data
    monkeypatch.setattr(sink.os, "open", real_open)

    real_write, refused = os.pwrite, []

    def refusing_write(fd, view, at):
        if sink.fcntl.fcntl(fd, sink.fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(view))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, view, at)
    monkeypatch.setattr(sink.os, "pwrite", refusing_write)
    assert _write(tmp_path / "b", pieces)[1] == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "b").read_bytes() == data
    assert 1 <= len(refused) <= sink.WRITERS    # refused by the writes in flight; the rest went buffered


def test_a_failed_write_reaches_the_writer(tmp_path, monkeypatch):
    def full_disk(fd, view, at):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sink.os, "pwrite", full_disk)
    out = HashingSink(str(tmp_path / "f"))
    with pytest.raises(OSError, match="No space"):
        out.write(b"x" * ((sink.BLOCKS + 1) * BLOCK))     # the first block's flush fails
    with pytest.raises(OSError, match="No space"):
        out.close()
    with pytest.raises(ValueError, match="write after close"):
        out.write(b"y")


@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "xxh3-128"])
def test_a_file_in_memory_is_written_from_the_callers_memory(tmp_path, monkeypatch, algorithm):
    """On tmpfs (here: the file system said to be one, and /dev/shm itself where there is one) blocks of a BLOCK
    or more go to the file straight from the caller's buffer, hashed meanwhile, after the short ring block before
    them; with no reservation (a reservation there zero-fills pages the write fills again): the same bytes, the
    same digest, whatever the cuts. The caller's buffer is reused at once after each write (as the executor's
    block ring does): what is on disk is what was written then, not what the buffer held later."""
    pieces, data = _pieces()
    reference = {"blake3": blake3.blake3, "sha256": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}[algorithm]
    buffer = bytearray(2 * BLOCK)
    folders = [tmp_path] + ([pathlib.Path("/dev/shm")] if os.path.isdir("/dev/shm") else [])
    monkeypatch.setattr(sink, "in_memory", lambda fd: True)
    reserved = []
    monkeypatch.setattr(sink.os, "posix_fallocate", lambda *args: reserved.append(args))
    for folder in folders:
        path = folder / f"reshard-sink-test-{os.getpid()}"
        try:
            with HashingSink(str(path), len(data), algorithm) as out:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    buffer[:len(view)] = view
                    out.write(memoryview(buffer)[:len(view)])
                    buffer[:len(view)] = b"\xff" * len(view)      # reused: the bytes written must not change
                digest = out.digest
            assert path.read_bytes() == data and digest == reference(data).hexdigest() and not reserved
        finally:
            path.unlink(missing_ok=True)


def test_in_memory_tells_tmpfs_from_a_disk(tmp_path):
    """The file system type, from fstatfs: /dev/shm is tmpfs where there is one; the test's folder on disk is not."""
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    try:
        on_disk = sink.in_memory(fd)
    finally:
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        fd, name = tempfile.mkstemp(dir="/dev/shm")
        try:
            assert sink.in_memory(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    assert on_disk is (kind in ("tmpfs", "ramfs"))
