"""Catalog of a PipelineModule save x target Layout -> the files of every pipeline stage at the target pp and dp.

A PipelineEngine saves
* one `layer_XX-model_states.pt` per layer holding weights (the layer's state_dict; a tied module's in
  every layer using it). The file of layer XX is the same whatever the stage boundaries: written as read.
* per stage s, `mp_rank_{s:02d}_model_states.pt` ("module" None: the weights are in the layer files) and
  the ZeRO-1 optimizer files (the only stage a PipelineEngine accepts) of the stage's params, which the
  ordinary ZeRO writer produces from the stage's part of what its rank holds (RankParams.subset: the stage's
  params, the tied ones of every stage using them).

Stage boundaries follow DeepSpeed's PipelineModule._partition_layers: 'uniform' (equal layer counts),
'parameters' (balanced trainable parameter counts, a tied module counted in each layer using it) or
'type:REGEX' (balanced counts of the layers whose class name matches; the class names are not saved, so
`layer_types=Embed/Block/...` gives them). The method is not saved: `--to ...,partition=METHOD` names it,
else it is the one of 'uniform' and 'parameters' that gives the source's own stages (refused when neither
does). When both do but would cut the target differently (as from a one-stage source), it is 'parameters',
PipelineModule's default, and the plan says so in one line (StageCut.ambiguous).

Layers are counted from the layer files, with two kinds of layer the engine saves no file for: a function
(a gap between files, weightless) and a tied module used through a `forward_fn` (TiedLayerSpec(...,
forward_fn=head), as Megatron-DeepSpeed's GPT uses its embedding as the head). Such a use shows only as a
stage training the tied module without a layer file of its own holding it; the engine places it after the
last file, on the last stage, which is where it is put here (one layer per tied module the source's last stage
trains), and only when the source's stages are not given without it. A stage's optimizer trains every tied
module one of its layers uses, so a stage holding such a use gets the tied weights in its partition too.
Every trainable parameter must be trained in exactly the source's stages for a method to give them, so a
count the files cannot show (functions after the last file) is caught whenever it changes the source's
boundaries; a one-stage source shows no `forward_fn` use at all.

With tensor parallelism too (tp > 1, Megatron-style layers on DeepSpeed's PipeModelDataParallelTopology), TP
rank t's layer files are `layer_XX-model_{t:02d}-model_states.pt` and its stage s is mp rank s * tp + t; each
holds TP rank t's shards (rank_params.tp_rank), a stage the part of them it trains. The boxes
are the source's at its own degree, else Megatron's even cut of the dims the rule file names (megatron_splits).
At tp=1 the files have no `-model_TT` (a PipelineModule on its plain pipe x data topology). The 'parameters'
partition counts full tensors; DeepSpeed counts each rank's shards, which cut alike whenever every cut dim
divides evenly and only small replicated tensors (norms, biases) are left whole, as in Megatron's layers.
"""
from __future__ import annotations

import itertools
import math
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from reshard.core.catalog import MODULE, Catalog
from reshard.core.layout import Layout
from reshard.core.write_requests import StageCut
from reshard.errors import ReshardError
from reshard.formats.deepspeed import files as names, notes, rank_params, topology
from reshard.formats.deepspeed.rank_params import RankParams
from reshard.formats.deepspeed.tp_geometry import Geometry
from reshard.formats.deepspeed.zero_files import rank_files
from reshard.formats.deepspeed.zero_target import ZeroTarget, closing_files
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder

TIED = "tied_modules."


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    layer_files = notes.of(catalog).pipe_layer_files
    if not layer_files:
        raise ReshardError.at(catalog.root, "not a PipelineModule save (no layer files): a pipeline target needs "
                                            "the model's layers")
    ds = topology.of(target)
    if ds.zero != 1:     # deepspeed/runtime/pipe/engine.py asserts stage < 2
        raise ReshardError(f"target {target.topology()}: a PipelineEngine trains with ZeRO stage 1 only "
                           "(DeepSpeed: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism)")
    if any(p.kind == "frozen" for p in catalog.params.values()):
        raise ReshardError.at(catalog.root, "frozen parameters in a pipeline are not supported")
    layers = {int(i): entries for i, entries in layer_files.items()}
    cut = stage_boundaries(catalog, layers, target.pp, ds.partition_method,
                           list(ds.layer_types) if ds.layer_types is not None else None)
    zt = ZeroTarget(catalog, target)
    if target.tp == 1:     # a PipelineModule on its plain pipe x data topology: layer files without -model_TT
        held: list[tuple[int | None, RankParams]] = [(None, rank_params.whole(catalog))]
    else:                  # TP rank t's shards (the source's boxes at its own degree, else Megatron's even cut)
        splits = (notes.of(catalog).tp_splits if target.tp == catalog.layout.tp
                  else megatron_splits(catalog, target.tp))
        held = [(t, rank_params.tp_rank(catalog, t, splits)) for t in range(target.tp)]
    out = []
    for tp_rank, params in held:
        out += [_layer_file(catalog, params, index, entries, tag, tp_rank) for index, entries in sorted(layers.items())]
        out += _stage_files(zt, params, target, cut, tag, tp_rank or 0)
    return out + closing_files(tag, source_save_dir) + [cut.record()]


