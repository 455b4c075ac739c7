"""What reshard prints is true: no tag or ZeRO stage a format does not have, the run's world size from its
per-process files, plurals, one spelling of each format, hyper-parameters as configured, a run directory pointed
at `reshard list` (issue 24, point 12). The file counts of convert and validate: tests/cli/test_cli.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from reshard.cli import main
from reshard.text import counted
from tests.helpers import single_models as sm
from tests.helpers.fixtures import fixture_dir

DS = fixture_dir("z2_fp32_dp2")


def cli(capsys, *args) -> tuple:
    """`reshard ARGS` in this process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp") / "dcp"
    assert main(["convert", str(DS), str(out), "--format", "dcp", "--quiet"]) == 0
    return out


def test_no_tag_and_no_zero_stage_where_the_format_has_none(dcp_dir, capsys):
    code, text, _ = cli(capsys, "inspect", dcp_dir)
    assert code == 0 and "format        dcp\n" in text and "(tag" not in text and "ZeRO" not in text, text
    code, data, _ = cli(capsys, "inspect", dcp_dir, "--json")
    assert json.loads(data)["tag"] is None and json.loads(data)["zero_stage"] is None
    code, text, _ = cli(capsys, "inspect", DS)     # control: a DeepSpeed save has both
    assert "format        deepspeed (tag global_step3)" in text and "(world size 2), ZeRO stage 2" in text, text


def test_list_spells_each_format_one_way(dcp_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(dcp_dir, run / "step-1")
    shutil.copytree(dcp_dir, run / "step-2")
    (run / "step-2" / ".metadata").unlink()        # a DCP save still being written: named by its sniff alone
    code, data, _ = cli(capsys, "list", run, "--json", "--recent", "0")
    rows = json.loads(data)["checkpoints"]
    assert code == 0 and [(r["name"], r["format"]) for r in rows] == [("step-1", "dcp"), ("step-2", "dcp")], rows
    assert rows[0]["topology"] == "dp=2"            # no zero=0 for DCP


def test_world_size_of_a_trainer_checkpoint_is_its_processes(tmp_path, capsys):
    """transformers' Trainer saves rng_state.pth at one process and rng_state_{process_index}.pth at more
    (Trainer._save_rng_state): a 2-process DDP save has two, and its world size is 2."""
    sm.train_hf(tmp_path / "run", steps=1)
    capsys.readouterr()     # the Trainer's own log lines
    single = tmp_path / "run" / "checkpoint-1"
    code, data, _ = cli(capsys, "inspect", single, "--json")
    assert code == 0 and json.loads(data)["topology"]["world_size"] == 1     # control: one process
    ddp = tmp_path / "ddp" / "checkpoint-1"
    shutil.copytree(single, ddp)
    for rank in (0, 1):
        shutil.copy(single / "rng_state.pth", ddp / f"rng_state_{rank}.pth")
    (ddp / "rng_state.pth").unlink()
    code, data, _ = cli(capsys, "inspect", ddp, "--json")
    assert code == 0 and json.loads(data)["topology"]["world_size"] == 2


def test_counts_take_their_plural_and_hyper_parameters_read_as_configured(tmp_path, capsys):
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "one.pt")
    code, text, _ = cli(capsys, "validate", tmp_path / "one.pt")
    assert code == 0 and "2 logical tensors, 8 elements in 1 file\n" in text, text
    code, text, _ = cli(capsys, "inspect", DS)
    assert "; 2 buffers\n" in text and "group 0       8 params;" in text, text
    assert (counted(1, "buffer"), counted(1, "file"), counted(1200, "file")) == ("1 buffer", "1 file", "1,200 files")
    # the lr DeepSpeed's scheduler computed and saved (0.0028000000000000004) reads as configured; JSON keeps it all
    code, text, _ = cli(capsys, "inspect", fixture_dir("z3_bf16_dp4"))
    assert "lr=0.0028," in text and "0.0028000000000000004" not in text, text
    code, data, _ = cli(capsys, "inspect", fixture_dir("z3_bf16_dp4"), "--json")
    assert json.loads(data)["param_groups"][0]["lr"] == 0.0028000000000000004


def test_a_run_directory_is_pointed_at_reshard_list(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(DS, run / "save")
    code, _, err = cli(capsys, "inspect", run)
    assert code == 1 and "a run directory of 2 checkpoints (save/global_step2, save/global_step3)" in err, err
    assert f"`reshard list {run}` shows them" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "inspect", tmp_path / "empty")
    assert code == 1 and "not a checkpoint reshard can read" in err and "reshard list" not in err   # control
