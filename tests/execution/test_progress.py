"""Progress bars: on a terminal's stderr only (a pipe or a log gets none), never with --quiet, counting bytes read.
The commands run in this process (a pseudo-terminal or a non-terminal as their stderr): the bar's choice is the
stream's, no process boundary is involved."""
import contextlib
import fcntl
import io
import os
import pty
import shutil
import struct
import sys
import termios
import threading

import pytest

import reshard
import reshard.cli
import reshard.commands.diff
from reshard.core.dtypes import is_floating, itemsize
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir

SRC = fixture_dir("z2_fp32_dp2")
OTHER = fixture_dir("z1_fp32_dp2")


def _run(args, terminal: bool):
    """reshard ARGS in this process with stderr on a pseudo-terminal (or, like a pipe, not a terminal);
    (exit code, stdout, stderr)."""
    if not terminal:
        proc = run_cli(*args)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a new pty is 0 wide
    chunks = []
    reader = threading.Thread(target=_read_terminal, args=(master, chunks))    # a full pty would block the bar
    reader.start()
    out = io.StringIO()
    # line-buffered, as a process's stderr on a terminal; closing it ends the reader (EIO)
    with open(slave, "w", buffering=1) as err, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = reshard.cli.main([str(a) for a in args])
    reader.join()
    os.close(master)
    return code, out.getvalue(), b"".join(chunks).decode(errors="replace")


def _read_terminal(master: int, chunks: list) -> None:
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:         # EIO: the terminal's last writer closed it
            return
        if not chunk:
            return
        chunks.append(chunk)


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
    """Stands in for reshard.execution.progress.bar: records the total announced and the bytes counted."""

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
    import reshard.reading.source_bytes
    a, b = reshard.open_checkpoint(SRC), reshard.open_checkpoint(OTHER)
    read = []
    original_range = reshard.commands.diff.read_range
    monkeypatch.setattr(reshard.commands.diff, "read_range",
                        lambda *args: read.append(original_range(*args)) or read[-1])
    recorder = _Recorder()
    monkeypatch.setattr(reshard.commands.diff, "progress_bar", recorder)
    report = reshard.commands.diff.diff(a, b, progress=True)
    assert report.compared > 0
    assert recorder.totals == [recorder.counted] and recorder.counted == sum(r.nbytes for r in read) > 0

    read.clear()
    original_windows = reshard.reading.source_bytes.MappedFiles.windows

    def windows(*args):         # validate --deep reads each fragment in windows
        for first, values in original_windows(*args):
            read.append(values)
            yield first, values
    monkeypatch.setattr(reshard.reading.source_bytes.MappedFiles, "windows", windows)
    recorder = _Recorder()
    monkeypatch.setattr(sys.modules["reshard.commands.validate"], "progress_bar", recorder)
    assert reshard.validate(a, deep=True, progress=True).ok
    floating = sum(f.numel * itemsize(t.dtype) for t in a.tensors.values() if is_floating(t.dtype)
                   for f in t.fragments)
    assert recorder.totals == [recorder.counted] and recorder.counted == sum(r.nbytes for r in read) == floating