def megatron_splits(catalog: Catalog, tp: int) -> dict:
    """The boxes of every parameter at a new tensor-parallel degree, cut as Megatron's layers cut: each rank
    an equal 1/tp of the dim its rule names (vocabulary rows, fused QKV, each SwiGLU half), the rest whole.
    Megatron asserts those dims divide by tp, and so does this."""
    rules_path = notes.of(catalog).tp_rules
    if not rules_path:
        raise ReshardError.at(catalog.root, f"tp={catalog.layout.tp} -> tp={tp}: how the pipeline's layers are "
                                            "cut is not in the checkpoint; give it with --layout-rules (e.g. "
                                            "--layout-rules megatron-gpt)")
    geometry = Geometry.from_rule_file(rules_path)
    splits = {}
    for name, info in catalog.params.items():
        if name in catalog.aliases:
            continue
        rule = geometry.rule_for(name)
        shape = list(info.shape)
        if rule is not None and rule.kind in ("split", "sub_params"):
            dim = rule.dim if rule.dim >= 0 else len(shape) + rule.dim
            parts = tp * (rule.sub_params[0] if rule.count_only else len(rule.sub_params) or 1)
            if shape[dim] % parts:
                raise ReshardError.at(catalog.root, f"{name}: dim {dim} of {info.shape} does not divide into "
                                                    f"{parts} equal parts, as Megatron's tensor parallelism at "
                                                    f"tp={tp} needs")
            shape[dim] //= tp
        elif rule is not None and rule.kind == "refuse":
            raise ReshardError.at(rules_path, f"{name}: {rule.reason}")
        splits[name] = geometry.split(name, {r: tuple(shape) for r in range(tp)}, tp)
    return splits


def _stage_files(zt: ZeroTarget, params: RankParams, target: Layout, cut, tag: str, tp_rank: int) -> list:
    """The ZeRO files of each stage of TP rank tp_rank: its mp rank is stage * tp + tp_rank (DeepSpeed's
    PipelineParallelGrid orders the model-parallel group pipe-major), its module in the layer files."""
    out = []
    for stage in range(target.pp):
        held = _stage_params(params, cut.uses, range(cut.parts[stage], cut.parts[stage + 1]))
        out += rank_files(zt, params.subset(held, stage * target.tp + tp_rank, weights_in_layer_files=True), tag,
                          {"shared_params": {}})
    return out


# ------------------------------------------------------------------------------------------ boundaries

def partition_uniform(num_items: int, num_parts: int) -> list:
    """deepspeed.runtime.utils.partition_uniform: equal chunks, the first `residual` one longer."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def partition_balanced(weights: list, num_parts: int) -> list:
    """deepspeed.runtime.utils.partition_balanced: the linear partition minimising max - min part weight,
    ties resolved as its dynamic programme resolves them (the last k with the lowest cost)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k, j - 1], part), min(dp_min[k, j - 1], part)
                if dp_cost[i, j] >= hi - lo:
                    dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = hi - lo, hi, lo, k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], i]))
    return parts[::-1]


def partition_by_type(layer_types: list, method: str, num_parts: int) -> list:
    """PipelineModule._partition_layers' 'type:REGEX': the layers whose class name the regex finds (case
    insensitive, as _find_layer_type) weigh 1, the others 0, balanced like 'parameters'."""
    pattern = re.compile(method.split(":")[1], re.IGNORECASE)
    weights = [1 if pattern.search(name) else 0 for name in layer_types]
    if not any(weights):
        raise ReshardError(f"partition {method!r} finds no layer among layer_types {'/'.join(layer_types)}")
    return partition_balanced(weights, num_parts)


@dataclass(frozen=True)
class Cut:
    """A pipeline target's stages: the partition `method`, its boundaries `parts` (stage s holds layers
    parts[s] to parts[s + 1] - 1), `uses`, per layer of the model, the params it uses (a tied module's in
    every layer using it, the ones of a `forward_fn` use included), and `ambiguous` (StageCut's)."""
    method: str
    parts: tuple
    uses: tuple
    ambiguous: str | None = None

    def record(self) -> StageCut:
        return StageCut(self.method, tuple(itertools.pairwise(self.parts)), self.ambiguous)


