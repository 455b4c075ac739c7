"""FSDP1's optimizer state as verl saves it (torch.optim's state_dict() over FSDP's flat parameters, each rank's file
its block of every flat parameter, keyed by the flat parameter's index), mapped to the model's parameters: read into
a catalog, and each rank's blocks at another world size written from it (flat_params.py says which parameters each
flat parameter holds).
"""
from __future__ import annotations

import math
from typing import Any

from reshard.core.catalog import MODULE, CatalogBuilder, Fragment, ScalarTensor, TensorDraft, TensorKey
from reshard.core.write_requests import Piece
from reshard.errors import CheckpointError
from reshard.execution.source_bytes import read_scalar
from reshard.formats.torchsave_read import TensorRef
from reshard.formats.verl.flat_params import FlatParam, cuts


def flat_params(params: list[tuple[str, int]], optimizers: list[tuple[str, Any]],
                world: int) -> tuple[FlatParam, ...]:
    """The flat parameters, in the optimizer's index order, from the model's params ((name, numel) in order) and each
    rank's optimizer state_dict: the one cut of the params their block sizes allow, else the file refused."""
    file0, first = optimizers[0]
    indices = sorted(i for g in first["param_groups"] for i in g["params"])
    if indices != list(range(len(indices))):
        raise CheckpointError(file0, f"param groups list flat parameters {indices}, not 0..{len(indices) - 1}")
    blocks = []
    for i in indices:
        moments = [v for v in (first["state"].get(i) or {}).values() if isinstance(v, TensorRef) and v.shape]
        if not moments:
            raise CheckpointError(file0, f"flat parameter {i} has no optimizer state (never stepped): its size, "
                                         "which tells its parameters, is not saved")
        blocks.append(math.prod(moments[0].shape))
    found = cuts(params, blocks, world)
    if len(found) != 1:
        raise CheckpointError(file0, f"FSDP1's flat parameters (blocks of {blocks} elements at {world} ranks) "
                                     f"match {'no' if not found else 'more than one'} cut of the model's parameters "
                                     "in order")
    return found[0]


def read(catalog: CatalogBuilder, flat: tuple[FlatParam, ...], optimizers: list[tuple[str, Any]],
         world: int) -> None:
    """Each flat parameter's state into its parameters' logical tensors: rank r's block is the flat elements
    [r*c, (r+1)*c) (c = ceil(N / world)), the last blocks' padding past N belonging to no parameter."""
    file0, first = optimizers[0]
    catalog.param_groups, catalog.group_scalars = [], [{} for _ in first["param_groups"]]
    for g, group in enumerate(first["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        catalog.param_groups.append({**hyper, "params": [n for i in group["params"] for n in flat[i].names]})
        for i in group["params"]:
            unit = flat[i]
            block = math.ceil(unit.numel / world)
            for key, value in first["state"][i].items():
                if isinstance(value, TensorRef) and not value.shape:
                    for name in unit.names:
                        catalog.record_param_scalar(g, name, key, ScalarTensor(read_scalar(value), value.dtype),
                                                    file0)
                    continue
                if not isinstance(value, TensorRef):
                    for name in unit.names:
                        catalog.record_param_scalar(g, name, key, value, file0)
                    continue
                for name in unit.names:
                    module = catalog.tensors[TensorKey(name, MODULE)]
                    catalog.add(TensorDraft(name, key, module.shape, value.dtype), file0)
                for rank, (file, state) in enumerate(optimizers):
                    local = state["state"][i][key]
                    if not isinstance(local, TensorRef) or math.prod(local.shape) != block:
                        raise CheckpointError(file, f"flat parameter {i} ({key}): not a block of {block} elements")
                    start = rank * block
                    for name, at, count, offset in unit.runs(start, min(start + block, unit.numel)):
                        catalog.tensors[TensorKey(name, key)].fragments.append(
                            Fragment(at, at + count, local.storage, local.storage_offset + offset, rank))


def pieces(unit: FlatParam, state: str, world: int, rank: int) -> list[Piece]:
    """Rank `rank`'s block of flat parameter `unit`'s `state` at `world` ranks: its parameters' runs, then zeros."""
    block = math.ceil(unit.numel / world)
    start = rank * block
    out = [Piece(count, (name, state), at) for name, at, count, _ in unit.runs(start, min(start + block, unit.numel))]
    held = sum(p.count for p in out)
    return out + ([Piece.zeros(block - held)] if held < block else [])
