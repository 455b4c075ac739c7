"""Runs made of copies of one DCP-based checkpoint (torchtitan's `step-N/`, Lightning FSDPStrategy's `step=K.ckpt/`),
aged, with their first thinned by `reshard thin`: the series the thin tests share, and what every thinned one of
them must show (`check_lifecycle`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.damage import flip_weight
from tests.helpers.fixtures import FIXTURES
from tests.helpers.lifecycle_runs import age

TITAN = FIXTURES / "torchtitan" / "torchtitan_llama_fsdp2" / "checkpoint" / "step-3"
LIGHTNING = FIXTURES / "lightning_fsdp_dp2" / "step=3.ckpt"


def series(source: Path, folder: Path, names) -> Path:
    """`folder` holding a copy of `source` under each of `names`, saved an hour ago."""
    for name in names:
        shutil.copytree(source, folder / name)
    age(folder)
    return folder


def thinned_titan(root: Path) -> Path:
    run = series(TITAN, root / "checkpoint", ("step-1", "step-2", "step-3"))
    reshard.thin(str(run / "step-1"), yes=True)
    return run


def thinned_lightning(root: Path) -> Path:
    run = series(LIGHTNING, root / "lightning", ("step=1.ckpt", "step=2.ckpt"))
    reshard.thin(str(run / "step=1.ckpt"), yes=True)
    return run


def check_lifecycle(run: Path, thin: str, full: str, tmp: Path, name: str) -> None:
    """`list`: the thinned one complete and weights-only, smaller; its export the full one's; a flipped byte found."""
    rows = {r["name"]: r for r in json.loads(run_cli("list", run, "--json", check=0).stdout)["checkpoints"]}
    assert rows[thin]["status"] == "complete" and rows[thin]["weights_only"] is True, rows[thin]
    assert rows[full]["weights_only"] is False and rows[thin]["bytes"] < rows[full]["bytes"]
    assert rows[thin]["mtime"] == rows[full]["mtime"]
    assert reshard.validate(str(run / thin), deep=True).ok
    run_cli("export", run / full, tmp / "full.safetensors", check=0)
    run_cli("export", run / thin, tmp / "thin.safetensors", check=0)
    assert (tmp / "full.safetensors").read_bytes() == (tmp / "thin.safetensors").read_bytes()
    flipped = shutil.copytree(run / thin, tmp / "flipped" / thin)
    flip_weight(flipped, name)
    proc = run_cli("validate", "--deep", flipped)
    assert proc.returncode != 0 and "CRC" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
