"""Accelerate's plain save_state (no DeepSpeed, no FSDP) read whole, and thinned to its weights (issue 39, 1 and 3).

The runs are real: tests/scripts/accelerate_save_state.py, one process on CPU, saves an MLP's model, AdamW and
scheduler after each of 3 steps, as model.safetensors ("safetensors"), as pytorch_model.bin ("bin",
save_state(safe_serialization=False)), and for a model of two equal-shaped layers ("twin"); it names the model's
parameter order in params.json. Its optimizer.bin is torch.optim's state_dict, its entries by index: reshard maps them
to the parameters by the model's order (pytorch_model.bin keeps it) or, where safetensors lose it, by shapes that prove
which entry is which; every moment reshard reads is the one torch.load gives at that parameter's index.

The weights-only form is the folder less optimizer.bin; Accelerate's own load of it, `accelerator.load_state(dir)`
with the model alone prepared (the script's "load", one process for every folder), gives every weight bit-equal to
the full folder's. Negative controls: a copy with one weight element changed loads with exactly that tensor changed;
the same load with an optimizer prepared too fails on the missing optimizer.bin; a flipped byte of the thinned
pytorch_model.bin is caught by `validate --deep` (safetensors keep no checksum: its changed element is caught by
`diff` against the full folder); a folder missing optimizer.bin without thin's record is not listed complete; the twin
run, whose entries no shape tells apart, is unverifiable (never incomplete, never deleted), as is a folder holding a
file reshard does not read.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from reshard.core.catalog import TensorKey
from tests.helpers.cli import run_cli
from tests.helpers.lifecycle_runs import age
from tests.helpers.repo import REPO, SCRIPTS

SCRIPT = str(SCRIPTS / "accelerate_save_state.py")
VARIANTS = ("safetensors", "bin")
WEIGHTS = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
CHANGED = "2.weight"


def script(*args) -> None:
    subprocess.run([sys.executable, SCRIPT, *map(str, args)], check=True, capture_output=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The three runs, saved once: `saved/VARIANT/checkpoints/checkpoint_{0,1,2}` and `saved/VARIANT/params.json`."""
    root = tmp_path_factory.mktemp("accelerate")
    script(root, 3, "safetensors", "bin", "twin")
    age(root)
    return root


def run_copy(saved: Path, variant: str, to: Path) -> Path:
    """A copy of the variant's run directory (its checkpoints folder), saved an hour ago."""
    run = Path(shutil.copytree(saved / variant / "checkpoints", to / variant / "checkpoints"))
    age(run)
    return run


