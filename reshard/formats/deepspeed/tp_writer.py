"""Catalog of a tensor-parallel save x target Layout -> the files of every TP rank at the target tp and dp.

Each target TP rank t holds its shard of every parameter (rank_params.tp_rank: tp_geometry.Split.shard at
the target degree); the ZeRO writer cuts those shards into flat partitions, so every piece it emits is a
flat range of t's shard of the full tensor, which the planner meets with the source's own shards.

Which boxes a TP rank holds at the target degree:
* tp=1: every tensor whole (what the engine without AutoTP saves: no universal_checkpoint_info);
* the source's own degree: the boxes the source was read with, and each rank's own
  universal_checkpoint_info (its affine map is stated for that degree) carried over;
* any other degree > 1 (from tp=1 too): AutoTP's cut there and its universal_checkpoint_info, re-derived
  as the engine computes them from the rule file and the key-value head count (tp_recut).
Pipeline-parallel sources and targets are written by pipe_writer.
"""
from __future__ import annotations

from reshard.core.catalog import Catalog
from reshard.core.layout import Layout
from reshard.errors import ReshardError
from reshard.formats.deepspeed import notes, rank_params, topology, tp_recut
from reshard.formats.deepspeed.zero_files import rank_files
from reshard.formats.deepspeed.zero_target import ZeroTarget, closing_files


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    if target.tp > 1 and topology.of(target).zero not in (1, 2):
        raise ReshardError(f"target {target.topology()}: a tensor-parallel target is written for ZeRO-1/2 only "
                           "(what AutoTP trains with)")
    tp_recut.check_kv_heads(catalog, target)
    zt = ZeroTarget(catalog, target)
    if target.tp == 1:
        return rank_files(zt, rank_params.whole(catalog), tag) + closing_files(tag, source_save_dir)
    if target.tp != catalog.layout.tp:        # a new degree: AutoTP's cut and its info there (tp_recut)
        splits, extra = tp_recut.recut(catalog, target)
    else:
        splits, extra = notes.of(catalog).tp_splits, notes.of(catalog).mp_rank_extra
    out = []
    for rank in range(target.tp):
        out += rank_files(zt, rank_params.tp_rank(catalog, rank, splits), tag, extra.get(rank))
    return out + closing_files(tag, source_save_dir)
