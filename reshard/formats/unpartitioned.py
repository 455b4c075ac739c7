"""The topology of a checkpoint whose format does not partition its state by data-parallel rank (DCP, torch.save,
safetensors, HF Trainer, Lightning): nothing beyond the mesh's degrees. reshard's topology line and descriptor
have always said so in DeepSpeed's words (zero=0, no options), and say it still: plans and manifests keep their
bytes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unpartitioned:
    def terms(self, brief: bool = False) -> tuple[tuple[str, object], ...]:
        return () if brief else (("zero", 0),)

    def descriptor(self) -> dict[str, object]:
        return {"zero": 0, "options": {}}


UNPARTITIONED = Unpartitioned()