def rows(run: Path) -> dict:
    return {r["name"]: r for r in json.loads(run_cli("list", run, "--json", check=None).stdout)["checkpoints"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_optimizer_is_read_at_each_parameters_index(saved, variant, tmp_path):
    """`list` proves each checkpoint complete, its bytes split; every exp_avg and exp_avg_sq reshard exports is
    the state torch.load finds at that parameter's index in the model's order."""
    run = run_copy(saved, variant, tmp_path)
    listed = rows(run)
    assert [r["status"] for r in listed.values()] == ["complete"] * 3, listed
    kinds = listed["checkpoint_2"]["bytes_by_kind"]
    assert kinds["optimizer"] == 2 * kinds["weights"] > 0 and sum(kinds[k] for k in ("weights", "optimizer", "other")) \
        == kinds["total"] == listed["checkpoint_2"]["bytes"]
    assert reshard.validate(str(run / "checkpoint_2"), deep=True).ok
    inspected = run_cli("inspect", run / "checkpoint_2", check=0).stdout
    assert "Accelerate + DDP or one process" in inspected and "4 trainable, 0 frozen" in inspected
    run_cli("export", run / "checkpoint_2", tmp_path / "export", "--with-optimizer", "--quiet", check=0)
    order = json.loads((saved / variant / "params.json").read_text())
    saved_state = torch.load(run / "checkpoint_2" / "optimizer.bin", weights_only=True)["state"]
    for state in ("exp_avg", "exp_avg_sq"):
        exported = load_file(tmp_path / "export" / f"optimizer-{state}.safetensors")
        assert sorted(exported) == sorted(order)
        for index, name in enumerate(order):
            assert torch.equal(exported[name], saved_state[index][state]), (state, name)
    # the control: the names' sorted order (the safetensors header's) is not the model's, and mapping the indices
    # by it would give parameters states of another shape
    assert sorted(order) != order and any(tuple(exported[name].shape) != tuple(saved_state[index]["exp_avg"].shape)
                                          for index, name in enumerate(sorted(order)))


def test_entries_no_shape_tells_apart_are_unverifiable_never_deleted(saved, tmp_path):
    run = run_copy(saved, "twin", tmp_path)
    listed = rows(run)
    for row in listed.values():
        assert row["status"] == "unverifiable" and "refusing to guess" in row["why"], row
    before = sorted(p.name for p in run.iterdir())
    run_cli("prune", run, "--keep-last", "1", "--delete-incomplete", "--yes", check=0)
    assert sorted(p.name for p in run.iterdir()) == before
    refused = run_cli("thin", run / "checkpoint_0", check=1).stderr
    assert "unverifiable" in refused and len(refused.strip().splitlines()) == 1


def test_a_file_it_does_not_read_keeps_a_checkpoint_unverifiable(saved, tmp_path):
    """A second optimizer's optimizer_1.bin is never read: that checkpoint is unverifiable and kept; the others are
    complete, and `prune --keep-last 1 --yes` deletes the older complete one alone."""
    run = run_copy(saved, "safetensors", tmp_path)
    shutil.copy(run / "checkpoint_1" / "optimizer.bin", run / "checkpoint_1" / "optimizer_1.bin")
    age(run)
    listed = rows(run)
    assert listed["checkpoint_1"]["status"] == "unverifiable" and "optimizer_1.bin" in listed["checkpoint_1"]["why"]
    run_cli("prune", run, "--keep-last", "1", "--yes", check=0)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_1", "checkpoint_2"]


def test_optimizer_missing_without_thins_record_is_not_complete(saved, tmp_path):
    run = run_copy(saved, "safetensors", tmp_path)
    (run / "checkpoint_0" / "optimizer.bin").unlink()
    age(run)
    listed = rows(run)
    assert listed["checkpoint_0"]["status"] == "incomplete" and "optimizer.bin: missing" in listed["checkpoint_0"][
        "why"] and listed["checkpoint_0"]["weights_only"] is False, listed["checkpoint_0"]
    assert not reshard.validate(str(run / "checkpoint_0")).ok
    refused = run_cli("thin", run / "checkpoint_0", check=1).stderr
    assert "only a complete checkpoint is thinned" in refused and len(refused.strip().splitlines()) == 1


def thinned(saved: Path, variant: str, to: Path) -> tuple[Path, Path]:
    """A copy of the run, checkpoint_0 thinned by `reshard thin --yes`: (checkpoint_0, checkpoint_1, its twin)."""
    run = run_copy(saved, variant, to)
    run_cli("thin", run / "checkpoint_0", "--yes", check=0)
    return run / "checkpoint_0", run / "checkpoint_1"


@pytest.mark.parametrize("variant", VARIANTS)
def test_thin_drops_optimizer_bin(saved, variant, tmp_path):
    folder, full = thinned(saved, variant, tmp_path)
    assert sorted(os.listdir(folder)) == sorted({*os.listdir(full), "reshard-thinned.json"} - {"optimizer.bin"})
    listed = rows(folder.parent)
    assert listed[folder.name]["status"] == "complete" and listed[folder.name]["weights_only"] is True
    assert listed[folder.name]["bytes_by_kind"]["optimizer"] == 0 < listed[full.name]["bytes_by_kind"]["optimizer"]
    assert listed[folder.name]["bytes_by_kind"]["weights"] == listed[full.name]["bytes_by_kind"]["weights"]
    assert "tier          weights-only (thinned from a full" in run_cli("inspect", folder, check=0).stdout
    assert reshard.validate(str(folder), deep=True).ok
    run_cli("export", full, tmp_path / "full.safetensors", "--quiet", check=0)
    run_cli("export", folder, tmp_path / "thin.safetensors", "--quiet", check=0)
    # checkpoint_0 and checkpoint_1 are different steps: the thinned export equals the full one of its own step
    source = run_copy(saved, variant, tmp_path / "source")
    run_cli("export", source / "checkpoint_0", tmp_path / "source.safetensors", "--quiet", check=0)
    assert (tmp_path / "source.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()
    assert (tmp_path / "full.safetensors").read_bytes() != (tmp_path / "thin.safetensors").read_bytes()
    diff = run_cli("diff", source / "checkpoint_0", folder, check=0).stdout
    assert "only A holds optimizer state" in diff and "no difference" in diff
    proc = run_cli("convert", folder, tmp_path / "ds", "--format", "deepspeed", "--to", "dp=1,zero=2", check=1)
    assert "no optimizer state (weights only)" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ds").exists()


def test_a_changed_thinned_weight_is_caught(saved, tmp_path):
    """pytorch_model.bin: a flipped byte, its zip CRC-32 stale, fails `validate --deep`; model.safetensors (no
    checksum): an element saved with another value is what `diff` against the full folder names."""
    folder, _ = thinned(saved, "bin", tmp_path / "bin")
    fragment = reshard.open_checkpoint(str(folder)).tensors[TensorKey(CHANGED, "module")].fragments[0]
    at = fragment.storage.offset + fragment.elem_offset * 4
    data = bytearray(open(fragment.storage.file, "rb").read())
    data[at] ^= 0x40
    open(fragment.storage.file, "wb").write(bytes(data))
    proc = run_cli("validate", "--deep", folder)
    assert proc.returncode != 0 and "CRC" in proc.stdout + proc.stderr
    folder, _ = thinned(saved, "safetensors", tmp_path / "st")
    changed_copy(folder, tmp_path / "changed")
    report = reshard.diff(str(run_copy(saved, "safetensors", tmp_path / "source") / "checkpoint_0"),
                          str(tmp_path / "changed"))
    assert not report.equal and CHANGED in str(report.to_dict())


def changed_copy(folder: Path, to: Path) -> Path:
    """A copy of the thinned safetensors `folder` with one element of CHANGED saved with another value."""
    changed = Path(shutil.copytree(folder, to))
    weights = load_file(changed / "model.safetensors")
    weights[CHANGED].view(-1)[0] += 1
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    return changed


@pytest.fixture(scope="module")
def loaded(saved, tmp_path_factory):
    """Accelerate's load_state with the model alone prepared, one process: each thinned folder, the full folder of
    the same step, the changed copy; then with an optimizer prepared too."""
    root = tmp_path_factory.mktemp("loads")
    folders = {}
    for variant in VARIANTS:
        folders[variant], _ = thinned(saved, variant, root / variant)
    folders["full"] = saved / "safetensors" / "checkpoints" / "checkpoint_0"
    folders["changed"] = changed_copy(folders["safetensors"], root / "changed")
    out = root / "out"
    out.mkdir()
    script("load", out, *folders.values())
    results = json.loads((out / "results.json").read_text())
    weights = {label: load_file(out / f"{k}.safetensors") if results["loaded"][k] is None else results["loaded"][k]
               for k, label in enumerate(folders)}
    return weights, results["with_optimizer"]


def test_accelerate_loads_the_thinned_folder_as_the_full_one(loaded, saved):
    weights, with_optimizer = loaded
    full = weights["full"]
    assert isinstance(full, dict), full
    assert set(full) == set(json.loads((saved / "safetensors" / "params.json").read_text()))
    for variant in VARIANTS:     # the bin run trained the same model from the same seed: the same weights
        assert isinstance(weights[variant], dict), weights[variant]
        assert full.keys() == weights[variant].keys() and all(torch.equal(full[k], weights[variant][k]) for k in full)
    # the controls: the changed copy loads with exactly that tensor changed; an optimizer prepared needs the file
    assert [k for k in full if not torch.equal(full[k], weights["changed"][k])] == [CHANGED]
    assert with_optimizer is not None and "optimizer.bin" in with_optimizer, with_optimizer
