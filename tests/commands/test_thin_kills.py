"""`reshard thin --yes` killed (SIGKILL) at each step of its journal, for each kind of swap its forms make
(issue 39, 3):

- DeepSpeed ZeRO-1 (fixtures/z1_bf16_dp2): the optimizer files dropped, the module file kept;
- DeepSpeed ZeRO-3 (fixtures/z3_bf16_dp2): every optimizer file written again by reshard's own writer (the fp32
  partitions alone), the module files kept;
- HF Trainer with FSDP's sharded state dict (fixtures/hf_fsdp_sharded_dp2) and Accelerate's FSDP2 save_state
  (fixtures/accelerate_fsdp_sharded_dp2): the folder `optimizer_0/` dropped.

The runs are copies of those real saves laid out as their frameworks' run directories (tests/helpers/lifecycle_runs,
tests/helpers/thin_runs.series). A kill at each step (reshard.lifecycle.thinning.STEPS, RESHARD_FAULT_AT) leaves
the checkpoint's folder holding exactly the full form's files or exactly the thinned form's, `list` calling it
complete and `validate --deep` proving it; the next `thin` (before the journal), `watch --once` or `prune --yes`
finishes the swap or rolls it back, as the step says, and leaves no working name. The negative control: a folder
holding the thinned form with some of the full form's dropped or rewritten files put back (a mix of the two) is not
listed complete, nor proven by `validate --deep`.
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
from reshard.lifecycle import thinning
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES
from tests.helpers.lifecycle_runs import age, ds_run
from tests.helpers.repo import REPO
from tests.helpers.thin_runs import series

# (how its run is made, the checkpoint thinned, the run's other checkpoints)
SOURCES = {
    "zero1": ("z1_bf16_dp2", "global_step2"),
    "zero3": ("z3_bf16_dp2", "global_step2"),
    "hf-fsdp-sharded": (FIXTURES / "hf_fsdp_sharded_dp2" / "checkpoint-3", "checkpoint-1"),
    "accelerate-fsdp-sharded": (FIXTURES / "accelerate_fsdp_sharded_dp2" / "state", "checkpoint_1"),
}
# after its swap (the exchange), a kill is finished by recovery; before it, rolled back
SWAPPED = ("swapped", "trashed", "removed")
WORKING = (".reshard-thin", ".reshard-thin-journal", ".reshard-thinned-from")


def run_of(kind: str, root: Path) -> tuple[Path, Path]:
    """The run directory of `kind` under `root` and its checkpoint to thin (not the newest, named by nothing)."""
    source, name = SOURCES[kind]
    if isinstance(source, str):
        save = ds_run(root, source)
    else:
        save = series(source, root / kind, (name, name[:-1] + "2"))
    return save, save / name


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def forms(kind: str, root: Path) -> tuple[dict, dict]:
    """The files of the checkpoint full and thinned by an uninterrupted `thin --yes` (a run of its own)."""
    _, ckpt = run_of(kind, root / "reference")
    full = files(ckpt)
    reshard.thin(str(ckpt), yes=True)
    return full, files(ckpt)


def status(save: Path, name: str) -> str:
    listed = json.loads(run_cli("list", save, "--json", check=None).stdout)["checkpoints"]
    assert not any(r["name"].startswith(".") for r in listed), listed      # no working name is a row
    return next(r for r in listed if r["name"] == name)["status"]


def working_names(save: Path) -> list[str]:
    return sorted(n for n in os.listdir(save) if n.endswith(WORKING))


def same_form(found: dict, form: dict) -> bool:
    """The files of a form, the record's text aside (it states the date and the bytes, the same in both runs)."""
    return found.keys() == form.keys() and all(found[n] == form[n] for n in form if n != "reshard-thinned.json")


@pytest.mark.parametrize("step", thinning.STEPS)
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_a_kill_at_each_journal_step_leaves_one_form_whole(tmp_path, kind, step):
    full, thin = forms(kind, tmp_path)
    save, ckpt = run_of(kind, tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "reshard", "thin", str(ckpt), "--yes"], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), thinning.FAULT_AT: step})
    assert proc.returncode == -9, proc.stderr
    found = files(ckpt)
    # the full form until the exchange, the thinned one from it: whole, never neither, never a mix
    assert same_form(found, thin if step in SWAPPED else full), sorted(found)
    age(save)
    assert status(save, ckpt.name) == "complete"
    assert reshard.validate(str(ckpt), deep=True).ok
    # the next command finishes the swap or rolls it back: before the journal, thin itself (which then thins);
    # after it, watch (odd steps) or prune (even steps), which leave the form the kill left
    at = thinning.STEPS.index(step)
    if step in ("written", "proven"):
        run_cli("thin", ckpt, "--yes", check=0)
        expected = thin
    elif at % 2:
        run_cli("watch", save, "--once", "--settle", "0", check=0)
        expected = thin if step in SWAPPED else full
    else:
        run_cli("prune", save, "--keep-last", "3", "--yes", check=0)
        expected = thin if step in SWAPPED else full
    assert working_names(save) == []
    assert same_form(files(ckpt), expected)
    age(save)
    assert status(save, ckpt.name) == "complete"
    assert reshard.validate(str(ckpt), deep=True).ok


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_a_mix_of_the_two_forms_is_not_complete(tmp_path, kind):
    """The control: the thinned form with all but the last of the full form's other files put back (ZeRO-1: one
    of the two optimizer files; ZeRO-3: rank 0's full optimizer file beside rank 1's rewritten one; FSDP: part of
    `optimizer_0/`) is what a swap that mixed the forms would leave; `list` and `validate --deep` reject it."""
    full, thin = forms(kind, tmp_path)
    save, ckpt = run_of(kind, tmp_path / "run")
    reshard.thin(str(ckpt), yes=True)
    back = [n for n in sorted(full) if thin.get(n) != full[n]]
    assert len(back) >= 2, back
    for name in back[:-1]:
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(full[name])
    age(save)
    assert status(save, ckpt.name) != "complete"
    assert not reshard.validate(str(ckpt), deep=True).ok
    shutil.rmtree(ckpt)     # the whole thinned form again: complete
    for name, data in thin.items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(data)
    age(save)
    assert status(save, ckpt.name) == "complete"
