"""Catalog x target Layout -> the files DeepSpeed itself writes for that topology and ZeRO stage.

Each model-parallel rank's files are the ZeRO files (zero_files.rank_files) of what the rank holds, a
RankParams composed of the target's placements (rank_params): every param whole here, TP shards in
tp_writer, a TP rank's pipeline stage in pipe_writer. The partition arithmetic mirrors DeepSpeed 0.19
(zero12_writer, zero3_writer; zero12.py and zero3.py read the same files); everything is arithmetic on
names and counts, the bytes are described as Pieces.
"""
from __future__ import annotations

from reshard.core.catalog import Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import Output
from reshard.errors import ReshardError, UsageError
from reshard.formats import weights_only
from reshard.formats.deepspeed import expert_writer, model_only, notes, pipe_writer, rank_params, topology, tp_writer
from reshard.formats.deepspeed.zero_files import rank_files
from reshard.formats.deepspeed.zero_target import TARGET, ZeroTarget, closing_files

PLACES_EXPERTS = True     # expert_writer
RESUMED_BY_FRAMEWORKS = True
SAVES_OWN_NAMES = False
OWN_RANK_STATE = False

def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    # a model alone (never trained here: no optimizer state, not a thinned checkpoint), as a fine-tune starts from it
    if not catalog.param_groups and not weights_only.is_thinned(catalog.root):
        return model_only.target_files(catalog, target, tag)
    _check_convertible(catalog, target)
    source = catalog.layout
    zero = topology.of(target).zero
    if zero not in topology.STAGES:
        # a source with no ZeRO stage of its own (DCP, torch.save, universal) keeps "0" unless --to names one
        none = topology.of(source).zero not in topology.STAGES
        hint = " (the source has none: name one, e.g. --to zero=2)" if none else ""
        raise UsageError(f"target ZeRO stage {zero}: only stages 1, 2 and 3 can be written{hint}")
    if catalog.experts is not None:          # a mixture of experts: its placement is one more map
        return expert_writer.target_files(catalog, target, tag, source_save_dir)
    expert_writer.refuse_ep_without_experts(catalog, target)
    if source.pp != 1 or target.pp != 1 or notes.of(catalog).pipe_layer_files:   # a PipelineModule's save
        return pipe_writer.target_files(catalog, target, tag, source_save_dir)
    if target.tp != 1 or source.tp != 1:
        return tp_writer.target_files(catalog, target, tag, source_save_dir)
    return (rank_files(ZeroTarget(catalog, target), rank_params.whole(catalog), tag)
            + closing_files(tag, source_save_dir))


def _check_convertible(catalog: Catalog, target: Layout) -> None:
    """What a source must hold for DeepSpeed to resume from it, whatever the topology."""
    weights_only.needs_optimizer(catalog, "a DeepSpeed checkpoint")
    catalog.scalars_of_groups(TARGET)      # refuses params of a group whose steps differ
    unsure = catalog.maybe_buffers
    if topology.of(target).zero == 3 and unsure:
        raise ReshardError.at(catalog.root, f"{unsure[0]} (and {len(unsure) - 1} more) is a frozen parameter or a "
                                            "floating-point buffer, the source does not say which, and ZeRO-3 "
                                            "stores the two differently; convert to zero=1 or zero=2")


def output_tag(catalog, tag: str) -> str:
    return tag


def describe(target: Layout, tag: str) -> Output:
    """DeepSpeed files are those of one topology and ZeRO stage, in a tag folder."""
    return Output("deepspeed", target.topology(), tag)


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    """What happens to DeepSpeed's train_batch_size when dp changes, and which setting keeps it."""
    config = (notes.of(catalog).ds_config or {})
    micro = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps", 1)
    source_dp = catalog.layout.dp
    if not micro or source_dp == target.dp:
        return None
    before = config.get("train_batch_size", micro * gas * source_dp)
    after = micro * gas * target.dp
    if before == after:
        return None
    advice = f"train_batch_size {before} -> {after} unless the config changes"
    if before % (micro * target.dp) == 0:
        advice += f": set gradient_accumulation_steps {gas} -> {before // (micro * target.dp)}"
    elif before % (gas * target.dp) == 0:
        advice += f": set train_micro_batch_size_per_gpu {micro} -> {before // (gas * target.dp)}"
    else:
        advice += (f": no whole gradient_accumulation_steps (micro batch {micro}) or micro batch size keeps "
                   f"{before} at dp={target.dp}")
    return advice
