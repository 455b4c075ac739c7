"""What the single-process readers (torch.save, Lightning, Hugging Face) keep beyond the catalog's own facts:
plain data no writer carries, for whoever inspects the Catalog through the Python API (catalog.FormatNotes)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SingleNotes:
    # a torch.save dict's keys besides model and optimizer
    extra: Mapping[str, Any] = field(default_factory=dict)
    lr_schedulers: Sequence[Any] = field(default_factory=list)   # Lightning: every scheduler's state_dict
    # Lightning: epoch, global_step, callbacks, loops, ...
    lightning: Mapping[str, Any] = field(default_factory=dict)
    trainer_state: object = None                        # Hugging Face: trainer_state.json
    # Hugging Face: present, not read (pickled objects, RNG)
    opaque_files: Sequence[str] = field(default_factory=list)

    def param_details(self, name: str) -> dict:
        return {}

    def layout_scalar(self, key: str, value) -> bool:
        return False

    def scalars(self) -> dict:
        return {"extra": self.extra, "lr_schedulers": self.lr_schedulers, "lightning": self.lightning}
