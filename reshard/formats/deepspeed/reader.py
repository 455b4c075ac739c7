"""DeepSpeed checkpoints -> Catalog: the format's reader (options, sniff, read).

A save without model parallelism is one rank's files (rank_reader); with tensor or pipeline parallelism
every model-parallel rank is read so and the ranks are put together as full tensors (parallel).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from reshard.core.catalog import Catalog, CatalogBuilder
from reshard.errors import ReshardError
from reshard.formats.deepspeed import files as names, notes, parallel, rank_reader
from reshard.formats.framework import lightning
from reshard.storage import files as fs

FORMAT = "deepspeed"


@dataclass(frozen=True)
class Options:
    tag: str | None = None            # the tag folder (default: the one `latest` names)
    # the path of a rule file (reshard.formats.read found a shipped one by name) saying how tensor parallelism cut
    # each parameter, for tensor-parallel checkpoints that do not carry `universal_checkpoint_info`
    layout_rules: str | None = None


OPTIONS = Options
IN_FRAMEWORK_FOLDERS = True


def sniff(path: str, tag: str | None) -> bool:
    """A save dir or tag folder; with a tag, also a save dir without `latest` that holds that folder."""
    return fs.isdir(path) and (names.is_deepspeed_dir(path) or
                                    (tag is not None and fs.isdir(os.path.join(path, tag))))


def read(path: str, options: Options) -> Catalog:
    tag_dir, tag = names.resolve_tag_dir(path, options.tag)
    layout_rules = options.layout_rules
    try:
        catalog = _read(tag_dir, tag, layout_rules)
        if layout_rules:        # also how AutoTP would cut it at another degree (tp_recut)
            catalog.notes = replace(notes.of(catalog), tp_rules=layout_rules)
        catalog.framework = lightning.detect(fs.abspath(path), notes.of(catalog).client_state)
        return catalog.freeze()
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        # The files unpickled safely but do not hold what DeepSpeed writes where it writes it.
        raise ReshardError.at(tag_dir, f"not the structure DeepSpeed writes ({type(e).__name__}: {e})") from None


def _read(tag_dir: str, tag: str, layout_rules) -> CatalogBuilder:
    listing = sorted(fs.listdir(tag_dir))
    _refuse_unsupported(tag_dir, listing)
    model0_name = rank_reader.first_model_states(tag_dir, listing)
    model0 = rank_reader.load_or_raise(os.path.join(tag_dir, model0_name))
    mp = int(model0.get("mp_world_size") or 1)
    dims = model0.get("checkpoint_parallel_dimensions") or {}
    if mp > 1 or dims.get("tp_degree", 1) > 1 or dims.get("pp_degree", 1) > 1 \
            or any(names.LAYER_STATES.match(n) for n in listing):
        return parallel.read(tag_dir, tag, listing, model0, layout_rules)
    return rank_reader.read_mp_rank(tag_dir, tag, listing, 0, model0_name, model0)


def _refuse_unsupported(tag_dir, listing):
    if any(names.EXPERT_OPTIM_STATES.match(n) for n in listing):
        raise ReshardError.at(tag_dir, "mixture-of-experts checkpoints without ZeRO (expp_rank_* optimizer files) "
                                       "are not supported")
