"""A checkpoint is a unit, or it is left alone (issue 24, point 1): `list`, `prune` and `watch` take each checkpoint
whole, as its framework wrote it, and never list or delete anything inside one.

The Hugging Face Trainer runs are real: one torchrun launch (2 processes, CPU, gloo; tests/scripts/hf_trainer_fsdp.py)
trains a tiny Llama with FSDP's sharded state dict, FSDP's full state dict and plain DDP, saving every step; FSDP
on CPU through the test-only shim tests/helpers/cpu_fsdp.py, so the Trainer writes the files it writes on GPUs.
Accelerate's save_state is real too (tests/scripts/accelerate_save_state.py). Megatron-LM and Lightning's FSDP folders
are built by their documented layouts (neither framework runs here), around real DCP files.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import reshard
from reshard.cli import main as cli
from reshard.lifecycle.listing import COMPLETE, UNKNOWN, UNVERIFIABLE
from tests.helpers import lifecycle_runs as lr
from tests.helpers.fixtures import fixture_dir
from tests.helpers.repo import REPO, SCRIPTS
from tests.helpers.torchrun import torchrun

TRAINER_RUNS = {"ddp": None, "sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}
STEPS = (1, 2, 3)
RNG = {"rng_state_0.pth", "rng_state_1.pth"}
# Each checkpoint-N/ exactly as the Trainer (transformers 5.21, accelerate 1.15, torch 2.13) wrote it.
LAYOUTS = {
    "sharded": {f"{d}/{f}" for d in ("pytorch_model_fsdp_0", "optimizer_0") for f in (".metadata", "__0_0.distcp",
                                                                                      "__1_0.distcp")}
    | RNG | {"scheduler.pt", "trainer_state.json"},
    "full": RNG | {"config.json", "generation_config.json", "model.safetensors", "pytorch_model_fsdp.bin",
                   "optimizer.bin", "scheduler.pt", "trainer_state.json", "training_args.bin"},
    "ddp": RNG | {"config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                  "trainer_state.json", "training_args.bin"},
}
UNITS = {"sharded": "HF Trainer with FSDP (sharded state dict)", "full": "HF Trainer with FSDP (full state dict)",
         "ddp": "HF Trainer (DDP or one process)"}


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory):
    """The three 2-process Trainer runs, from one torchrun launch: {name: output dir} (an hour old)."""
    root = tmp_path_factory.mktemp("trainer_runs")
    runs = {name: root / "runs" / name for name in TRAINER_RUNS}
    job = {"runs": [{"out": str(runs[name]), "state_dict_type": kind, "max_steps": len(STEPS), "save_steps": 1}
                    for name, kind in TRAINER_RUNS.items()]}
    (root / "job.json").write_text(json.dumps(job))
    torchrun(2, SCRIPTS / "hf_trainer_fsdp.py", root / "job.json", root / "result.json", deepspeed=False)
    result = json.loads((root / "result.json").read_text())["runs"]
    assert [(r["distributed_type"], r["global_step"]) for r in result] == \
        [("DistributedType.MULTI_CPU", 3), ("DistributedType.FSDP", 3), ("DistributedType.FSDP", 3)]
    lr.age(root)
    return runs


def run_copy(source: Path, tmp_path: Path) -> Path:
    """A writable copy of a run directory, its times kept (still an hour old)."""
    return Path(shutil.copytree(source, tmp_path / source.name, symlinks=True))


def files_of(run: Path) -> dict:
    """{checkpoint name: {its files, relative: bytes}} of every checkpoint-N/ in `run`."""
    return {c.name: {str(p.relative_to(c)): p.read_bytes() for p in sorted(c.rglob("*")) if p.is_file()}
            for c in sorted(run.iterdir()) if c.is_dir()}


def cli_out(capsys, *args) -> tuple:
    code = cli([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_whole_or_gone(before: dict, after: dict, deleted: set) -> None:
    """Every checkpoint either deleted whole (and named in `deleted`) or every file of it byte-identical."""
    assert set(after) == set(before) - deleted, (sorted(before), sorted(after))
    for name, files in after.items():
        assert files.keys() == before[name].keys(), name
        assert all(files[f] == before[name][f] for f in files), name


@pytest.mark.engine
def test_trainer_writes_the_gpu_layouts(trainer_runs):
    """What the runs wrote, file by file: FSDP's DCP folders and the per-process RNG pickles are there."""
    for name, run in trainer_runs.items():
        files = files_of(run)
        assert sorted(files) == [f"checkpoint-{s}" for s in STEPS]
        for checkpoint, held in files.items():
            assert set(held) == LAYOUTS[name], (name, checkpoint, sorted(held))


