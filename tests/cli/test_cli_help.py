"""`--help` is enough without the README: every option described, every spec key listed whole, examples that run."""
import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
from unittest import mock

import pytest

import reshard
from reshard.cli import build_parser
from reshard.core.layout import Layout
from reshard.errors import ReshardError
from reshard.formats import every_spec_key, target_layout
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir
from tests.helpers.repo import REPO

COMMANDS = ("inspect", "validate", "plan", "convert", "export", "diff", "list", "prune", "thin", "watch")
# Examples name these sources; the test puts a copy of a real checkpoint of that kind there.
EXAMPLE_SOURCES = {"ckpt": "z2_fp32_dp2", "pipe": "pipe2_z1_fp32_dp2", "out": "z2_fp32_dp2"}


def _subcommands(parser):
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _bench_parser():
    spec = importlib.util.spec_from_file_location("bench", REPO / "tools" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.build_parser()


def _help(*args, columns=80, bench=False):
    """`reshard ARGS --help` (or tools/bench.py's) at a terminal `columns` wide, in this process: argparse reads
    the width from COLUMNS."""
    with mock.patch.dict(os.environ, {"COLUMNS": str(columns)}):
        if not bench:
            proc = run_cli(*args, "--help")
            assert proc.returncode == 0 and proc.stderr == "", proc.stderr
            return proc.stdout
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            _bench_parser().parse_args([*args, "--help"])
        assert done.value.code == 0
        return out.getvalue()


@pytest.mark.parametrize("which", ["reshard", "bench"])
def test_every_command_and_option_is_described(which):
    parser = build_parser() if which == "reshard" else _bench_parser()
    subcommands = _subcommands(parser)
    if which == "reshard":
        assert set(subcommands) == set(COMMANDS)
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    described = {a.dest: a.help for a in sub._choices_actions}
    undescribed = [name for name in subcommands if not (described.get(name) or "").strip()]
    for name, command in subcommands.items():
        assert (command.description or "").strip(), f"{which} {name}: no description"
        undescribed += [f"{name} {a.option_strings or a.dest}" for a in command._actions
                        if not (a.help or "").strip() or a.help == argparse.SUPPRESS]
    assert not undescribed, f"{which}: without a description: {undescribed}"
    # and --help prints for the program and each command
    _help(bench=which == "bench")
    for name in subcommands:
        assert name in _help(name, bench=which == "bench").splitlines()[0]


def test_every_spec_key_is_accepted_and_listed_whole():
    source = reshard.open_checkpoint(fixture_dir("z2_fp32_dp2")).layout
    samples = {"dp": "2", "tp": "1", "pp": "1", "zero": "3", "partition": "type:Block", "layer_types": "Embed/Block",
               "kv_heads": "2", "ep": "2", "sharding": "fully_reshardable", "args": "run.json", "vocab": "50257"}
    names = [k.name for k in every_spec_key()]
    assert set(names) == set(samples)           # a key added to the mesh or a writer's declaration needs a sample here
    for key in names:
        assert isinstance(target_layout(source, f"{key}={samples[key]}", "deepspeed"), Layout)
    with pytest.raises(ReshardError) as refused:        # what is not in every_spec_key() the parser refuses
        target_layout(source, "heads=2", "deepspeed")
    assert f"expected keys {', '.join(names)}" in str(refused.value)

    assert _help("convert", columns=60) != _help("convert", columns=200)     # the width reaches the formatter
    for columns in (60, 80, 200):      # whatever the terminal width, no key=value is cut
        for command in ("convert", "plan"):
            lines = _help(command, columns=columns).splitlines()
            for key in every_spec_key():
                whole = f"{key.name}={key.value}"
                assert any(whole in line.split() for line in lines), f"{command} --help at {columns}: {whole}"
                assert any(key.meaning.split()[0] in line for line in lines)
            assert "type:REGEX" in "\n".join(lines) and "layer_types=" in "\n".join(lines)


def _examples(text: str) -> list:
    section = text.split("\nexamples:\n", 1)
    assert len(section) == 2, "no examples section"
    lines = [line.split("  #")[0].strip() for line in section[1].splitlines() if line.strip()]
    assert 2 <= len(lines) <= 3 and all(line.startswith("reshard ") for line in lines), lines
    return lines


def test_every_command_ends_with_examples_that_run(tmp_path):
    for name, fixture in EXAMPLE_SOURCES.items():
        shutil.copytree(fixture_dir(fixture), tmp_path / name)
    (tmp_path / "layouts").symlink_to(REPO / "reshard" / "layouts")
    (tmp_path / "evals.csv").write_text("step,eval_loss\n2,1.5\n3,1.25\n")     # list/prune --metrics
    examples = []
    # writers first: the others' examples read what they wrote (new/, model.safetensors)
    for command in ("convert", "export", "inspect", "validate", "plan", "diff", "list", "prune", "thin", "watch", None):
        for line in _examples(_help(*([command] if command else []))):
            if line not in examples:
                examples.append(line)
    assert len(examples) >= 2 * len(COMMANDS)
    for line in examples:
        args = shlex.split(line)[1:]
        proc = run_cli(*args, cwd=tmp_path)
        # diff says "different" with 1, validate "not complete" with 1: still a run, not a usage error
        allowed = (0, 1) if args[0] == "diff" else (0,)
        assert proc.returncode in allowed and not re.search(r"Traceback|usage:", proc.stderr), \
            f"{line}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
        assert proc.stdout.strip() or args[0] in ("convert", "export") and "--quiet" in args


def test_the_command_runs_numpy_with_one_blas_thread_unless_the_user_chose(monkeypatch, capsys):
    """The console script's entry (reshard.__main__.main) sets OPENBLAS_NUM_THREADS=1 before numpy loads (reshard
    does no linear algebra; the pool's start-up costs each process CPU) and keeps a value the user set."""
    import reshard.__main__ as entry
    monkeypatch.setattr("sys.argv", ["reshard", "--version"])
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert entry.main() == 0 and os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    assert entry.main() == 0 and os.environ["OPENBLAS_NUM_THREADS"] == "4"
    assert capsys.readouterr().out.count(reshard.__version__) == 2


def test_import_reshard_loads_nothing_until_a_name_is_used():
    """`import reshard` is light (its names load on first use, so the command line sets up its process first),
    and every name it exports resolves."""
    import subprocess
    import sys
    code = ("import sys, reshard; light = 'numpy' not in sys.modules and 'reshard.api' not in sys.modules; "
            "missing = [n for n in reshard.__all__ if getattr(reshard, n, None) is None]; "
            "print(light, missing, reshard.convert.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "[]", "reshard.api"], out
