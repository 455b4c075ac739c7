"""Catalog of a tensor-parallel save x target Layout -> the files of every TP rank at the target tp and dp.

Each target TP rank t is written by the ordinary ZeRO writer (writer.rank_files) over a view of the
catalog whose parameters have t's shard shapes; the pieces it asks for (flat ranges of a shard) are
then marked as flat ranges of t's shard of the full logical tensor (tp_geometry.Split.shard), which
the planner meets with the source's own shards.

Which boxes a TP rank holds at the target degree:
* tp=1: every tensor whole (what the engine without AutoTP saves: no universal_checkpoint_info);
* the source's own degree: the boxes the source was read with, and each rank's own
  universal_checkpoint_info (its affine map is stated for that degree) carried over;
* any other degree > 1 (from tp=1 too): AutoTP's cut there and its universal_checkpoint_info, re-derived
  as the engine computes them from the rule file and the key-value head count (tp_recut).
Pipeline-parallel sources and targets are written by pipe_writer.
"""
from __future__ import annotations

import math
from dataclasses import replace

from reshard.catalog import Catalog, LogicalTensor, ParamInfo
from reshard.errors import ReshardError
from reshard.formats.deepspeed import notes, writer
from reshard.formats.deepspeed.tp_geometry import Split
from reshard.layout import Layout


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    source = catalog.layout
    if source.pp != 1 or target.pp != 1 or notes.of(catalog).pipe_layer_files:
        from reshard.formats.deepspeed import pipe_writer      # a PipelineModule's save, at any pp
        return pipe_writer.target_files(catalog, target, tag, source_save_dir)
    if target.tp > 1 and target.zero not in (1, 2):
        raise ReshardError(f"target {target.topology()}: a tensor-parallel target is written for ZeRO-1/2 only "
                           "(what AutoTP trains with)")
    if target.tp == 1:
        return writer.rank_files(writer._Context(catalog, target), tag) + writer.closing_files(tag, source_save_dir)
    if target.tp != source.tp:               # a new degree: AutoTP's cut and its info there (tp_recut)
        from reshard.formats.deepspeed import tp_recut
        splits, extra = tp_recut.recut(catalog, target)
    else:
        splits, extra = notes.of(catalog).tp_splits, notes.of(catalog).mp_rank_extra
    out = []
    for rank in range(target.tp):
        view, shards = rank_view(catalog, rank, splits)
        files = writer.rank_files(writer._Context(view, target, mp_rank=rank, model_extra=extra.get(rank)), tag)
        for file in files:
            file.pieces = {key: on_shards(pieces, shards) for key, pieces in file.pieces.items()}
        out += files
    return out + writer.closing_files(tag, source_save_dir)


def _shard_shape(name: str, split: Split, rank: int) -> tuple:
    """The shard rank holds: the bounding box of its pieces, which must fill it (no padding rows)."""
    pieces = split.pieces.get(rank, [])
    if not pieces:
        raise ReshardError(f"{name}: tensor-parallel rank {rank} holds no part of it; not supported")
    shape = tuple(max(p.shard_start[d] + p.shape[d] for p in pieces) for d in range(len(split.full_shape)))
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape):
        raise ReshardError(f"{name}: tensor-parallel rank {rank}'s shard {list(shape)} holds elements outside the "
                           "full tensor (vocabulary padding); writing it is not supported")
    return shape


def rank_view(catalog: Catalog, rank: int, splits: dict) -> tuple:
    """A catalog with rank's shard shapes (no fragments: only shapes, dtypes and groups are read from it)
    and, per param, rank's shard of the full tensor (tp_geometry.Split.shard, every block it holds)."""
    view = Catalog(root=catalog.root, format=catalog.format, layout=catalog.layout)
    view.aliases, view.order = dict(catalog.aliases), list(catalog.order)
    view.param_groups, view.group_scalars = catalog.param_groups, catalog.group_scalars
    view.tag, view.training, view.notes = catalog.tag, catalog.training, catalog.notes
    shards = {}
    for name, info in catalog.params.items():
        split = splits.get(name)
        if split is None:
            raise ReshardError.at(catalog.root, f"{name}: how tensor parallelism cut it is unknown")
        shape = _shard_shape(name, split, rank)
        view.params[name] = ParamInfo(name, shape, info.kind, info.group)
        shards[name] = split.shard(rank, shape, held="all")
    for (name, state), tensor in catalog.tensors.items():
        view.tensors[(name, state)] = LogicalTensor(name, state, view.params[name].shape, tensor.dtype)
    return view, shards


def on_shards(pieces: list, shards: dict) -> list:
    """Pieces over a rank's shard-shaped view -> the same pieces, of that rank's shards of the full tensors."""
    return [p if p.source is None else replace(p, shard=shards[p.source[0]]) for p in pieces]