@pytest.mark.engine
@pytest.mark.parametrize("name", ["sharded", "full"])
def test_list_reads_each_fsdp_checkpoint_whole_as_one_row(trainer_runs, name, capsys):
    """FSDP's checkpoints, read by the format registry's readers and proven whole (every data file read or the
    Trainer's own), complete: before, "contents not verifiable by reshard yet"."""
    rows = reshard.list_checkpoints(trainer_runs[name]).checkpoints
    assert [(r.name, r.step, r.status, r.unit) for r in rows] == \
        [(f"checkpoint-{s}", s, COMPLETE, UNITS[name]) for s in STEPS]
    assert rows[0].files == len(LAYOUTS[name])      # the whole folder is the row: sub-folders and RNG files in it
    code, out, _ = cli_out(capsys, "list", trainer_runs[name])
    assert code == 0 and f": {len(STEPS)} checkpoints (" in out.splitlines()[0] and "unverifiable" not in out


@pytest.mark.engine
def test_list_reads_the_ddp_run_whole(trainer_runs):
    """The DDP checkpoints are read and proven whole, their RNG pickles (numpy state: never unpickled) carried."""
    rows = reshard.list_checkpoints(trainer_runs["ddp"]).checkpoints
    assert [(r.name, r.status, r.unit) for r in rows] == [(f"checkpoint-{s}", COMPLETE, UNITS["ddp"]) for s in STEPS]
    assert all(r.files == len(LAYOUTS["ddp"]) for r in rows)


# The retention commands of the issue and of README's cron line, each on every run.
COMMANDS = {"prune": ("prune", "{run}", "--keep-last", "1", "--delete-incomplete", "--yes"),
            "watch": ("watch", "{run}", "--once", "--keep-last", "1", "--delete-incomplete"),
            "cron": ("watch", "{run}", "--once", "--delete-incomplete")}


@pytest.mark.engine
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("name", sorted(TRAINER_RUNS))
def test_retention_deletes_only_whole_checkpoints(trainer_runs, tmp_path, capsys, name, command):
    """Every backend alike: `--keep-last 1` deletes checkpoint-1 and -2 whole, checkpoint-3 byte-identical with
    both RNG files; the cron line (no --keep rule) deletes nothing; a second watch pass validates nothing again."""
    run = run_copy(trainer_runs[name], tmp_path)
    before = files_of(run)
    code, out, err = cli_out(capsys, *(a.format(run=run) for a in COMMANDS[command]))
    assert code == 0, out + err
    deleted = {"checkpoint-1", "checkpoint-2"} if command != "cron" else set()
    assert_whole_or_gone(before, files_of(run), deleted)
    if command != "prune":      # the next pass reports nothing again and deletes nothing more
        code, out, err = cli_out(capsys, *(a.format(run=run) for a in COMMANDS[command]))
        assert code == 0 and "validated 0 checkpoints" in out, out + err
        assert_whole_or_gone(before, files_of(run), deleted)


