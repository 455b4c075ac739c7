"""The committed fixtures (real DeepSpeed checkpoints, tools/make_fixtures.py) and their engine truth."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.helpers.repo import REPO

FIXTURES = Path(os.environ.get("RESHARD_FIXTURES", REPO / "fixtures"))
ALL_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if (p / "truth.json").exists()) if FIXTURES.exists() else []
MOE_FIXTURES = [n for n in ALL_FIXTURES if json.loads((FIXTURES / n / "truth.json").read_text()).get("kind")
                in ("autoep", "moe")]
ALL_FIXTURES = [n for n in ALL_FIXTURES if n not in MOE_FIXTURES]
FIXTURE_NAMES = [n for n in ALL_FIXTURES if "kind" not in json.loads((FIXTURES / n / "truth.json").read_text())]
PARALLEL_FIXTURES = [n for n in ALL_FIXTURES if n not in FIXTURE_NAMES]


def fixture_dir(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def truth_json(name: str) -> dict:
    return json.loads((FIXTURES / name / "truth.json").read_text())


def truth_tensors(name: str) -> dict:
    from safetensors.torch import load_file
    return load_file(str(FIXTURES / name / "truth.safetensors"))


def copy_fixture(name: str, dest: Path) -> Path:
    """A writable copy of a fixture's save dir, for tests that break it."""
    target = dest / name
    shutil.copytree(fixture_dir(name), target)
    return target


def tag_dir(save_dir: Path) -> Path:
    return save_dir / (save_dir / "latest").read_text().strip()
