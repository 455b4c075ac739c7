"""Inert stand-ins for the five DeepSpeed classes found in DeepSpeed's pickles.

DeepSpeed pickles a few of its own objects into checkpoints. We never import deepspeed to read
them: these plain classes receive their state instead. Each remembers the global it stands for,
so a writer can pickle it back under DeepSpeed's own name and DeepSpeed loads it unchanged.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class _AttributeBag:
    """An object restored from NEWOBJ + BUILD: just its attribute dictionary."""

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in sorted(self.__dict__.items()))
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other):
        return type(self) is type(other) and self.__dict__ == other.__dict__


class LossScaler(_AttributeBag):
    pass


class DynamicLossScaler(_AttributeBag):
    pass


@dataclass
class fragment_address:  # DeepSpeed's own spelling
    numel: int = 0
    start: int = 0


@dataclass
class SubparamShape:
    patterns: object = None
    shape: object = None
    partition_dim: int = 0


GLOBAL_NAMES = {
    ZeroStageEnum: ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    LossScaler: ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    DynamicLossScaler: ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    fragment_address: ("deepspeed.utils.tensor_fragment", "fragment_address"),
    SubparamShape: ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
}
BY_GLOBAL = {name: cls for cls, name in GLOBAL_NAMES.items()}