def accelerate_run(root: Path, steps: int = 3) -> Path:
    project = root / "accelerate"
    subprocess.run([sys.executable, SCRIPTS / "accelerate_save_state.py", project, str(steps)], check=True,
                   capture_output=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    lr.age(project)
    return project


def test_accelerate_save_state_checkpoints_are_units_read_whole(tmp_path, capsys):
    """Accelerate's checkpoint_N/ (model.safetensors, optimizer.bin, scheduler.bin, random_states_0.pkl): one row
    each, complete (its optimizer.bin read: tests/commands/test_thin_accelerate.py), so `--keep-last 1` deletes
    the two older ones whole; the control: one holding a file reshard does not read (a second optimizer's) is
    unverifiable and kept."""
    project = accelerate_run(tmp_path)
    run = project / "checkpoints"
    assert {name: set(files) for name, files in files_of(run).items()} == \
        {f"checkpoint_{i}": {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
         for i in range(3)}
    shutil.copy(run / "checkpoint_1" / "optimizer.bin", run / "checkpoint_1" / "optimizer_1.bin")
    lr.age(project)
    rows = reshard.list_checkpoints(project).checkpoints
    assert [(r.name, r.step, r.status) for r in rows] == \
        [(f"checkpoints/checkpoint_{i}", i, UNVERIFIABLE if i == 1 else COMPLETE) for i in range(3)]
    assert all(r.unit == "Accelerate save_state (DDP or one process)" for r in rows)
    assert "optimizer_1.bin" in rows[1].why
    before = files_of(run)
    code, out, _ = cli_out(capsys, "prune", project, "--keep-last", "1", "--delete-incomplete", "--yes")
    assert code == 0 and "deleted 1 checkpoint" in out, out
    assert_whole_or_gone(before, files_of(run), {"checkpoint_0"})
    # With DeepSpeed, save_state's folder is a DeepSpeed save dir (tag `pytorch_model`, `latest`) with Accelerate's
    # files beside it (reshard/formats/framework/accelerate.py): one checkpoint, read whole, not a save dir whose
    # tag folder alone would be a checkpoint. Built by that layout around a real engine save and these RNG files.
    ds = tmp_path / "accelerate_ds" / "checkpoints" / "checkpoint_0"
    shutil.copytree(fixture_dir("z2_fp32_dp2") / "global_step3", ds / "pytorch_model")
    (ds / "latest").write_text("pytorch_model")
    for rank in (0, 1):
        shutil.copy(run / "checkpoint_2" / "random_states_0.pkl", ds / f"random_states_{rank}.pkl")
    lr.age(ds.parent.parent)
    [row] = reshard.list_checkpoints(ds.parent.parent).checkpoints
    assert (row.name, row.status, row.unit, row.format) == \
        ("checkpoints/checkpoint_0", COMPLETE, "Accelerate with DeepSpeed", "deepspeed"), row.why


def dcp_save(folder: Path) -> None:
    """A real DCP save (tests/lifecycle_runs.dcp_loop's, one step) moved to `folder`."""
    scratch = folder.parent / f".scratch-{folder.name}"
    lr.dcp_loop(scratch, [1])
    (scratch / "dcp" / "step-1").rename(folder)
    shutil.rmtree(scratch)


def documented_layouts(root: Path) -> Path:
    """A run directory of checkpoints as Megatron-LM writes them (real megatron-core 0.16 saves, torch_dist and the
    legacy torch format, copied per iteration), torchtitan's laid out around a real DCP save,
    Lightning's FSDPStrategy folder (the real one, fixtures/lightning_fsdp_dp2), and folders no framework's layout
    accounts for whole."""
    import torch
    run = root / "run"
    saves = Path(REPO) / "fixtures" / "megatron_core"      # real megatron-core 0.16 saves, copied per iteration
    for folder, source, its in (("megatron", "mcore_dp_reshardable_tp2_dp2", (100, 200)),
                                ("megatron_legacy", "mcore_legacy_plain_tp2_pp2", (50,))):
        for it in its:
            shutil.copytree(saves / source / "save" / "iter_0000003", run / folder / f"iter_{it:07d}")
        (run / folder / "latest_checkpointed_iteration.txt").write_text(str(its[-1]))
    (run / "torchtitan").mkdir()
    for step in (10, 20):
        dcp_save(run / "torchtitan" / f"step-{step}")
    lightning = run / "lightning" / "epoch=0-step=5.ckpt"
    lightning.parent.mkdir()
    # what Lightning's FSDPStrategy writes (tools/fixture_lightning_fsdp.py), read whole
    shutil.copytree(Path(REPO) / "fixtures" / "lightning_fsdp_dp2" / "step=3.ckpt", lightning)
    misc = run / "misc"
    misc.mkdir()
    torch.save({"w": torch.ones(3)}, misc / "random.pt")
    (misc / "README").write_text("weights someone kept\n")
    stray = run / "stray"       # a checkpoint's parts with nothing that names its framework
    stray.mkdir()
    torch.save({"state": {}, "param_groups": []}, stray / "optimizer.pt")
    torch.save({"cpu_rng_state": torch.get_rng_state()}, stray / "rng_state_3.pth")
    trainer = run / "hf" / "checkpoint-7"       # a Trainer folder with neither weights nor an engine's files
    trainer.mkdir(parents=True)
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    for rank in (0, 1):
        torch.save({"cpu_rng_state": torch.get_rng_state()}, trainer / f"rng_state_{rank}.pth")
    lr.age(run)
    return run


EXPECTED = {    # name: (status, unit)
    "hf/checkpoint-7": (UNKNOWN, "HF Trainer"),
    "lightning/epoch=0-step=5.ckpt": (COMPLETE, "Lightning with FSDP (sharded)"),     # read whole
    "megatron/iter_0000100": (COMPLETE, "Megatron-LM (torch_dist)"),      # read whole by the registry's reader
    "megatron/iter_0000200": (COMPLETE, "Megatron-LM (torch_dist)"),
    "megatron_legacy/iter_0000050": (COMPLETE, "Megatron-LM (torch, legacy)"),
    "misc": (UNKNOWN, "unknown"),
    "stray": (UNKNOWN, "unknown"),
    "torchtitan/step-10": (COMPLETE, "torchtitan (DCP)"),
    "torchtitan/step-20": (COMPLETE, "torchtitan (DCP)"),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return documented_layouts(tmp_path_factory.mktemp("layouts"))


def test_documented_layouts_are_one_row_each_and_unknown_folders_are_shown(layouts):
    rows = {r.name: r for r in reshard.list_checkpoints(layouts).checkpoints}
    assert {name: (r.status, r.unit) for name, r in rows.items()} == EXPECTED
    assert rows["megatron/iter_0000200"].step == 200 and rows["torchtitan/step-20"].step == 20
    assert "not recognised as a whole checkpoint" in rows["misc"].why
    assert "not recognised as a whole HF Trainer checkpoint" in rows["hf/checkpoint-7"].why
    assert all("never deleted" in r.why for r in rows.values() if r.status != COMPLETE)


def test_prune_delete_incomplete_deletes_only_a_whole_unit_proven_complete(layouts, tmp_path, capsys):
    """`--keep-last 1 --delete-incomplete --yes`: torchtitan's step-10 and Megatron-LM's iteration 100 go, whole
    (iteration 200 is the newest, and its tracker names it); every file of everything else — the unknown folders
    and the stray RNG pickle — stays."""
    run = run_copy(layouts, tmp_path)
    before = lr.snapshot(run)
    code, out, _ = cli_out(capsys, "prune", run, "--keep-last", "1", "--delete-incomplete", "--yes")
    assert code == 0 and "deleted 2 checkpoints" in out, out
    after = lr.snapshot(run)
    gone = {f for f in before if f.startswith(("torchtitan/step-10/", "megatron/iter_0000100/"))}
    assert gone and set(after) == set(before) - gone
    assert all(after[f] == before[f] for f in after)
    for name, (status, _) in EXPECTED.items():
        if status != COMPLETE:
            line = next(line for line in out.splitlines() if line.startswith(f"keep      {name} "))
            assert "never deleted" in line


def test_a_checkpoint_given_as_the_run_directory_is_refused(layouts, capsys):
    code, out, err = cli_out(capsys, "list", layouts / "megatron" / "iter_0000100")
    assert code == 1 and not out and err.count("\n") == 1
    assert "iter_0000100: one checkpoint (Megatron-LM (torch_dist)), not a run directory" in err
