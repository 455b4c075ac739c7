"""A DTensor written as torch.save pickles one (torch 2.13, the FSDP2 sharded state dicts verl saves), spelled by
name: nothing of torch.distributed is imported or run. `torch.load(weights_only=False)` gives it back as a DTensor
whose local tensor is the slot, its global shape and placement (Shard(0)) and its device mesh: a 1-D mesh of the
target's ranks, equal (DeviceMesh.__eq__: ranks, layout, device type, dim names) to the one verl's workers build at
that world size, so FSDP's load_state_dict copies it in.

The cached hashes torch pickles with a spec and a mesh are written as None: each is recomputed on first use, where a
saved one was the hash of the process that saved it.
"""
from __future__ import annotations

from collections.abc import Sequence

from reshard.core.geometry import strides
from reshard.core.write_requests import NewTensor
from reshard.formats.torchsave_read import DType, Size
from reshard.formats.torchsave_write import GlobalName, PickledAs

_DIST = "torch.distributed"
_SPEC = f"{_DIST}.tensor._dtensor_spec"
_REBUILD_FROM_TYPE = GlobalName("torch._tensor", "_rebuild_from_type_v2")
_WRAPPER = GlobalName("torch._utils", "_rebuild_wrapper_subclass")
_DTENSOR = GlobalName(f"{_DIST}.tensor", "DTensor")
_DTENSOR_SPEC = GlobalName(_SPEC, "DTensorSpec")
_TENSOR_META = GlobalName(_SPEC, "TensorMeta")
_SHARD_ORDER = GlobalName(_SPEC, "ShardOrderEntry")
_SHARD = GlobalName(f"{_DIST}.tensor.placement_types", "Shard")
_MESH = GlobalName(f"{_DIST}.device_mesh", "DeviceMesh")
_MESH_LAYOUT = GlobalName(f"{_DIST}._mesh_layout", "_MeshLayout")
_FLAT_LAYOUT = GlobalName(f"{_DIST}._mesh_layout", "_FlatLayout")
_GET_LAYOUT = GlobalName("torch.serialization", "_get_layout")
_DEVICE = GlobalName("torch", "device")


def mesh(world: int, rank: int, dims: Sequence[str], device_type: str, groups: Sequence[str],
         rank_map: NewTensor) -> PickledAs:
    """Rank `rank`'s DeviceMesh over `world` ranks in one dim; `rank_map` a slot holding 0..world-1 (int32)."""
    # _FlatLayout coalesces a dim of one rank to the empty layout, as torch builds it
    flat = {"shape": (world,), "stride": (1,)} if world > 1 else {"shape": (), "stride": ()}
    layout = PickledAs(_MESH_LAYOUT, (), {"axes": (PickledAs(_FLAT_LAYOUT, (), flat, new=True),)}, new=True)
    state = {"_device_type": device_type, "_layout": layout, "_rank_map": rank_map, "_mesh_dim_names": tuple(dims),
             "_root_mesh": None, "_flatten_rank_map": tuple(range(world)), "_thread_id": None,
             "_flatten_mapping": {}, "_dim_group_names": list(groups), "_rank": rank, "_coordinate_on_dim": (rank,),
             "_hash": None}
    return PickledAs(_MESH, (), state, new=True)


def sharded(local: NewTensor, shape: Sequence[int], dtype: str, device_mesh: PickledAs) -> PickledAs:
    """A DTensor of `shape` sharded on dim 0 over `device_mesh`, this rank's rows in `local` (torch.chunk's)."""
    stride = strides(shape)
    meta = PickledAs(_TENSOR_META, (Size(shape), stride, DType(dtype)), new=True)
    spec = PickledAs(_DTENSOR_SPEC, (), {
        "mesh": device_mesh, "placements": (PickledAs(_SHARD, (), {"dim": 0}, new=True),), "tensor_meta": meta,
        "shard_order": (PickledAs(_SHARD_ORDER, (0, (0,)), new=True),), "use_strided_shard_as_shard_order": False,
        "_hash": None}, new=True)
    # the wrapper holds the global shape and stride, on the CPU where its local storage is loaded
    wrapper = (_DTENSOR, DType(dtype), tuple(shape), stride, 0, PickledAs(_GET_LAYOUT, ("torch.strided",)),
               PickledAs(_DEVICE, ("cpu",)), False)
    return PickledAs(_REBUILD_FROM_TYPE, (_WRAPPER, _DTENSOR, wrapper,
                                          (None, {"_local_tensor": local, "_spec": spec})))
