"""Expert parallelism in a DeepSpeed ZeRO-1/2 save: which experts each rank holds, and where they sit.

Two engines write these saves (DeepSpeed 0.19.8, `DeepSpeedEngine._save_moe_checkpoint`):
* AutoEP packs a MoE layer's local experts as `experts.w1/w2/w3` of shape (local experts, ...). The model states'
  `ds_autoep_layers` give, per layer, the placement (expert-parallel rank -> global experts) and an affine map per
  packed param: the box of the (num_experts, ...) logical tensor each expert-parallel rank's packed tensor is.
  That logical tensor, every expert in it, is what the catalog holds.
* deepspeed.moe keeps one module per local expert; local expert i of expert-parallel rank r is global expert
  r * local + i, and each expert's params are logical tensors of their own, named with that global number (as
  the engine renames them in its layer files).
Either way the expert params form optimizer param groups of their own (saved with `moe: True`), ZeRO-partitioned
over the expert-data-parallel group (the ranks holding the same experts); the optimizer file of data-parallel rank
d holds, for those groups, its expert-parallel rank's experts. The 16-bit (or fp32) module weights of global
expert E of MoE layer L are in `layer_L_expert_E_mp_rank_00_model_states.pt`, which the engine numbers
ep rank * local + i (for AutoEP too, whatever its placement says: non-contiguous placements are refused).
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.catalog import MODULE, ExpertLayer, ExpertParallel, FileInfo, Fragment, TensorDraft
from reshard.core.placement import Shard
from reshard.errors import CheckpointError, ReshardError, UnsafeCheckpointError
from reshard.formats.deepspeed import files as names
from reshard.formats.deepspeed.tp_geometry import from_affine
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import file_size
from reshard.storage import files as fs

# Model-states keys of an AutoEP save: its layers' placement and affine maps, and the universal-checkpoint info
# that carries a copy of them
AUTOEP_LAYERS = "ds_autoep_layers"
UC_INFO = "universal_checkpoint_info"
# How deepspeed.moe names a local expert's params (engine._save_moe_checkpoint renames it to the global number)
DS_MOE_EXPERT = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class LocalExpert:
    """What an expert param of one expert-parallel rank's optimizer is: a box of which logical tensor."""
    name: str                 # the logical tensor
    shard: Shard | None       # the box(es) of it the rank's local tensor holds (None: all of it)


@dataclass(frozen=True)
class ExpertFile:
    """One `layer_L_expert_E` file: each of its keys is the slab of expert E in a logical tensor."""
    name: str                 # file name in the tag folder
    layer: int
    expert: int
    keys: tuple               # (key in the file, logical tensor, flat [start, stop) of the expert's elements in it,
                              #  the tensor's shape in the file)


@dataclass(frozen=True)
class Experts:
    topology: ExpertParallel
    groups: frozenset         # the optimizer param groups of expert params
    data_first: bool          # ds_config's use_data_before_expert_parallelism: how ranks form the groups
    local: Mapping[tuple[int, str], LocalExpert]    # (ep rank, name in param_shapes) -> LocalExpert
    shapes: Mapping[str, tuple[int, ...]]          # logical expert tensor -> its full shape, in model order
    files: tuple              # ExpertFile

    def ranks(self, rank: int) -> tuple:
        return expert_ranks(rank, self.topology.ep, self.topology.expert_dp, self.data_first)

    def logical(self, ep_rank: int, name: str) -> LocalExpert:
        return self.local[(ep_rank, name)]

    def group_params(self, shapes: dict) -> dict:
        """The logical tensors (name -> full shape) of an expert group whose param_shapes are `shapes`."""
        out = {}
        for ep_rank in range(self.topology.ep):
            for name in shapes:
                logical = self.local[(ep_rank, name)].name
                out[logical] = self.shapes[logical]
        return out


