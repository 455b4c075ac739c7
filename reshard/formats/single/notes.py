"""What the single-process readers (torch.save, Lightning, Hugging Face) keep beyond the catalog's own facts:
plain data no writer carries, for whoever inspects the Catalog through the Python API (catalog.FormatNotes)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SingleNotes:
    extra: dict = field(default_factory=dict)           # a torch.save dict's keys besides model and optimizer
    lr_schedulers: list = field(default_factory=list)   # Lightning: every scheduler's state_dict
    lightning: dict = field(default_factory=dict)       # Lightning: epoch, global_step, callbacks, loops, ...
    trainer_state: object = None                        # Hugging Face: trainer_state.json
    opaque_files: list = field(default_factory=list)    # Hugging Face: present, not read (pickled objects, RNG)

    def param_details(self, name: str) -> dict:
        return {}

    def layout_scalar(self, key: str, value) -> bool:
        return False

    def scalars(self) -> dict:
        return {"extra": self.extra, "lr_schedulers": self.lr_schedulers, "lightning": self.lightning}
