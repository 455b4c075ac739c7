"""What Megatron's pickles name beyond torch's own, as inert stand-ins: the allow-lists its files are read with.

`common.pt` pickles Megatron-LM's `args`, an `argparse.Namespace` whose values include Megatron enums
(`AttnBackend`, `ModelType`, ...) and `signal.Signals`; the DCP `.metadata` megatron-core writes adds the savers'
plans (`all_local_plans`: torch's SavePlan, WriteItem, WriteItemType, TensorWriteData) to DCP's own classes, and
0.15 pickles both as its own subclasses, MCoreMetadata and MCoreSavePlan. Each
becomes a plain record of its state here; an enum member becomes its class's name and value. Nothing is imported,
nothing runs: any other global is still refused (torchsave_read.AllowListUnpickler). The writer pickles `args` and
its enums back under their own globals (`pickled_as`), so Megatron loads a written common.pt as its own.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from reshard.formats.dcp import metadata as dcp_metadata
from reshard.formats.torchsave_read import ALLOWED as TORCH_ALLOWED
from reshard.formats.torchsave_write import GlobalName, PickledAs


class Record:
    """An object restored from NEWOBJ + BUILD (a dict state, or (dict, slots)): only its attributes."""

    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:      # (dict or None, slots)
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            state = merged
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__} with state {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class Namespace(Record):
    """argparse.Namespace: Megatron-LM's `args`; pickled back as argparse.Namespace() given its attributes."""

    def pickled_as(self) -> PickledAs:
        return PickledAs(GlobalName("argparse", "Namespace"), (), dict(self.__dict__))


@dataclass(frozen=True)
class EnumMember:
    """A member of an enum (`AttnBackend.auto`, `signal.SIGTERM`), as its class's name and its value."""
    enum: str
    value: object

    def __repr__(self) -> str:
        return f"{self.enum}({self.value!r})"

    def pickled_as(self) -> PickledAs:
        """The member, as pickle writes an enum member: its class called with its value."""
        module, _, name = self.enum.rpartition(".")
        return PickledAs(GlobalName(module, name), (self.value,))


def _enum(name: str):
    def member(value):
        if not isinstance(value, (int, str)):
            raise pickle.UnpicklingError(f"{name} member of a {type(value).__name__} value")
        return EnumMember(name, value)
    return member


# Megatron's enums that args may hold (megatron/core/enums.py, transformer/enums.py, ...)
_ENUMS = {
    "megatron.core.transformer.enums": ("AttnBackend", "AttnMaskType", "AttnType", "LayerType", "ModelType",
                                        "CudaGraphScope"),
    "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe"),
    "megatron.core.transformer.transformer_config": ("CudaGraphScope",),
    "signal": ("Signals",),
}

COMMON_ALLOWED: dict = {**TORCH_ALLOWED, ("argparse", "Namespace"): Namespace}
COMMON_ALLOWED.update({(module, name): _enum(f"{module}.{name}") for module, names in _ENUMS.items()
                       for name in names})


class NumpyArray(Record):
    """numpy's ndarray in the legacy format's RNG states (np.random.get_state()): its pickled state, unread."""

    def __setstate__(self, state):
        self.state = state


class NumpyDType(NumpyArray):
    """numpy.dtype(...) of such an array."""


def _ndarray(*args):
    return NumpyArray()


# Megatron-LM's legacy files (model_optim_rng.pt) pickle the RNG states whole, numpy's among them
LEGACY_ALLOWED: dict = {**COMMON_ALLOWED, ("numpy", "ndarray"): NumpyArray, ("numpy", "dtype"): NumpyDType,
                        ("numpy.core.multiarray", "_reconstruct"): _ndarray,
                        ("numpy._core.multiarray", "_reconstruct"): _ndarray}


class SavePlan(Record):
    pass


class WriteItem(Record):
    pass


class TensorWriteData(Record):
    pass


class MCoreSavePlan(SavePlan):
    """megatron-core 0.15's SavePlan, with its sharded tensors' `mcore_data`."""


class MCoreMetadata(dcp_metadata.Metadata):
    """megatron-core 0.15's `.metadata`: DCP's Metadata with the sharded tensors' `mcore_data` (their
    flattened ranges) beside it."""


_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
METADATA_ALLOWED: dict = {**dcp_metadata.ALLOWED,
                          (_MCORE_TORCH, "MCoreMetadata"): MCoreMetadata,
                          (_MCORE_TORCH, "MCoreSavePlan"): MCoreSavePlan,
                          (_PLANNER, "SavePlan"): SavePlan, (_PLANNER, "WriteItem"): WriteItem,
                          (_PLANNER, "TensorWriteData"): TensorWriteData,
                          (_PLANNER, "WriteItemType"): _enum(f"{_PLANNER}.WriteItemType")}