def expert_ranks(rank: int, ep: int, expert_dp: int, data_first: bool) -> tuple:
    """(expert-parallel rank, expert-data-parallel rank) of data-parallel rank `rank`: DeepSpeed's
    groups._create_expert_and_data_parallel (consecutive ranks form an expert-parallel group, unless data
    before expert parallelism makes the expert-data-parallel groups consecutive)."""
    return (rank // expert_dp, rank % expert_dp) if data_first else (rank % ep, rank // ep)


def data_before_experts(config: Mapping[str, Any] | None) -> bool:
    """ds_config's use_data_before_expert_parallelism: how the ranks form the expert groups."""
    return bool((config or {}).get("use_data_before_expert_parallelism"))


def read(tag_dir: str, listing: list, model0: dict, optim0: dict) -> Experts | None:
    """The expert placement of a save (None when it has no experts)."""
    base = optim0.get("base_optimizer_state")
    # an elastic save keeps a list of per-group states and no param groups
    groups = [g for g in (base.get("param_groups", []) if isinstance(base, dict) else []) if isinstance(g, dict)]
    return from_groups(tag_dir, listing, model0, groups, optim0.get("partition_count") or [])


def from_groups(tag_dir: str, listing: list, model0: dict, groups: list, partition_count: list) -> Experts | None:
    """The expert placement, from the model states and the optimizer's param groups (hyper-parameters; `moe: True`
    marks an expert group) and their partition counts (only deepspeed.moe, which records no placement, needs them)."""
    expert_groups = frozenset(i for i, g in enumerate(groups) if isinstance(g, dict) and g.get("moe"))
    has_files = any(names.EXPERT_MODEL_STATES.match(n) for n in listing)
    if not expert_groups and not has_files and not model0.get(AUTOEP_LAYERS):
        return None
    if not expert_groups:
        raise ReshardError.at(tag_dir, "expert files but no optimizer param group of experts (moe: True)")
    param_shapes = model0.get("param_shapes") or []
    dp = int(model0.get("dp_world_size") or 1)
    if model0.get(AUTOEP_LAYERS):
        layers, local, shapes, files = _autoep(tag_dir, model0[AUTOEP_LAYERS], param_shapes, expert_groups)
    else:
        layers, local, shapes, files = _ds_moe(tag_dir, param_shapes, expert_groups, _ep_of(tag_dir, partition_count,
                                                                                             expert_groups, dp))
    return _experts(tag_dir, model0, expert_groups, layers, local, shapes, files)


def from_autoep(tag_dir: str, model0: dict, param_shapes: list, groups: frozenset, layer_files: bool) -> Experts:
    """An AutoEP placement whose expert params are those of `groups` (param_shapes entries); `layer_files`: whether
    the save has layer_L_expert_E files (ZeRO-1/2) or none (ZeRO-3 keeps the experts in its own files)."""
    layers, local, shapes, files = _autoep(tag_dir, model0[AUTOEP_LAYERS], param_shapes, groups)
    return _experts(tag_dir, model0, groups, layers, local, shapes, files if layer_files else [])


def _experts(tag_dir, model0, expert_groups, layers, local, shapes, files) -> Experts:
    dp = int(model0.get("dp_world_size") or 1)
    ep = len(layers[0].placement)
    if dp % ep:
        raise ReshardError.at(tag_dir, f"expert-parallel degree {ep} does not divide the data-parallel degree {dp}")
    return Experts(ExpertParallel(ep, dp // ep, tuple(layers)), expert_groups,
                   data_before_experts(model0.get("ds_config")), local, shapes, tuple(files))


def _ep_of(tag_dir, counts, expert_groups, dp) -> int:
    """deepspeed.moe records no placement: its expert-parallel degree is dp over the expert groups' partition count
    (the expert-data-parallel degree)."""
    edp = {int(counts[g]) for g in expert_groups if g < len(counts)}
    if len(edp) != 1 or dp % min(edp):
        raise ReshardError.at(tag_dir, f"the expert param groups' partition counts {sorted(edp)} do not give one "
                                       f"expert-data-parallel degree dividing dp={dp}")
    return dp // edp.pop()


def _autoep(tag_dir, autoep_layers, param_shapes, expert_groups):
    local_shapes = {n: tuple(s) for g in expert_groups for n, s in param_shapes[g].items()}
    layers, local, shapes, files = [], {}, {}, []
    for entry in autoep_layers:
        layer, num_experts = int(entry["moe_layer_id"]), int(entry["num_experts"])
        ranks = sorted(entry["expert_placement"]["ranks"], key=lambda r: int(r["rank"]))
        placement = tuple(tuple(int(e) for e in r["experts"]) for r in ranks)
        per_rank = num_experts // len(placement)
        if placement != tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(len(placement))):
            raise ReshardError.at(tag_dir, f"MoE layer {layer}: expert placement {[list(p) for p in placement]} is "
                                           "not contiguous; the engine's layer files would not match it "
                                           "(not supported)")
        params = (entry["affine_maps"] or {}).get("params") or {}
        source = f"ds_autoep_layers of {tag_dir}"
        for name, affine in params.items():
            if name not in local_shapes:
                raise ReshardError.at(tag_dir, f"MoE layer {layer}: {name} is in no expert param group")
            split = from_affine(name, affine, {r: local_shapes[name] for r in range(len(placement))}, source)
            shapes[name] = split.full_shape
            for r in range(len(placement)):
                local[(r, name)] = LocalExpert(name, split.shard(r, local_shapes[name]))
        layers.append(ExpertLayer(layer, num_experts, placement, tuple(params)))
        for e in range(num_experts):
            slab = {name: math.prod(shapes[name][1:]) for name in params}
            keys = tuple((autoep_expert_key(name, e), name, e * slab[name], (e + 1) * slab[name], shapes[name][1:])
                         for name in params)
            files.append(ExpertFile(names.expert_states_name(layer, e), layer, e, keys))
    return layers, local, shapes, files


# The child an AutoEP layer (AutoEPMoELayer) keeps its router under (auto_ep_layer.py: self.router = ...)
AUTOEP_ROUTER = "router"


def router_aliases(model0: dict) -> tuple:
    """Module keys that are an AutoEP layer's router under a second name: module tensors of no parameter of their
    own. AutoEPMoELayer registers the same router module again under the name the model's output hooks capture
    (auto_ep_layer.py: `setattr(self, alias_target, self.router)`), so the module state_dict lists its tensors
    twice (as separate copies: clone_tensors_for_torch_save), while module.parameters(), named_children() and
    named_buffers() yield them once, under `router`: engine._get_zero_frozen_param_attributes (frozen_param_shapes,
    frozen_param_fragments: every module.parameters() entry the optimizer does not own), _get_shared_params and
    _get_buffer_names never name them. A ZeRO-1 save lists no frozen params (save_frozen_param needs ZeRO-2), so
    this is how its alias is told from a frozen param: a child of the layer holding exactly the router's tensor
    names, dtypes and shapes."""
    module = model0.get("module") or {}
    out = []
    for entry in model0.get(AUTOEP_LAYERS) or ():
        prefix = f"{entry['module_path']}." if entry.get("module_path") else ""
        router = _child_tensors(module, prefix, AUTOEP_ROUTER)
        children = dict.fromkeys(key[len(prefix):].split(".", 1)[0] for key in module if key.startswith(prefix))
        for child in children:
            if child != AUTOEP_ROUTER and router and _child_tensors(module, prefix, child) == router:
                out += [f"{prefix}{child}.{rest}" for rest in router]
    return tuple(out)


def router_ties(model0: dict) -> dict:
    """{router alias key: the router's own key} (router_aliases): under ZeRO-3 the module holds empty placeholders,
    the alias's as the router's, and the alias is a second name of the router param (a tie), as a PipelineModule's
    or a tied embedding's shared_params are, though the engine lists it in no shared_params."""
    out = {}
    for alias in router_aliases(model0):
        for entry in model0.get(AUTOEP_LAYERS) or ():
            prefix = f"{entry['module_path']}." if entry.get("module_path") else ""
            if alias.startswith(prefix):
                rest = alias[len(prefix):].split(".", 1)[1]
                out[alias] = f"{prefix}{AUTOEP_ROUTER}.{rest}"
                break
    return out


def is_router_tie(alias: str, source: str, autoep_layers) -> bool:
    """Whether tie alias -> source is an AutoEP layer's router under its second name (which the engine saves as a
    copy of its own, in no shared_params)."""
    for entry in autoep_layers or ():
        head = f"{entry['module_path']}.{AUTOEP_ROUTER}." if entry.get("module_path") else f"{AUTOEP_ROUTER}."
        if source.startswith(head):
            prefix, rest = head[:-len(AUTOEP_ROUTER) - 1], source[len(head):]
            child = alias[len(prefix):-len(rest) - 1] if alias.startswith(prefix) and alias.endswith(f".{rest}") \
                else ""
            if child and "." not in child and child != AUTOEP_ROUTER:
                return True
    return False


def _child_tensors(module: dict, prefix: str, child: str) -> dict:
    """What follows `prefix + child + "."` in each module key under it -> (dtype, shape) of its tensor."""
    head = f"{prefix}{child}."
    return {key[len(head):]: (ref.dtype, tuple(ref.shape)) if isinstance(ref, TensorRef) else None
            for key, ref in module.items() if key.startswith(head)}


def autoep_expert_key(packed: str, expert: int) -> str:
    """The key of global expert `expert`'s slab of AutoEP packed weight `packed` in its layer file."""
    return f"{packed}.{expert}"


def ds_moe_local(name: str, per_rank: int) -> tuple:
    """(global expert, name on its expert-parallel rank) of deepspeed.moe expert param `name` (named by its global
    number, as the layer files and the catalog name it) when each rank holds `per_rank` experts: local index
    expert % per_rank, as the engine numbers them (its layer files: global = ep rank * local + index)."""
    m = DS_MOE_EXPERT.match(name)
    assert m is not None, name      # (called for deepspeed.moe expert params only)
    expert = int(m.group(2))
    return expert, f"{m.group(1)}{expert % per_rank}{m.group(3)}"


def _ds_moe(tag_dir, param_shapes, expert_groups, ep):
    """deepspeed.moe: rank 0's local expert params, named `<layer>.deepspeed_moe.experts.deepspeed_experts.i.*`."""
    # layer prefix -> {local index: [(name, what follows the index, shape)]}
    by_layer: dict[str, dict[int, list[tuple[str, str, tuple[int, ...]]]]] = {}
    for g in sorted(expert_groups):
        for name, shape in param_shapes[g].items():
            m = DS_MOE_EXPERT.match(name)
            if not m:
                raise ReshardError.at(tag_dir, f"{name}: an expert param not named as deepspeed.moe names them")
            by_layer.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append((name, m.group(3), tuple(shape)))
    layers, local, shapes, files = [], {}, {}, []
    for layer, (prefix, experts) in enumerate(by_layer.items()):
        per_rank = len(experts)
        if sorted(experts) != list(range(per_rank)):
            raise ReshardError.at(tag_dir, f"{prefix}: local experts {sorted(experts)} are not numbered from 0")
        num_experts = ep * per_rank
        keys_of: dict[int, list[tuple[str, str, int, int, tuple[int, ...]]]]
        keys_of = {e: [] for e in range(num_experts)}
        for r in range(ep):
            for i, params in sorted(experts.items()):
                e = r * per_rank + i
                for name, rest, shape in params:
                    glob = f"{prefix}{e}{rest}"
                    local[(r, name)] = LocalExpert(glob, None)
                    shapes[glob] = shape
                    keys_of[e].append((glob, glob, 0, math.prod(shape), shape))
        placement = tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep))
        layers.append(ExpertLayer(layer, num_experts, placement, tuple(k for e in range(num_experts)
                                                                        for k, *_ in keys_of[e])))
        files += [ExpertFile(names.expert_states_name(layer, e), layer, e, tuple(keys_of[e]))
                  for e in range(num_experts)]
    return layers, local, shapes, files


