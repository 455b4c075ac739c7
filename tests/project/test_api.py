"""The public Python API: every call documented (Args, Returns, Example), every Example run on a fixture, and the CLI
printing what the same call returns."""
from __future__ import annotations

import doctest
import json
import os
import shutil

import pytest

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir

# the calls of the API: one per command of the CLI, and the lifecycle calls
CALLS = [reshard.open_checkpoint, reshard.inspect, reshard.validate, reshard.prove_complete, reshard.plan,
         reshard.convert, reshard.export, reshard.diff, reshard.list_checkpoints, reshard.prune, reshard.Watcher]


def undocumented(call) -> list:
    """The sections of an API docstring that `call`'s lacks."""
    return [s for s in ("Args:", "Returns:", "Example:") if s not in (call.__doc__ or "")]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_every_call_says_its_args_returns_and_an_example(call):
    assert undocumented(call) == []
    assert call.__name__ in reshard.__all__


def test_the_docstring_check_finds_a_missing_section():
    """Negative control: a docstring without an Example is found."""
    def bare(x):
        """Args:
            x: a thing.

        Returns:
            it."""
    assert undocumented(bare) == ["Example:"]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_each_example_runs(call, tmp_path, monkeypatch):
    """The Example of each call, run by doctest in a folder holding `ckpt/`, a DeepSpeed save of two tags."""
    shutil.copytree(fixture_dir("z2_fp32_dp2"), tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    tests = doctest.DocTestFinder(recurse=False).find(call, globs={"reshard": reshard, "os": os})
    assert tests and tests[0].examples, f"{call.__name__} has no example to run"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_a_wrong_example_fails():
    """Negative control: the runner above reports an Example whose output is not what it says."""
    test = doctest.DocTestParser().get_doctest(">>> 1 + 1\n3\n", {}, "wrong", None, 0)
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda text: None)
    assert runner.summarize(verbose=False).failed == 1


def test_the_cli_prints_what_the_api_returns(tmp_path):
    ckpt = fixture_dir("z2_fp32_dp2")
    assert json.loads(run_cli("inspect", ckpt, "--json").stdout) == reshard.inspect(ckpt).to_dict()
    assert json.loads(run_cli("validate", ckpt, "--json").stdout) == reshard.validate(ckpt).to_dict()
    cli_plan = json.loads(run_cli("plan", ckpt, "--to", "dp=4", "--json").stdout)
    api_plan = reshard.plan(ckpt, "dp=4").to_dict()
    for disk in ("free_disk_bytes",):      # the disk's free space moves between two looks
        cli_plan.pop(disk), api_plan.pop(disk)
    assert cli_plan == api_plan
    cli_written = json.loads(run_cli("convert", ckpt, tmp_path / "a", "--to", "dp=4", "--json").stdout)
    api_written = reshard.convert(ckpt, tmp_path / "b", "dp=4").to_dict()
    assert len(cli_written["files"]) == len(api_written["files"]) and cli_written["topology"] == api_written["topology"]
    assert json.loads(run_cli("diff", tmp_path / "a", tmp_path / "b", "--json").stdout)["equal"] is True
    assert reshard.diff(tmp_path / "a", tmp_path / "b").to_dict()["equal"] is True


def test_plan_takes_the_proof_validate_gives(tmp_path):
    """What validate proves is what plan accepts: a Complete made once, planned from twice without proving again."""
    complete = reshard.prove_complete(fixture_dir("z2_fp32_dp2"))
    assert reshard.plan(complete, "dp=4").plan.target.dp == 4
    assert reshard.plan(complete, "dp=1").plan.target.dp == 1
    written = reshard.export(complete, tmp_path / "model.safetensors")
    assert written.output.format == "safetensors"
    # negative control: a checkpoint that is not whole gives no proof, and nothing is planned from it
    broken = tmp_path / "broken"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), broken)
    next((broken / "global_step3").glob("*zero_pp_rank_1_*optim*")).unlink()
    with pytest.raises(reshard.ReshardError, match="not complete"):
        reshard.plan(broken, "dp=4")


def test_the_api_names_are_the_functions_not_the_modules():
    """reshard.convert, .export, .validate are the API's functions, and no module of reshard hides behind them: the
    commands live in reshard.commands, whose import leaves the names alone."""
    import importlib
    for name in ("convert", "export", "validate", "plan", "diff", "inspect"):
        importlib.import_module(f"reshard.commands.{name}")
        assert callable(getattr(reshard, name)) and getattr(reshard, name).__module__ == "reshard.api"
    for name in ("convert", "export", "validate"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"reshard.{name}")


def test_the_examples_of_docs_api_md_run(tmp_path, monkeypatch):
    """docs/api.md's examples, run by doctest in a folder holding `ckpt/`, as the page says."""
    from tests.helpers.repo import REPO
    shutil.copytree(fixture_dir("z2_fp32_dp2"), tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    result = doctest.testfile(str(REPO / "docs" / "api.md"), module_relative=False,
                              globs={"reshard": reshard, "os": os}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 20 and result.failed == 0


def test_the_public_paths_of_earlier_versions_still_import():
    """v0.3's documented `reshard.dcp_reader.Reader` and `reshard.deepspeed_engine.load_checkpoint`, and v0.2's
    `reshard.dcp.Reader` (which v0.3 had removed), are the objects the rooms hold now."""
    from reshard.dcp import Reader as v02_reader
    from reshard.dcp_reader import Reader as v03_reader
    from reshard.deepspeed_engine import load_checkpoint
    from reshard.live import deepspeed_engine, storage_reader
    assert v02_reader is v03_reader is storage_reader.Reader
    assert load_checkpoint is deepspeed_engine.load_checkpoint
