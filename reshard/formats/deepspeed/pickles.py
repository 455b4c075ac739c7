"""The allow-list DeepSpeed's files are read with: torch's own globals and DeepSpeed's five classes, as the inert
stand-ins of reshard.formats.standins. Only DeepSpeed's readers (its rank files, layer files and universal states)
take it; every other format's unpickler refuses a DeepSpeed class as it refuses any global off its list.
"""
from __future__ import annotations

from reshard.formats import standins
from reshard.formats.torchsave_read import ALLOWED as TORCH_ALLOWED

ALLOWED: dict = {**TORCH_ALLOWED, **standins.BY_GLOBAL}
