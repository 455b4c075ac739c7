"""What verl's reader keeps for its writer: the FSDP version and device mesh the ranks saved with, and the files of
the step that are no rank's (carried as they are, or rewritten for another world size)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reshard.formats.verl.flat_params import FlatParam

RANK_KINDS = ("model", "optim", "extra_state")      # verl's per-rank files: f"{kind}_world_size_{W}_rank_{R}.pt"


def rank_file(kind: str, world: int, rank: int) -> str:
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


@dataclass(frozen=True)
class VerlNotes:
    fsdp: int                               # fsdp_config.json's FSDP_version
    role: str                               # the role folder, relative to the catalog's root ("" when it is the root)
    config: Mapping[str, Any]               # fsdp_config.json as saved
    mesh_dims: tuple[str, ...]              # the device mesh's dim names ("fsdp",)
    device_type: str                        # the mesh's device type ("cuda"; "cpu" under gloo)
    mesh_groups: tuple[str, ...]            # the mesh's process groups' names (the default group's: "0")
    extra_states: tuple[str, ...]           # each rank's extra-state file, relative to the root (rank order)
    carried: tuple[tuple[str, int], ...] = field(default=())   # (path relative to the root, size): no rank's files
    flat_params: tuple[FlatParam, ...] = ()  # FSDP1's, in the optimizer's index order (flat_params.py)
    tracker: str | None = None              # read from a run folder: the step its tracker names ("3"), rewritten

    def param_details(self, name: str) -> dict:
        return {}

    def layout_scalar(self, key: str, value: object) -> bool:
        return False

    def scalars(self) -> dict:
        return {}
