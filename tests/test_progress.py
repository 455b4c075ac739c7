"""Progress bars: on a terminal's stderr only (a pipe or a log gets none), never with --quiet, counting bytes read."""
import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import tempfile
import termios

import pytest

import reshard
import reshard.comparison
from reshard.core.dtypes import is_floating, itemsize
from conftest import REPO, fixture_dir

SRC = fixture_dir("z2_fp32_dp2")
OTHER = fixture_dir("z1_fp32_dp2")


def _run(args, terminal: bool):
    """Run `python -m reshard ARGS` with stderr on a pseudo-terminal (or a pipe); (exit code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryFile("w+") as out:
        if not terminal:
            proc = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], stdout=out,
                                  stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
            out.seek(0)
            return proc.returncode, out.read(), proc.stderr
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a new pty is 0 wide
        proc = subprocess.Popen([sys.executable, "-m", "reshard", *map(str, args)], stdout=out, stderr=slave,
                                cwd=REPO, env=env)
        os.close(slave)
        err = b""
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:         # EIO: the child closed the terminal
                break
            if not chunk:
                break
            err += chunk
        os.close(master)
        code = proc.wait()
        out.seek(0)
        return code, out.read(), err.decode(errors="replace")


def _commands(tmp_path):
    return {
        "diff": (["diff", SRC, OTHER], "comparing"),
        "validate": (["validate", SRC, "--deep"], "checking"),
        "convert": (["convert", SRC, tmp_path / "converted", "--to", "dp=3"], "writing"),
        "export": (["export", SRC, tmp_path / "one.safetensors"], "writing"),
        "checksums": (["validate", tmp_path / "made", "--checksums"], "hashing"),
    }


@pytest.mark.parametrize("command", ["diff", "validate", "convert", "export", "checksums"])
def test_bar_on_a_terminal_only_and_never_quiet(tmp_path, command):
    args, label = _commands(tmp_path)[command]
    if command == "checksums":      # a checkpoint with a manifest to hash against
        assert _run(["convert", SRC, tmp_path / "made", "--quiet"], terminal=False)[0] == 0
    code, out, err = _run(args, terminal=True)
    assert code in (0, 1), err
    assert label in err and "100%" in err and "B/s" in err, err        # a bar, in bytes, finished
    expected_out = out

    for run in ("pipe", "quiet"):
        for path in (tmp_path / "converted", tmp_path / "one.safetensors"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        if run == "pipe":
            code_again, out, err = _run(args, terminal=False)
        else:
            code_again, out, err = _run([*args, "--quiet"], terminal=True)
        assert code_again == code and err == "", f"{run}: {err!r}"
        if command in ("diff", "validate", "checksums"):         # the requested output stays
            if run == "pipe":
                assert out == expected_out
            else:
                assert out.splitlines()[-1] == expected_out.splitlines()[-1]


def test_quiet_keeps_errors_and_the_output(tmp_path):
    for command in (["inspect"], ["validate"], ["plan"]):
        code, out, err = _run([*command, SRC, "--quiet"], terminal=True)
        assert code == 0 and out.strip() and err == ""
        code, out, err = _run([*command, tmp_path / "nothing", "--quiet"], terminal=False)
        assert code in (1, 2) and err.startswith("reshard: ") and err.count("\n") == 1
    # --quiet drops diff's notes, not its differences or summary
    code, noisy, _ = _run(["diff", SRC, tmp_path / "nothing"], terminal=False)
    assert code == 2
    export = tmp_path / "w.safetensors"
    _run(["export", SRC, export, "--quiet"], terminal=False)
    code, noisy, _ = _run(["diff", SRC, export], terminal=False)
    assert code == 0 and "note: only A holds optimizer state" in noisy
    code, quiet, err = _run(["diff", SRC, export, "--quiet"], terminal=False)
    assert code == 0 and "note:" not in quiet and quiet.splitlines()[-1] == noisy.splitlines()[-1] and err == ""


class _Recorder:
    """Stands in for reshard.progress.bar: records the total announced and the bytes counted."""

    def __init__(self):
        self.totals, self.counted = [], 0

    def __call__(self, total, desc, enabled=True):
        self.totals.append(total)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def update(self, n):
        self.counted += n


def test_bars_count_the_bytes_read(monkeypatch):
    import reshard.source_bytes
    a, b = reshard.open_checkpoint(SRC), reshard.open_checkpoint(OTHER)
    read = []
    original_range, original_fragment = reshard.comparison.read_range, reshard.source_bytes.MappedFiles.fragment
    monkeypatch.setattr(reshard.comparison, "read_range", lambda *args: read.append(original_range(*args)) or read[-1])
    recorder = _Recorder()
    monkeypatch.setattr(reshard.comparison, "progress_bar", recorder)
    report = reshard.comparison.diff(a, b, progress=True)
    assert report.compared > 0
    assert recorder.totals == [recorder.counted] and recorder.counted == sum(r.nbytes for r in read) > 0

    read.clear()
    monkeypatch.setattr(reshard.source_bytes.MappedFiles, "fragment",
                        lambda *args: read.append(original_fragment(*args)) or read[-1])
    recorder = _Recorder()
    monkeypatch.setattr(sys.modules["reshard.validate"], "progress_bar", recorder)
    assert reshard.validate(a, deep=True, progress=True).ok
    floating = sum(f.numel * itemsize(t.dtype) for t in a.tensors.values() if is_floating(t.dtype)
                   for f in t.fragments)
    assert recorder.totals == [recorder.counted] and recorder.counted == sum(r.nbytes for r in read) == floating
