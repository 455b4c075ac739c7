"""The allow-list DeepSpeed's files are read with: torch's own globals and DeepSpeed's five classes, as the inert
stand-ins of standins.py (beside this). Only DeepSpeed's readers (its rank files, layer files and universal states)
take it; every other format's unpickler refuses a DeepSpeed class as it refuses any global off its list.
"""
from __future__ import annotations

from reshard.formats import torchsave_read
from reshard.formats.deepspeed import standins

ALLOWED: dict = {**torchsave_read.ALLOWED, **standins.BY_GLOBAL}


def load(path: str) -> object:
    """A DeepSpeed file (a rank's model or optimizer states, a layer file, a universal state) unpickled through
    DeepSpeed's allow-list (torchsave_read.load: its tensors TensorRefs, nothing run)."""
    return torchsave_read.load(path, allowed=ALLOWED)
