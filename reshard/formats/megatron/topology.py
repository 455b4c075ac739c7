"""What a Megatron torch_dist save adds to its topology, and what its reader keeps for later (notes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PLAIN = "plain"       # the non-distributed optimizer: model-shaped states (optimizer.state.fp32_param.<key>)


@dataclass(frozen=True)
class MegatronTopology:
    """The optimizer's sharding type (`plain`, or the distributed optimizer's `dp_reshardable` /
    `fully_reshardable`) and what the save says of itself."""
    sharding: str
    iteration: int | None = None
    checkpoint_version: float | None = None
    layout: str = ""          # which megatron-core layout the files follow ("0.16": common.pt beside DCP's files)
    backend: str = "torch_dist"

    def terms(self, brief: bool = False) -> tuple[tuple[str, object], ...]:
        return () if brief else (("optimizer", self.sharding),)

    def descriptor(self) -> dict[str, object]:
        return {"optimizer": self.sharding, "options": self.options()}

    def options(self) -> dict[str, object]:
        return {"optimizer": "plain" if self.sharding == PLAIN else "distributed", "sharding": self.sharding,
                "iteration": self.iteration, "checkpoint_version": self.checkpoint_version,
                "backend": self.backend, "megatron_core": self.layout}


@dataclass(frozen=True)
class MegatronNotes:
    """The save's own facts for `inspect --params` and `diff`: per parameter how it is stored (its stacked key,
    layer and tensor-parallel boxes), the counters Megatron-LM keeps, and the run's arguments that are plain values
    (`args` of common.pt: hidden_size, num_query_groups, norm_epsilon, ...), which export's rule files read as the
    model's hyperparameters (reshard.export_names.ModelFacts)."""
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    args: tuple[tuple[str, Any], ...] = ()

    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.args)

    def param_details(self, name: str) -> dict[str, Any]:
        return dict(self.params.get(name, {}))

    def layout_scalar(self, key: str, value: object) -> bool:
        return False

    def scalars(self) -> dict[str, Any]:
        return dict(self.counters)