def read_module(catalog, tag_dir: str, experts: Experts, load) -> None:
    """The experts' module weights from their layer files; a file missing or short of a key is a problem."""
    for ef in experts.files:
        path = os.path.join(tag_dir, ef.name)
        catalog.files.append(FileInfo(ef.name, "expert_states", None, file_size(path)))
        if not fs.exists(path):
            catalog.problem(path, f"missing (expected for expert {ef.expert} of MoE layer {ef.layer})")
            continue
        try:
            sd = load(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:      # unreadable: a problem of this file, the others are still read
            catalog.failed(e)
            continue
        for key, name, start, stop, _ in ef.keys:
            ref = sd.get(key)
            if not isinstance(ref, TensorRef):
                catalog.problem(path, f"no tensor {key!r} (expert {ef.expert} of MoE layer {ef.layer})")
                continue
            if ref.numel != stop - start or not ref.is_contiguous():
                catalog.problem(path, f"{key}: {ref.dtype}{list(ref.shape)}, expected {stop - start} contiguous "
                                      "elements")
                continue
            tensor = catalog.add(TensorDraft(name, MODULE, experts.shapes[name], ref.dtype), path)
            tensor.fragments.append(Fragment(start, stop, ref.storage, ref.storage_offset))
    catalog.order.extend(name for name in experts.shapes if name not in catalog.order)
    catalog.experts = experts.topology
