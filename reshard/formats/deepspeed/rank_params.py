"""What one target model-parallel rank holds, composed from the placements that cut the model.

A `RankParams` lists, in model order, each parameter a rank's files hold: its local shape, kind, optimizer
group, the dtype of its saved module copy, and which `Shard` of the full tensor it is (reshard.core.placement;
None: the whole tensor). It is built by composing, outermost first:
* tensor parallelism at the target degree: `tp_rank` gives every parameter the boxes the rank holds
  (tp_geometry.Split.shard) and that shard's shape;
* a pipeline stage: `RankParams.subset` keeps the parameters the stage trains, in the stage's order
  (pipe_writer decides which);
* expert parallelism (expert_writer): a rank's experts, a box of a packed tensor or a renamed expert param;
* data parallelism adds nothing here: ZeRO cuts a rank's parameters into flat ranges of their shards, which
  the ZeRO writers (zero12_writer, zero3_writer) compute and emit as Pieces with each parameter's shard.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from reshard.core.catalog import MODULE, Catalog, TensorKey
from reshard.core.placement import Shard
from reshard.core.write_requests import Piece
from reshard.errors import ReshardError


@dataclass(frozen=True)
class RankParam:
    name: str
    shape: tuple                # what the rank holds: its shard's shape (the full shape when whole)
    kind: str                   # "trainable", "frozen" or "buffer"
    group: int | None           # optimizer param group of a trainable param
    module_dtype: str | None    # dtype of the saved module copy; None: none saved (the master copy is cast)
    shard: Shard | None = None  # which shard of the full tensor the local elements are; None: the tensor itself
    source: str | None = None   # the logical tensor, when the rank names it otherwise (deepspeed.moe's local experts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def piece(self, state: str, start: int, count: int) -> Piece:
        """`count` elements of this rank's `state` of the param from local flat element `start`."""
        return Piece(count, (self.source or self.name, state), start, shard=self.shard)


@dataclass(frozen=True)
class RankParams:
    params: tuple                # RankParam, model order
    order: tuple                 # the model's state_dict keys, tied names too
    aliases: tuple               # (tied name, name holding the data), in the source's order
    groups: tuple                # per optimizer param group, its param names held here, in optimizer order
    mp_rank: int = 0             # the model-parallel rank whose files these are
    weights_in_layer_files: bool = False   # a pipeline stage: the module weights are in layer files

    @cached_property
    def by_name(self) -> dict:
        return {p.name: p for p in self.params}

    def of_kind(self, kind: str) -> list:
        return [p for p in self.params if p.kind == kind]

    def subset(self, order, mp_rank: int, weights_in_layer_files: bool) -> RankParams:
        """The params named in `order` (a pipeline stage's), in that order; groups keep that order too, and
        no tied names (a stage's module is in its layer files)."""
        order = tuple(order)
        groups = tuple(tuple(n for n in order if n in set(group)) for group in self.groups)
        return RankParams(tuple(self.by_name[n] for n in order), order, (), groups, mp_rank, weights_in_layer_files)


def whole(catalog: Catalog) -> RankParams:
    """Every parameter whole: what a rank holds without model parallelism."""
    return _compose(catalog, {name: (info.shape, None) for name, info in catalog.params.items()})


def tp_rank(catalog: Catalog, rank: int, splits: Mapping[str, Any]) -> RankParams:
    """Tensor-parallel rank `rank`'s shards at the degree `splits` (name -> tp_geometry.Split) cut; its mp rank
    is `rank` (without pipeline stages)."""
    placed = {}
    for name in catalog.params:
        split = splits.get(name)
        if split is None:
            raise ReshardError.at(catalog.root, f"{name}: how tensor parallelism cut it is unknown")
        shape = _shard_shape(name, split, rank)
        placed[name] = (shape, split.shard(rank, shape, held="all"))
    return _compose(catalog, placed, rank)


def _compose(catalog: Catalog, placed: dict, mp_rank: int = 0) -> RankParams:
    params = []
    for name, info in catalog.params.items():
        module = catalog.tensors.get(TensorKey(name, MODULE))
        shape, shard = placed[name]
        params.append(RankParam(name, tuple(shape), info.kind, info.group,
                                module.dtype if module is not None else None, shard))
    groups = tuple(tuple(group["params"]) for group in catalog.param_groups)
    return RankParams(tuple(params), tuple(catalog.tensor_order()), tuple(catalog.aliases.items()), groups, mp_rank)


def _shard_shape(name: str, split, rank: int) -> tuple:
    """The shard rank holds: the bounding box of its pieces, which must fill it (no padding rows)."""
    pieces = split.pieces.get(rank, [])
    if not pieces:
        raise ReshardError(f"{name}: tensor-parallel rank {rank} holds no part of it; not supported")
    shape = tuple(max(p.shard_start[d] + p.shape[d] for p in pieces) for d in range(len(split.full_shape)))
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape):
        raise ReshardError(f"{name}: tensor-parallel rank {rank}'s shard {list(shape)} holds elements outside the "
                           "full tensor (vocabulary padding); writing it is not supported")
    return shape
