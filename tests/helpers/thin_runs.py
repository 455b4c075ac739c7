"""Runs made of copies of one DCP-based checkpoint (torchtitan's `step-N/`, Lightning FSDPStrategy's `step=K.ckpt/`),
aged, with their first thinned by `reshard thin`: the series the thin tests share."""
from __future__ import annotations

import shutil
from pathlib import Path

import reshard
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
