"""Inert stand-ins for the five DeepSpeed classes found in DeepSpeed's pickles.

DeepSpeed pickles a few of its own objects into checkpoints. We never import deepspeed to read
them: these plain classes receive their state instead. Each says the global it stands for
(`stands_for`: torchsave_write.StandIn), so the shared torch.save writer pickles it back under DeepSpeed's own
name without knowing DeepSpeed, and DeepSpeed loads it unchanged.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from reshard.formats.torchsave_write import GlobalName


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3

    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("deepspeed.runtime.zero.config", "ZeroStageEnum")


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
    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


class DynamicLossScaler(_AttributeBag):
    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")


@dataclass
class fragment_address:  # DeepSpeed's own spelling
    numel: int = 0
    start: int = 0

    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("deepspeed.utils.tensor_fragment", "fragment_address")


@dataclass
class SubparamShape:
    patterns: object = None
    shape: object = None
    partition_dim: int = 0

    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("deepspeed.checkpoint.universal_checkpoint", "SubparamShape")


STANDINS = (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, SubparamShape)
# the global each stands for, as (module, name): the allow-list DeepSpeed's files are read with (pickles.ALLOWED)
GLOBAL_NAMES = {cls: (cls.stands_for().module, cls.stands_for().name) for cls in STANDINS}
BY_GLOBAL = {name: cls for cls, name in GLOBAL_NAMES.items()}
