"""The repository's root, for the tests' paths."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the scripts the tests run (under torchrun or python)
SCRIPTS = REPO / "tests" / "scripts"
