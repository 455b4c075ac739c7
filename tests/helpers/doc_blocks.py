"""The shell blocks of README.md and docs/, found and run (tests/project/test_docs.py runs every one).

How to write a block (```sh, ```bash or ```console) so that it runs:
- It runs as written, in a fresh folder of its own that holds `fixtures` (a link to the repository's), so the
  fixture paths of the README work; `/tmp` in a block is that folder, so an example may write to `/tmp/x` as a reader
  would, and blocks never meet.
- Commands are separated by newlines, `&&` or `;`; `# ...` is a comment; `\\` continues a line. `reshard ...` runs in
  this process (reshard.cli.main), and so does `python -c CODE` (torch is imported once, not per block); `cd DIR`
  moves the rest of the block there; any other command runs as a process with the checkout on PYTHONPATH (`python`
  is this interpreter). Every command must exit 0. Pipes, redirections, `&`, `||`, backquotes and `$(...)` are
  refused outside quotes: write the block without them, or mark it not run.
- HTML comments on the lines right above the fence, one each, say what the block needs:
    <!-- test: ckpt/ = fixtures/z2_fp32_dp4/checkpoint -->  ckpt/ in the block's folder: a copy of that path
    <!-- test: out/ = @trainer-run -->                       made by the maker of that name (tests/project/test_docs.py)
    <!-- test: not run: REASON -->                           the block is not run, for that reason (counted)
- Commands that set up the environment the tests already run in (a venv made or activated, `pip install`) are
  not run; each is counted, with the reason, like a block marked not run.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES
from tests.helpers.repo import REPO

SHELL = ("sh", "bash", "console")
FENCE = re.compile(r"^```(\S*)\s*$")
NOTE = re.compile(r"^<!-- test: (.*) -->$")
NEED = re.compile(r"^(\S+) = (\S+)$")
SETUP = (("python3", "-m", "venv"), ("python", "-m", "venv"), (".",), ("source",), ("pip", "install"),
         ("python", "-m", "pip", "install"))
SETUP_REASON = "sets up the environment the tests run in"
UNSUPPORTED = ("||", "|", ">", "<", "&", "`", "$(")


class DocBlockError(AssertionError):
    """A block that failed or cannot be run: the message starts with FILE:LINE."""


@dataclass(frozen=True)
class Block:
    """One fenced shell block: where it is, its text, and what its annotations say."""
    path: str                           # relative to the repository
    line: int                           # the fence's line, from 1
    text: str
    needs: tuple[tuple[str, str], ...]  # (name in the block's folder, a repository path or @maker)
    not_run: str | None                 # the reason, for a block marked not run

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Command:
    line: int
    argv: tuple[str, ...]


@dataclass(frozen=True)
class NotRun:
    where: str          # FILE:LINE
    what: str           # the block's first line or the command
    reason: str


def blocks(path: Path, root: Path = REPO) -> list[Block]:
    """Every shell block of the markdown file `path`, with the annotations right above its fence."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        where = f"{path.relative_to(root)}:{i + 1}"
        if end is None:
            raise DocBlockError(f"{where}: a code block that is never closed")
        if fence[1] in SHELL:
            notes, j = [], i - 1
            while j >= 0 and NOTE.match(lines[j]):
                notes.insert(0, NOTE.match(lines[j])[1])
                j -= 1
            needs, not_run = [], None
            for note in notes:
                if note.startswith("not run:"):
                    not_run = note[len("not run:"):].strip()
                    if not not_run:
                        raise DocBlockError(f"{where}: `not run:` without a reason")
                elif NEED.match(note):
                    needs.append(NEED.match(note).groups())
                else:
                    raise DocBlockError(f"{where}: an annotation the doc tests do not know: {note!r}")
            found.append(Block(str(path.relative_to(root)), i + 1, "\n".join(lines[i + 1:end]), tuple(needs),
                               not_run))
        i = end + 1
    return found


