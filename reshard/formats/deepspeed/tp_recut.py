"""AutoTP at a new tensor-parallel degree: the boxes each TP rank holds there, and the
`universal_checkpoint_info` the engine publishes at that degree.

DeepSpeed 0.19.8's AutoTP sizes each rank's block with module_inject/tp_shard.get_shard_size: a layer
cut by key-value heads (attention) gives rank r `kv_heads // tp + (r < kv_heads % tp)` heads when the
dimension divides by the head count, anything else (MLP, the vocabulary-parallel lm_head, attention
whose size does not divide) is cut evenly in grains of `tp_grain_size`, the first ranks taking the
remainder. Which of the two a parameter gets is said by the rule file (`"recut": "heads"|"even"`), the
head count by the user (`kv_heads=K` in the target spec): neither is guessed. When the source is
tensor parallel itself, the rules and head count are first replayed at the source's degree and must
give exactly the boxes the source was read with, else they do not describe this model: refused.

The published info follows layers.collect_autotp_universal_checkpoint_info: the pattern lists do not
depend on the degree (a source's own are kept), the affine map does (rebuilt per parameter, in the
order the source lists them; from rules: the cut parameters in model order, then the replicated ones).
"""
from __future__ import annotations

import copy
import re
from typing import Any

from reshard.core.geometry import offset, strides
from reshard.errors import ReshardError, UsageError
from reshard.formats.deepspeed import notes, topology
from reshard.formats.deepspeed.tp_geometry import Geometry, Split, contiguous, replicated

UC_VERSION = 0.4          # deepspeed/checkpoint/constants.py UNIVERSAL_CHECKPOINT_VERSION_VALUE (0.19.8)
AFFINE_VERSION = 1        # deepspeed/checkpoint/affine.py AFFINE_MAP_FORMAT_VERSION


