"""Catalog of a tensor-parallel save x target Layout -> the files of every TP rank at the target tp and dp.

Each target TP rank t is written by the ordinary ZeRO writer (writer.rank_files) over a view of the
catalog whose parameters have t's shard shapes; the pieces it asks for (flat ranges of a shard) are
then turned into pieces of the full logical tensors, along the runs the rank's boxes make in them
(tp_geometry.run_arrays). The planner and executor see nothing new.

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

import numpy as np

from reshard.catalog import Catalog, LogicalTensor, ParamInfo
from reshard.errors import ReshardError
from reshard.formats.deepspeed import writer
from reshard.formats.deepspeed.tp_geometry import Split, run_arrays
from reshard.layout import Layout
from reshard.targets import Piece


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    source = catalog.layout
    if source.pp != 1 or target.pp != 1 or catalog.state.get("pipe_layer_files"):
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
        splits, extra = catalog.tp_splits, catalog.state.get("mp_rank_extra") or {}
    out = []
    for rank in range(target.tp):
        view, runs = _rank_view(catalog, rank, splits)
        files = writer.rank_files(writer._Context(view, target, mp_rank=rank, model_extra=extra.get(rank)), tag)
        for file in files:
            file.pieces = {key: _to_full(pieces, runs) for key, pieces in file.pieces.items()}
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


def _rank_view(catalog: Catalog, rank: int, splits: dict) -> tuple:
    """A catalog with rank's shard shapes (no fragments: only shapes, dtypes and groups are read from it)
    and, per param, the runs (full start, shard start, length) its shard is made of, by shard start."""
    view = Catalog(root=catalog.root, format=catalog.format, layout=catalog.layout)
    view.aliases, view.order = dict(catalog.aliases), list(catalog.order)
    view.param_groups, view.group_scalars = catalog.param_groups, catalog.group_scalars
    view.state = catalog.state
    runs = {}
    for name, info in catalog.params.items():
        split = splits.get(name)
        if split is None:
            raise ReshardError.at(catalog.root, f"{name}: how tensor parallelism cut it is unknown")
        shape = _shard_shape(name, split, rank)
        view.params[name] = ParamInfo(name, shape, info.kind, info.group)
        f, s, n = run_arrays(split, rank, shape, primary_only=False)
        order = np.argsort(s, kind="stable")
        runs[name] = (f[order], s[order], n[order])
        if int(n.sum()) != math.prod(shape):
            raise ReshardError.at(catalog.root, f"{name}: tensor-parallel rank {rank}'s boxes do not tile its shard")
    for (name, state), tensor in catalog.tensors.items():
        view.tensors[(name, state)] = LogicalTensor(name, state, view.params[name].shape, tensor.dtype)
    return view, runs


def _to_full(pieces: list, runs: dict) -> list:
    """Pieces over shard elements -> pieces over the full tensors' elements, run by run."""
    out = []
    for piece in pieces:
        if piece.source is None:
            out.append(piece)
            continue
        f, s, n = runs[piece.source[0]]
        lo, hi = piece.start, piece.start + piece.count
        i = max(0, int(np.searchsorted(s, lo, side="right")) - 1)
        while lo < hi:
            a, length = int(s[i]), int(n[i])
            take = min(hi, a + length) - lo
            out.append(Piece(take, piece.source, int(f[i]) + lo - a))
            lo += take
            i += 1
    return out