def commands(block: Block) -> list[Command]:
    """The block's commands with their lines; a shell construct the runner does not take is an error."""
    found, word, line, start, quote, i = [], [], block.line + 1, None, None, 0
    text = block.text

    def flush():
        nonlocal word, start
        if "".join(word).strip():
            found.append(Command(start, tuple(shlex.split("".join(word)))))
        word, start = [], None

    while i < len(text):
        c = text[i]
        if quote:
            word.append(c)
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"' and i + 1 < len(text):
                word.append(text[i + 1])
                i += 1
            line += text[i] == "\n"
            i += 1
            continue
        if c == "\\" and text[i + 1:i + 2] == "\n":
            word.append(" ")
            line += 1
            i += 2
            continue
        if c == "#" and (not word or word[-1].isspace()):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        if c == "\n" or c == ";" or text.startswith("&&", i):
            flush()
            line += c == "\n"
            i += 2 if c == "&" else 1
            continue
        bad = next((u for u in UNSUPPORTED if text.startswith(u, i)), None)
        if bad:
            raise DocBlockError(f"{block.path}:{line}: `{bad}` is shell syntax the doc tests do not run; write the "
                                f"block without it or mark it `<!-- test: not run: REASON -->`")
        if start is None and not c.isspace():
            start = line
        if c in "'\"":
            quote = c
        word.append(c)
        i += 1
    if quote:
        raise DocBlockError(f"{block.path}:{line}: an unclosed {quote}")
    flush()
    return found


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -c CODE` in this process (torch is imported once, not per block), from `cwd`, its output captured."""
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(compile(code, "<python -c>", "exec"), {"__name__": "__main__"})
                status = 0
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["python", "-c", code], status, out.getvalue(), err.getvalue())


def is_setup(argv: tuple[str, ...]) -> bool:
    return any(argv[:len(prefix)] == prefix for prefix in SETUP)


def run_block(block: Block, folder: Path, makers: Mapping[str, Callable[[Path], None]]) -> list[NotRun]:
    """Run `block` in `folder` (empty, its own); raises DocBlockError naming FILE:LINE when a command fails.
    Returns what was not run, with why."""
    if block.not_run is not None:
        return [NotRun(block.where, block.text.split("\n")[0], block.not_run)]
    (folder / "fixtures").symlink_to(FIXTURES, target_is_directory=True)
    for name, source in block.needs:
        dest = folder / name.rstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.startswith("@"):
            if source[1:] not in makers:
                raise DocBlockError(f"{block.where}: no maker {source} (there are {', '.join(sorted(makers))})")
            makers[source[1:]](dest)
        else:
            shutil.copytree(REPO / source, dest, symlinks=True)
    here = re.sub(r"(?<![\w./-])/tmp(?=[/\s\"']|$)", str(folder), block.text)
    skipped, cwd = [], folder
    for command in commands(Block(block.path, block.line, here, block.needs, None)):
        env = {}
        argv = list(command.argv)
        while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        where = f"{block.path}:{command.line}"
        shown = shlex.join(command.argv).replace(str(folder), "/tmp")
        if is_setup(tuple(argv)):
            skipped.append(NotRun(where, shown, SETUP_REASON))
            continue
        if argv[0] == "cd":
            cwd = (cwd / argv[1]).resolve()
            if not cwd.is_dir():
                raise DocBlockError(f"{where}: `{shown}`: no such folder")
            continue
        in_process = argv[0] == "reshard" or argv[:2] in (["python", "-c"], ["python3", "-c"]) and len(argv) == 3
        if in_process and env:
            raise DocBlockError(f"{where}: `{shown}`: variables before a command run in process are not taken")
        if argv[0] == "reshard":
            proc = run_cli(*argv[1:], cwd=cwd)
        elif in_process:
            proc = run_python(argv[2], cwd)
        else:
            if argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, check=False,
                                  env={**os.environ, "PYTHONPATH": str(REPO), **env})
        if proc.returncode != 0:
            raise DocBlockError(f"{where}: `{shown}` exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                                f"stderr:\n{proc.stderr}")
    return skipped
