"""Catalog of a mixture-of-experts save x target Layout -> the files DeepSpeed writes at the target's ep and dp.

An expert placement is one more map composed with the ZeRO partition. At expert-parallel degree E each layer's
experts are placed contiguously (what DeepSpeed 0.19.8 builds: AutoEP's `legacy_uniform_autoep_placement_descriptor`,
deepspeed.moe's `ep_rank * local + i`): expert-parallel rank r holds experts [r * n/E, (r + 1) * n/E). An AutoEP
packed (num_experts, ...) weight is held as a box of its logical tensor (a RankParam's Shard); a deepspeed.moe
expert param whole, under its local number (a RankParam's source names the logical tensor). Then, as the engine's
optimizer does:
* the dense param group is flattened from the whole params and cut over dp (every rank's file: slice d);
* an expert param group is flattened, per expert-parallel rank, from that rank's local expert params and cut over
  the expert-data-parallel group (dp / E ranks); data-parallel rank d's file holds slice `edp(d)` of the flat
  vector of expert-parallel rank `ep(d)` (experts.expert_ranks: DeepSpeed's process groups).
The model states hold the dense module, param_shapes with rank 0's local expert params, and (AutoEP)
ds_autoep_layers and its copy in universal_checkpoint_info re-derived for E; every global expert's module weights go
to its layer_L_expert_E file, which does not depend on E (global numbers). Under ZeRO-3 (AutoEP only) every rank's
files hold its experts partition-native and no layer file is written (zero3_expert_writer).
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace

from reshard.core.catalog import MASTER, MODULE, Catalog, ExpertParallel, TensorKey
from reshard.core.layout import Layout
from reshard.core.placement import Block, Shard
from reshard.core.write_requests import Piece
from reshard.errors import ReshardError
from reshard.formats.deepspeed import (
    experts as expert_files,
    files as names,
    notes,
    rank_params,
    topology,
    zero3_expert_writer,
    zero3_experts,
    zero12_writer,
)
from reshard.formats.deepspeed.rank_params import RankParams
from reshard.formats.deepspeed.zero_target import ZeroTarget, closing_files
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder

AUTOEP_LAYERS, UC_INFO = expert_files.AUTOEP_LAYERS, expert_files.UC_INFO


class ExpertTarget(ZeroTarget):
    """ZeroTarget at expert-parallel degree `ep`: the config's autoep_size and the expert groups' names follow it."""

    def __init__(self, catalog: Catalog, target: Layout, ep: int):
        super().__init__(catalog, target)
        self.ep = ep
        self.expert_dp = target.dp // ep
        self.data_first = expert_files.data_before_experts(self.config)
        if "expert_parallel" in self.config:
            self.config["expert_parallel"]["autoep_size"] = ep

    def saved_shape(self, shape: tuple) -> object:
        """A plain tuple: _save_moe_checkpoint saves through clone_tensors_for_torch_save, which rebuilds every
        tuple, a torch.Size too, as a tuple."""
        return tuple(shape)

    def is_expert_group(self, g: int) -> bool:
        return bool(self.catalog.param_groups[g].get("moe"))

    def hyper_params(self, g: int) -> dict:
        hyper = super().hyper_params(g)
        if self.is_expert_group(g):        # AutoEP names its expert group by its ep (auto_ep_layer.ep_group_name)
            hyper["name"] = group_name(self.ep)
        return hyper


def group_name(ep: int) -> str:
    return f"{notes.EXPERT_GROUP}{ep}"


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    placed = _Placed(catalog, target)
    if placed.zt.stage == 3:       # AutoEP under ZeRO-3: the experts in the ZeRO files, no layer files
        return [f for rank in range(placed.zt.dp) for f in placed.zero3_files(rank, tag)] + \
            closing_files(tag, source_save_dir)
    return ([placed.model_states(tag)] + [placed.optim_states(rank, tag) for rank in range(placed.zt.dp)]
            + _layer_files(catalog, tag, placed.zt.lp_dtype) + closing_files(tag, source_save_dir))


def rank0_files(catalog: Catalog, target: Layout, tag: str) -> tuple:
    """(model states, data-parallel rank 0's optimizer file) of the engine at the target's ep and dp: the training
    state a universal checkpoint of experts carries beside its zero/ tree (universal_writer)."""
    placed = _Placed(catalog, target)
    if placed.zt.stage == 3:
        raise ReshardError.at(catalog.root, "a universal checkpoint of experts is written for ZeRO-1/2 only (not "
                                            "yet for a ZeRO-3 engine); use --to zero=1 or 2")
    return placed.model_states(tag), placed.optim_states(0, tag)


class _Placed:
    """What each expert-parallel rank holds at the target, and its flat param groups."""

    def __init__(self, catalog: Catalog, target: Layout):
        _check(catalog, target)
        ep = _target_ep(catalog, target)
        self.catalog, self.zt = catalog, ExpertTarget(catalog, target, ep)
        self.held = [_ep_rank_params(catalog, r, ep) for r in range(ep)]
        self.flat = [[zero12_writer.FlatGroup(self.zt, params, g,
                                              self.zt.expert_dp if self.zt.is_expert_group(g) else self.zt.dp)
                      for g in range(len(params.groups))] for params in self.held] if self.zt.stage != 3 else []

    def model_states(self, tag: str) -> TorchFile:
        return zero12_writer.model_states(self.zt, self.held[0], self.flat[0], tag, _model_keys(self.catalog, self.zt))

    def zero3_files(self, rank: int, tag: str) -> list:
        """Data-parallel rank `rank`'s model states and optimizer file under ZeRO-3."""
        zt = self.zt
        ep_rank, _ = expert_files.expert_ranks(rank, zt.ep, zt.expert_dp, zt.data_first)
        params = self.held[ep_rank]
        experts = {name for layer in _experts(self.catalog).layers for name in layer.params}
        groups = zero3_expert_writer.sub_groups(zt, params, rank, lambda name: name in experts)
        return [zero3_expert_writer.model_states(zt, params, rank, groups, tag, _model_keys(self.catalog, zt, rank)),
                zero3_expert_writer.optim_states(zt, params, rank, groups, tag)]

    def optim_states(self, rank: int, tag: str) -> TorchFile:
        zt = self.zt
        ep_rank, edp_rank = expert_files.expert_ranks(rank, zt.ep, zt.expert_dp, zt.data_first)
        places = [edp_rank if zt.is_expert_group(g) else rank for g in range(len(self.flat[ep_rank]))]
        return zero12_writer.optim_states(zt, self.held[ep_rank], rank, self.flat[ep_rank], tag, places)


def _target_ep(catalog: Catalog, target: Layout) -> int:
    ep = topology.of(target).ep
    if ep is None:
        raise ReshardError.at(catalog.root, "a mixture of experts is written at an expert-parallel degree: name one "
                                            "(--to ep=N)")
    return ep


def _experts(catalog: Catalog) -> ExpertParallel:
    if catalog.experts is None:
        raise AssertionError(f"{catalog.root}: the expert writer was given a catalog without experts")
    return catalog.experts


def _check(catalog: Catalog, target: Layout) -> None:
    """What cannot be written is refused (one line each)."""
    where = catalog.root
    if catalog.format == "megatron":    # (its experts are megatron-core's SequentialMLP, not DeepSpeed's modules)
        raise ReshardError.at(where, "a Megatron mixture of experts is not written as DeepSpeed's expert files (they "
                                     "hold deepspeed.moe or AutoEP modules); convert it to Megatron at another ep, "
                                     "or export it")
    zero = topology.of(target).zero
    if zero not in (1, 2, 3):
        raise ReshardError.at(where, f"target ZeRO stage {zero}: mixture-of-experts checkpoints are written for "
                                     "ZeRO-1, 2 and 3 only")
    if zero == 3 and not packs_experts(catalog):
        raise ReshardError.at(where, "target ZeRO stage 3: only AutoEP experts are written under ZeRO-3 (DeepSpeed "
                                     "0.19.8 saves deepspeed.moe experts partition-native for no ZeRO-3 layout)")
    if target.tp != 1 or target.pp != 1:
        raise ReshardError.at(where, "mixture-of-experts checkpoints are written without tensor or pipeline "
                                     "parallelism")
    ep = _target_ep(catalog, target)
    for layer in _experts(catalog).layers:
        if layer.num_experts % ep:
            raise ReshardError.at(where, f"ep={ep} does not divide the {layer.num_experts} experts of MoE layer "
                                         f"{layer.index}")
    if target.dp % ep:
        raise ReshardError.at(where, f"ep={ep} does not divide dp={target.dp} (expert parallelism groups "
                                     "data-parallel ranks)")


def refuse_ep_without_experts(catalog: Catalog, target: Layout) -> None:
    if catalog.experts is None and topology.of(target).ep is not None:
        raise ReshardError.at(catalog.root, f"ep={topology.of(target).ep}: the source has no experts (not a "
                                            "mixture-of-experts checkpoint)")


def packs_experts(catalog: Catalog) -> bool:
    """AutoEP (each layer's local experts packed in one tensor per weight), not deepspeed.moe (a module each)."""
    return bool(notes.of(catalog).expert_keys.get(AUTOEP_LAYERS))


def _ep_rank_params(catalog: Catalog, ep_rank: int, ep: int) -> RankParams:
    """What expert-parallel rank `ep_rank` holds: every dense param whole, and its local experts: of each AutoEP
    packed weight a box of the (num_experts, ...) logical tensor; each deepspeed.moe expert param of its experts
    whole, under its local number. The module holds no expert weights (they are in the layer files)."""
    whole = rank_params.whole(catalog)
    packed = packs_experts(catalog)
    per_rank = {name: layer.num_experts // ep for layer in _experts(catalog).layers for name in layer.params}
    params, renamed = [], {}
    for p in whole.params:
        if p.name in per_rank and packed:
            full = catalog.params[p.name].shape
            local = (per_rank[p.name],) + tuple(full[1:])
            shard = Shard(local, (Block((ep_rank * local[0],) + (0,) * (len(full) - 1), (0,) * len(full), local),))
            p = replace(p, shape=local, shard=None if shard == Shard.whole(full) else shard)
        elif p.name in per_rank:
            expert, local_name = expert_files.ds_moe_local(p.name, per_rank[p.name])
            if expert // per_rank[p.name] != ep_rank:      # another rank's expert
                continue
            renamed[p.name] = local_name
            p = replace(p, name=local_name, source=p.name)
        params.append(p)
    order = tuple(n for n in whole.order if n not in per_rank)
    held = {p.source or p.name for p in params}
    groups = tuple(tuple(renamed.get(n, n) for n in group if n in held) for group in whole.groups)
    return RankParams(tuple(params), order, whole.aliases, groups)


def _model_keys(catalog: Catalog, zt: ExpertTarget, rank: int = 0) -> dict:
    """num_experts, ds_autoep_layers and universal_checkpoint_info as the engine at the target's ep saves them (in
    the model states of data-parallel rank `rank`: ZeRO-3 writes one per rank, ZeRO-1/2 rank 0's)."""
    saved = notes.of(catalog).expert_keys
    # the engine lists AutoEP's router alias in no shared_params (a ZeRO-3 source's catalog ties it to the router)
    out: dict = {"shared_params": {alias: source for alias, source in catalog.aliases.items()
                                   if not expert_files.is_router_tie(alias, source, saved.get(AUTOEP_LAYERS))}}
    for key, value in saved.items():
        if key == AUTOEP_LAYERS and value:           # (None for deepspeed.moe)
            value = [_layer_entry(catalog, entry, zt, rank) for entry in value]
        elif key == UC_INFO and isinstance(value, dict) and AUTOEP_LAYERS in value:
            value = {**value, AUTOEP_LAYERS: [_layer_entry(catalog, entry, zt, rank)
                                              for entry in value[AUTOEP_LAYERS]]}
        out[key] = value
    return out


def _layer_entry(catalog: Catalog, entry: dict, zt: ExpertTarget, rank: int) -> dict:
    """One ds_autoep_layers entry at the target's ep as data-parallel rank `rank` sees it
    (engine._save_moe_checkpoint), its placement and affine maps lowered as checkpoint/autoep_affine.py does for the
    contiguous placement; under ZeRO-3 marked zero3_partitioned (format version 1), else per_expert_files."""
    num_experts, ep = int(entry["num_experts"]), zt.ep
    local = num_experts // ep
    ep_rank, edp_rank = expert_files.expert_ranks(rank, ep, zt.expert_dp, zt.data_first)
    ranks = [list(range(r * local, (r + 1) * local)) for r in range(ep)]
    out = copy.deepcopy(entry)         # every other key as saved, in the saved order
    params = {name: _affine_map(catalog.params[name].shape, local, ep)
              for name in (entry.get("affine_maps") or {}).get("params") or {}}
    out.update(num_local_experts=local, ep_size=ep,
               expert_placement={"version": entry["expert_placement"]["version"], "num_experts": num_experts,
                                 "ep_size": ep, "ranks": [{"rank": r, "experts": e} for r, e in enumerate(ranks)]},
               affine_maps={**entry["affine_maps"], "params": params},
               ep_group_name=group_name(ep), ep_rank=ep_rank, expert_data_parallel_rank=edp_rank,
               expert_data_parallel_world_size=zt.expert_dp, global_expert_start=ep_rank * local,
               global_expert_end=(ep_rank + 1) * local)
    if zero3_experts.FORMAT_KEY in out:
        out[zero3_experts.FORMAT_KEY] = zero3_experts.FORMAT if zt.stage == 3 else "per_expert_files"
        out[zero3_experts.FORMAT_VERSION_KEY] = zero3_experts.FORMAT_VERSION if zt.stage == 3 else None
    return out


def _affine_map(shape: tuple, local: int, ep: int) -> dict:
    """ParamAffineMap.to_dict of a (num_experts, ...) weight whose ep ranks each hold `local` consecutive experts:
    one piece per rank (one run of experts with a single holder)."""
    def row_major(dims):
        return [math.prod(dims[i + 1:]) for i in range(len(dims))]
    inner = math.prod(shape[1:])
    shard = [local] + list(shape[1:])
    return {"logical_shape": list(shape),
            "ranks": {r: {"shard_shape": list(shard),
                          "pieces": [{"shape": list(shard), "source": [r * local * inner, row_major(shape)],
                                      "dest": [0, row_major(shard)], "locations": [r]}]}
                      for r in range(ep)}}


def _layer_files(catalog: Catalog, tag: str, lp_dtype: str) -> list:
    """Every layer_L_expert_E file as the source holds it: each key expert E's elements of a logical tensor (a slab
    of an AutoEP packed weight, a deepspeed.moe expert param whole), in the source's order. A ZeRO-3 source has none
    and saved no module copy of its experts: its AutoEP layers' files are made as the engine makes them (each packed
    weight's slab of expert E, in w1, w2, w3 order), from the fp32 masters cast to the model's dtype."""
    out = []
    for ef in notes.of(catalog).expert_files or _autoep_layer_files(catalog):
        file = TorchFileBuilder(f"{tag}/{ef.name}", archive=ef.name[:-3])
        tree = {}
        for key, name, start, stop, shape in ef.keys:
            module = catalog.tensors.get(TensorKey(name, MODULE))
            state, dtype = (MODULE, module.dtype) if module is not None else (MASTER, lp_dtype)
            tree[key] = file.slot(dtype, shape, [Piece(stop - start, (name, state), start)])
        out.append(file.build(tree))
    return out


def _autoep_layer_files(catalog: Catalog) -> list:
    out = []
    for layer in _experts(catalog).layers:
        shapes = {name: catalog.params[name].shape for name in layer.params}
        for e in range(layer.num_experts):
            keys = tuple((expert_files.autoep_expert_key(name, e), name, e * math.prod(shape[1:]),
                          (e + 1) * math.prod(shape[1:]), tuple(shape[1:])) for name, shape in shapes.items())
            out.append(expert_files.ExpertFile(names.expert_states_name(layer.index, e), layer.index, e, keys))
    return out