def stage_boundaries(catalog: Catalog, layers: dict, pp: int, named: str | None = None,
                     layer_types: list | None = None) -> Cut:
    source_pp = catalog.layout.pp
    fits = []
    for uses in _layer_uses(catalog, layers):    # the model's layers, fewest first: the first the source confirms
        methods = _methods(catalog, uses, named, layer_types)
        fits = [m for m, cut in methods.items() if _gives_source_stages(catalog, uses, cut(source_pp))]
        if fits:
            break
    else:
        uses = next(_layer_uses(catalog, layers))
        methods = _methods(catalog, uses, named, layer_types)
    count = len(uses)
    if named and named.startswith("type:"):
        assert layer_types      # (_methods refuses a type: partition without them)
        if pp > len(layer_types):
            raise ReshardError.at(catalog.root, f"pp={pp} but the model has {len(layer_types)} layers")
        return Cut(named, tuple(methods[named](pp)), uses)
    if pp > count:
        raise ReshardError.at(catalog.root, f"pp={pp} but the model has {count} layers")
    if named:
        return Cut(named, tuple(methods[named](pp)), uses)
    if not fits:
        raise ReshardError.at(catalog.root, "the source's pipeline stages are neither DeepSpeed's 'uniform' nor "
                                            f"'parameters' partition of its {count} layers; other partition "
                                            "methods are not supported")
    cuts = {m: tuple(methods[m](pp)) for m in fits}
    method = "parameters" if "parameters" in fits else fits[0]    # PipelineModule's default first
    ambiguous = None
    if len(set(cuts.values())) > 1:
        ambiguous = (f"the source's stages fit both DeepSpeed's 'uniform' and 'parameters' partitions, which cut "
                     f"pp={pp} differently: cut by 'parameters' (PipelineModule's default); give "
                     "--to ...,partition=uniform for a model built with partition_method='uniform'")
    return Cut(method, cuts[method], uses, ambiguous)


def _layer_uses(catalog: Catalog, layers: dict):
    """The params each layer of the model uses, as the layer files show them (a gap: a function layer); then,
    when the source's last stage trains tied modules, with one `forward_fn` use of each after the last file."""
    files = tuple(tuple(n for _, n in layers.get(i, []) if n) for i in range(max(layers) + 1))
    yield files
    last = catalog.layout.pp - 1
    keys = sorted({n.split(".")[1] for n, stages in notes.of(catalog).stages.items()
                   if n.startswith(TIED) and last in stages})
    if last > 0 and keys:
        yield files + tuple(tuple(n for n in catalog.order if n.startswith(f"{TIED}{key}.")) for key in keys)


def _methods(catalog: Catalog, uses: tuple, named: str | None, layer_types: list | None) -> dict:
    """partition method -> (pp -> boundaries) over the layers `uses` lists."""
    count = len(uses)
    weights = [sum(math.prod(catalog.params[n].shape) for n in names if catalog.params[n].kind == "trainable")
               for names in uses]
    methods = {"uniform": lambda parts: partition_uniform(count, parts),
               "parameters": lambda parts: partition_balanced(weights, parts)}
    if named and named.startswith("type:"):
        # a checkpoint holds no class names: the layers' types are given, one per layer spec of the model
        if not layer_types:
            raise ReshardError(f"partition={named} needs the class names of the model's layers: add "
                               "layer_types=NAME/NAME/... (one per layer, in order)")
        if len(layer_types) < count:
            raise ReshardError.at(catalog.root, f"layer_types names {len(layer_types)} layers but the checkpoint "
                                                f"has {count}")
        methods[named] = lambda parts: partition_by_type(layer_types, named, parts)
    return methods


def _gives_source_stages(catalog, uses, parts) -> bool:
    """Whether cutting the layers at `parts` trains every trainable parameter in exactly the source's stages
    (a tied module's in every stage with a layer using it)."""
    if len(parts) != catalog.layout.pp + 1:
        return False
    trained: dict[str, set[int]] = {}
    for stage in range(len(parts) - 1):
        for index in range(parts[stage], min(parts[stage + 1], len(uses))):
            for name in uses[index]:
                trained.setdefault(name, set()).add(stage)
    source_stages = notes.of(catalog).stages
    return all(sorted(trained.get(name, ())) == sorted(source_stages.get(name, ()))
               for name, info in catalog.params.items() if info.kind == "trainable")


# ------------------------------------------------------------------------------------------ files

def _stage_params(params: RankParams, uses: tuple, indices) -> list:
    """The params of one stage as its PipelineModule orders them (tied modules first)."""
    held = [n for i in indices if i < len(uses) for n in uses[i]]
    tied = [n for n in params.order if n.startswith(TIED) and n in held]
    own = [n for n in dict.fromkeys(held) if not n.startswith(TIED)]
    return tied + own


def _layer_file(catalog: Catalog, params: RankParams, index: int, entries: list, tag: str,
                tp_rank: int | None = None) -> TorchFile:
    name = names.layer_states_name(index, tp_rank)
    file = TorchFileBuilder(f"{tag}/{name}", archive=name[:-3])
    tree = OrderedDict()
    for key, full_name in entries:
        if full_name is None:
            raise ReshardError.at(catalog.root, f"{name}: {key} is not a tensor; layer files holding other objects "
                                                "are not supported")
        param = params.by_name[full_name]
        tree[key] = file.slot(param.module_dtype, param.shape, [param.piece(MODULE, 0, param.numel)])
    return file.build(tree)
