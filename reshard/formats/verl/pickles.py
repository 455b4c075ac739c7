"""The allow-list verl's rank files are read with: torch's own globals and the classes a pickled DTensor names
(its spec, device mesh, placements), as inert stand-ins that keep what they were given. A DTensor becomes a
ShardRef: this rank's local tensor (a TensorRef) with the global shape and placements. Nothing of torch.distributed
or verl is imported or run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.formats import torchsave_read
from reshard.formats.torchsave_read import TensorRef


class _Bag:
    """An object restored from NEWOBJ + BUILD (or a REDUCE of its class): its attributes, nothing run."""
    args: tuple = ()

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.__dict__.update(_state(state))


class DTensorSpec(_Bag):
    pass


class Shard(_Bag):
    """torch's Shard(dim) placement."""

    @property
    def dim(self) -> int:
        return int(self.__dict__.get("dim", self.args[0] if self.args else 0))


class Replicate(_Bag):
    pass


@dataclass(frozen=True)
class _DTensorClass:
    """What `torch.distributed.tensor.DTensor` unpickles to."""


@dataclass
class ShardRef:
    """A pickled DTensor: this rank's `local` tensor of a tensor of `shape`, placed by `placements` over a device
    mesh of `mesh_shape` on `device_type` ranks, its dims named `mesh_dims`."""
    local: TensorRef | None
    shape: tuple
    dtype: str
    placements: tuple = ()
    mesh_shape: tuple = ()
    mesh_dims: tuple = ()
    device_type: str = ""
    mesh_groups: tuple = ()     # its process groups' names, one a dim


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad=False):
    name = getattr(dtype, "name", str(dtype))
    return ShardRef(None, tuple(size), name)


def _state(state) -> dict:
    """A pickled object state as one dict: a (dict, slots) pair (DTensor keeps its own in slots) merged."""
    if isinstance(state, tuple):
        return {k: v for part in state if isinstance(part, dict) for k, v in part.items()}
    return state if isinstance(state, dict) else {}


def _rebuild_from_type_v2(func, new_type, args, state):
    made = func(*args)
    if isinstance(made, ShardRef):
        state = _state(state)
        made.local = state.get("_local_tensor")
        spec = state.get("_spec")
        made.placements = tuple(getattr(spec, "placements", ()) or ())
        mesh = getattr(spec, "mesh", None)
        axes = getattr(getattr(mesh, "_layout", None), "axes", ())
        made.mesh_shape = tuple(math.prod(getattr(a, "shape", ())) for a in axes)
        made.mesh_dims = tuple(getattr(mesh, "_mesh_dim_names", None) or ())
        made.device_type = str(getattr(mesh, "_device_type", ""))
        made.mesh_groups = tuple(getattr(mesh, "_dim_group_names", None) or ())
        return made
    if isinstance(made, TensorRef):     # a plain tensor subclass: its Python attributes kept, as torch's own list does
        made.attrs.update(_state(state))
    return made


def _inert(*args):
    return args


ALLOWED: dict = {
    **torchsave_read.ALLOWED,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.distributed.tensor", "DTensor"): _DTensorClass(),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): DTensorSpec,
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): type("TensorMeta", (_Bag,), {}),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): type("ShardOrderEntry", (_Bag,), {}),
    ("torch.distributed.tensor.placement_types", "Shard"): Shard,
    ("torch.distributed.tensor.placement_types", "Replicate"): Replicate,
    ("torch.distributed.device_mesh", "DeviceMesh"): type("DeviceMesh", (_Bag,), {}),
    ("torch.distributed._mesh_layout", "_MeshLayout"): type("MeshLayout", (_Bag,), {}),
    ("torch.distributed._mesh_layout", "_FlatLayout"): type("FlatLayout", (_Bag,), {}),
    ("torch.serialization", "_get_layout"): _inert,
    ("torch", "device"): _inert,
    # the extra-state file's RNG states (numpy's np.random.get_state()): kept as pickled, unread
    ("numpy", "ndarray"): type("NumpyArray", (_Bag,), {}),
    ("numpy", "dtype"): type("NumpyDType", (_Bag,), {}),
    ("numpy._core.multiarray", "_reconstruct"): type("NumpyArray", (_Bag,), {}),
    ("numpy.core.multiarray", "_reconstruct"): type("NumpyArray", (_Bag,), {}),
}


def load(path: str) -> object:
    """A verl rank file unpickled through verl's allow-list (its DTensors ShardRefs, nothing run)."""
    return torchsave_read.load(path, allowed=ALLOWED)
