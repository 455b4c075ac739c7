"""The reshard CLI run by a test: in this process, or in a new interpreter."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback

from tests.helpers.repo import REPO


def run_cli(*args, check=None, process=False, cwd=REPO):
    """`reshard ARGS` from `cwd` (the repository's root), as a CompletedProcess: in this process (reshard.cli.main,
    its stdout and stderr captured; argparse's exits and an escaping exception's traceback as a process would show
    them), or with `process` in a new interpreter, where the process boundary is what a test is about."""
    argv = [str(a) for a in args]
    if process:
        proc = subprocess.run([sys.executable, "-m", "reshard", *argv], capture_output=True, text=True, cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    else:
        proc = subprocess.CompletedProcess(["reshard", *argv], *_in_process(argv, cwd))
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _in_process(argv: list, where) -> tuple:
    """(exit status, stdout, stderr) of reshard.cli.main(argv) run here, from the folder `where`."""
    from reshard import cli
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:     # argparse: --help (0), a bad argument (2)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:           # what the interpreter would print, and its status
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(proc, *needles, code=1) -> None:
    """The run exited `code` with one line on stderr, no traceback, holding each of `needles`."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def lines_naming(proc, needle) -> list:
    """The lines of the run's stdout and stderr holding `needle`."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if needle in line]
