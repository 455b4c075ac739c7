"""The ZeRO files of one model-parallel rank: what it holds (a RankParams) cut for the target dp and stage."""
from __future__ import annotations

from reshard.formats.deepspeed import zero3_writer, zero12_writer
from reshard.formats.deepspeed.rank_params import RankParams
from reshard.formats.deepspeed.zero_target import ZeroTarget


def rank_files(zt: ZeroTarget, params: RankParams, tag: str, extra: dict | None = None) -> list:
    """The model-states and optimizer files of model-parallel rank params.mp_rank at the target dp; `extra`: the
    keys the engine adds to its model states (universal_checkpoint_info; shared_params when not the model's)."""
    extra, out = extra or {}, []
    if zt.stage == 3:
        groups = zero3_writer.sub_groups(zt, params)
        for rank in range(zt.dp):
            out.append(zero3_writer.model_states(zt, params, rank, groups, tag, extra))
            out.append(zero3_writer.optim_states(zt, params, rank, groups, tag))
    else:
        groups = zero12_writer.flat_groups(zt, params)
        out.append(zero12_writer.model_states(zt, params, groups, tag, extra))
        for rank in range(zt.dp):
            out.append(zero12_writer.optim_states(zt, params, rank, groups, tag))
    return out