def shard_sizes(total: int, tp: int, cut: str, kv_heads: int | None, grain: int) -> list:
    """Each rank's extent along the cut dim, as tp_shard.get_shard_size_list computes it."""
    if cut == "heads" and kv_heads and total % kv_heads == 0:
        return [total * (kv_heads // tp + (1 if r < kv_heads % tp else 0)) // kv_heads for r in range(tp)]
    if total >= grain:
        grains, remainder = divmod(total, grain)
        sizes = [(grains // tp + (1 if r < grains % tp else 0)) * grain for r in range(tp)]
        sizes[-1] += remainder
        return sizes
    return [total // tp + (1 if r < total % tp else 0) for r in range(tp)]


def recut(catalog, target) -> tuple:
    """(name -> Split at target.tp, tp rank -> model-states keys of that rank) for an AutoTP model."""
    where = f"{catalog.root}: tp={catalog.layout.tp} -> tp={target.tp}"
    tp_config = (notes.of(catalog).ds_config or {}).get("tensor_parallel")
    if not isinstance(tp_config, dict):
        raise ReshardError(f"{where}: the saved ds_config has no tensor_parallel section: not an AutoTP run")
    rules_path = notes.of(catalog).tp_rules
    if not rules_path:
        raise ReshardError(f"{where}: how AutoTP cuts each parameter at a new degree is not in the checkpoint; "
                           "give it with --layout-rules (rules with 'recut', e.g. --layout-rules llama-autotp)")
    grain = int(tp_config.get("tp_grain_size", 1) or 1)
    geometry = Geometry.from_rule_file(rules_path)
    kv_heads = topology.of(target).kv_heads
    cuts: dict[str, tuple[int, Any] | None] = {}            # name -> (dim, cut) or None (replicated)
    for name, info in catalog.params.items():
        if name in catalog.aliases:
            continue
        rule = geometry.rule_for(name)
        if rule is None and info.kind == "buffer" or rule is not None and rule.kind == "replicated":
            cuts[name] = None
        elif rule is not None and rule.kind == "split" and rule.recut:
            if rule.recut == "heads" and not kv_heads:
                raise ReshardError(f"{where}: AutoTP cuts {name} by key-value heads; give the model's count "
                                   "with kv_heads=K in the target spec")
            cuts[name] = (rule.dim if rule.dim >= 0 else len(info.shape) + rule.dim, rule.recut)
        else:
            raise ReshardError(f"{where}: {rules_path} does not say how AutoTP cuts {name} at another degree "
                               "(a rule with 'recut': 'heads' or 'even')")
    if catalog.layout.tp > 1:               # the rules must reproduce the source's own cut
        source_splits = notes.of(catalog).tp_splits
        for name, cut in cuts.items():
            again = _split(name, catalog.params[name].shape, cut, catalog.layout.tp, kv_heads, grain, where)
            if not _same_boxes(again, source_splits.get(name)):
                raise UsageError(f"{where}: {name}: the rules{' and kv_heads=' + str(kv_heads) if kv_heads else ''}"
                                 " do not give the cut the source was saved with; they do not describe this model")
    splits = {name: _split(name, catalog.params[name].shape, cut, target.tp, kv_heads, grain, where)
              for name, cut in cuts.items()}
    maps = {name: _affine(split, target.tp) for name, split in splits.items()}
    info = _uc_info(catalog, cuts, maps, geometry, where)
    extra = {rank: {"universal_checkpoint_info": info, "shared_params": dict(catalog.aliases) if rank == 0 else {}}
             for rank in range(target.tp)}
    return splits, extra


def check_kv_heads(catalog, target) -> None:
    """kv_heads=K (topology.of(target)) must describe every tensor the rule file (--layout-rules) says AutoTP cuts by
    key-value heads: K whole heads (or head groups) along its cut dim. Else AutoTP's cut (tp_shard falls back to
    an even one where K does not divide) would cut through a head: a usage error, before anything is written,
    whatever the degree (a count that cannot be the model's is refused even where the source's cut is kept)."""
    kv_heads, rules_path = topology.of(target).kv_heads, notes.of(catalog).tp_rules
    if not kv_heads or not rules_path:
        return
    where = f"{catalog.root}: tp={catalog.layout.tp} -> tp={target.tp}"
    geometry = Geometry.from_rule_file(rules_path)
    for name, info in catalog.params.items():
        rule = geometry.rule_for(name)
        if name in catalog.aliases or rule is None or rule.kind != "split" or rule.recut != "heads":
            continue
        dim = rule.dim if rule.dim >= 0 else len(info.shape) + rule.dim
        size = info.shape[dim]
        if size % kv_heads:
            raise UsageError(f"{where}: kv_heads={kv_heads} cannot describe {name}: its {size} rows along dim {dim} "
                             f"are not {kv_heads} whole heads ({size}/{kv_heads}); give the model's "
                             "num_key_value_heads")


def _split(name, shape, cut, tp, kv_heads, grain, where) -> Split:
    shape = tuple(shape)
    if cut is None:
        return replicated(name, {r: shape for r in range(tp)}, tp, "AutoTP leaves it whole")
    dim, how = cut
    sizes = shard_sizes(shape[dim], tp, how, kv_heads, grain)
    if min(sizes) <= 0:     # (the target's tp, or kv_heads fewer than it, cannot describe the tensor)
        heads = f" cut into kv_heads={kv_heads} heads" if how == "heads" and kv_heads else ""
        raise UsageError(f"{where}: {name}: {shape[dim]} along dim {dim}{heads} gives tensor-parallel rank "
                         f"{sizes.index(min(sizes))} nothing at tp={tp}; DeepSpeed does not allow it")
    shapes = {r: shape[:dim] + (n,) + shape[dim + 1:] for r, n in enumerate(sizes)}
    return contiguous(shapes, dim, tp, f"AutoTP's cut at tp={tp}")


def _same_boxes(a: Split, b: Split | None) -> bool:
    if b is None or tuple(a.full_shape) != tuple(b.full_shape):
        return False
    def key(split: Split) -> dict:
        return {r: sorted((p.full_start, p.shard_start, p.shape) for p in ps) for r, ps in split.pieces.items() if ps}
    return key(a) == key(b)


def _affine(split: Split, tp: int) -> dict:
    """The engine's ParamAffineMap.to_dict() for one parameter (replicated_map / contiguous_split_map)."""
    full = tuple(split.full_shape)
    ranks = {}
    for r in range(tp):
        pieces = split.pieces[r]
        shard = tuple(max(p.shard_start[d] + p.shape[d] for p in pieces) for d in range(len(full)))
        ranks[r] = {"shard_shape": list(shard), "pieces": [
            {"shape": list(p.shape), "source": [_offset(p.full_start, full), list(strides(full))],
             "dest": [_offset(p.shard_start, shard), list(strides(shard))], "locations": sorted(p.holders)}
            for p in pieces]}
    return {"logical_shape": list(full), "ranks": ranks}


def _offset(start, shape) -> int:
    return offset(start, strides(shape))


def _pattern(name: str) -> str:
    return rf"^{re.escape(name)}$"


def _uc_info(catalog, cuts, maps, geometry, where) -> dict:
    own = (notes.of(catalog).mp_rank_extra.get(0) or {}).get("universal_checkpoint_info")
    if isinstance(own, dict):
        if own.get("sub_param_shard_widths") or own.get("parameter_with_sub_params"):
            raise ReshardError(f"{where}: fused sub-params' widths at a new degree are not derived; not supported")
        info = copy.deepcopy(own)
        params = {}
        for pattern in ((own.get("affine_map") or {}).get("params") or {}):
            hits = [n for n in maps if re.match(pattern, n)]
            if len(hits) != 1:
                raise ReshardError(f"{where}: the source's affine map entry {pattern!r} names "
                                   f"{len(hits)} parameters; cannot restate it")
            params[pattern] = maps[hits[0]]
        info["affine_map"] = {"version": AFFINE_VERSION, "params": params}
        return info
    order = [n for n in catalog.order if n in cuts] + [n for n in cuts if n not in catalog.order]
    row = [n for n in order if cuts[n] and cuts[n][0] == 1 and len(catalog.params[n].shape) == 2]
    whole = [n for n in order if cuts[n] is None and catalog.params[n].kind != "buffer"]
    vocab = [n for n in order if cuts[n] and (geometry.rule_for(n).vocab)]
    info = {"universal_checkpoint_version": UC_VERSION,
            "parameter_with_row_parallelism_patterns": sorted({_pattern(n) for n in row}),
            "tp_replicated_parameter_patterns": sorted({_pattern(n) for n in whole}),
            "vocabulary_parameter_patterns": sorted({_pattern(n) for n in vocab}),
            "parameter_with_sub_params": [],
            "autotp_unsupported_parameter_patterns": {}}
    if vocab:
        info["original_vocab_size"] = catalog.params[vocab[0]].shape[0]
    cut_first = [n for n in order if cuts[n]] + whole
    info["affine_map"] = {"version": AFFINE_VERSION, "params": {_pattern(n): maps[n] for n in cut_first}}
    return info
