"""Catalog x target Layout -> the files DeepSpeed itself writes for that dp and ZeRO stage.

The partition arithmetic mirrors DeepSpeed 0.19 (see zero12.py and zero3.py for the reading side):
ZeRO-1/2 flatten each param group (round-robin order if configured, optional per-param
alignment), pad the end to 2*dp and cut it into dp equal partitions; ZeRO-3 cuts every param into
ceil(n/dp) parts and groups a rank's parts into sub-groups of `sub_group_size` elements.
Everything here is arithmetic on names and counts; the bytes are described as Pieces.
"""
from __future__ import annotations

import copy
import math
import os
from collections import OrderedDict

from reshard.catalog import MASTER, MODULE, Catalog, ScalarTensor
from reshard.dtypes import itemsize
from reshard.errors import ReshardError
from reshard.formats import standins
from reshard.formats.deepspeed import files as names
from reshard.formats.deepspeed import notes
from reshard.formats.torchzip import Size
from reshard.geometry import ceil_div, intersect
from reshard.layout import Layout
from reshard.formats.torchsave import TorchFile
from reshard.targets import CopiedFile, Output, Piece, TextFile

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
WRITES_DS_VERSION = "0.19.8"    # the DeepSpeed whose files this writer reproduces
TARGET = "a DeepSpeed checkpoint"   # which keeps one step per param group (base_optimizer_state)


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    _check_convertible(catalog, target)
    source = catalog.layout
    if target.zero not in (1, 2, 3):
        # a source with no ZeRO stage of its own (DCP, torch.save, universal) keeps "0" unless --to names one
        hint = " (the source has none: name one, e.g. --to zero=2)" if source.zero not in (1, 2, 3) else ""
        raise ReshardError(f"target ZeRO stage {target.zero}: only stages 1, 2 and 3 can be written{hint}")
    if target.tp != 1 or target.pp != 1 or source.tp != 1 or source.pp != 1 or notes.of(catalog).pipe_layer_files:
        from reshard.formats.deepspeed import tp_writer    # tensor/pipeline parallel on either side
        return tp_writer.target_files(catalog, target, tag, source_save_dir)
    return rank_files(_Context(catalog, target), tag) + closing_files(tag, source_save_dir)


def _check_convertible(catalog: Catalog, target: Layout) -> None:
    """What a source must hold for DeepSpeed to resume from it, whatever the topology."""
    if not catalog.param_groups:
        raise ReshardError.at(catalog.root, "no optimizer state (weights only); a DeepSpeed checkpoint resumes "
                                            "training and needs the optimizer's state, so it is not written")
    catalog.scalars_of_groups(TARGET)      # refuses params of a group whose steps differ
    unsure = catalog.maybe_buffers
    if target.zero == 3 and unsure:
        raise ReshardError.at(catalog.root, f"{unsure[0]} (and {len(unsure) - 1} more) is a frozen parameter or a "
                                            "floating-point buffer, the source does not say which, and ZeRO-3 "
                                            "stores the two differently; convert to zero=1 or zero=2")


def rank_files(ctx: "_Context", tag: str) -> list:
    """The model-states and optimizer files of one model-parallel rank (ctx.mp_rank) at the target dp."""
    catalog, target, out = ctx.catalog, ctx.target, []
    if target.zero == 3:
        sub_groups = _zero3_sub_groups(ctx)
        for rank in range(target.dp):
            out.append(_zero3_model_states(ctx, rank, sub_groups, tag))
            out.append(_zero3_optim_states(ctx, rank, sub_groups, tag))
    else:
        groups = [_FlatGroup(ctx, g) for g in range(len(catalog.param_groups))]
        out.append(_zero12_model_states(ctx, groups, tag))
        for rank in range(target.dp):
            out.append(_zero12_optim_states(ctx, rank, groups, tag))
    return out


def closing_files(tag: str, source_save_dir: str | None) -> list:
    """`latest` and the source's consolidation scripts."""
    out = [TextFile(names.LATEST, tag + "\n")]
    if source_save_dir:
        for script in SCRIPTS:
            path = os.path.join(source_save_dir, script)
            if os.path.isfile(path):
                out.append(CopiedFile(script, path, os.path.getsize(path)))
    return out


def describe(target: Layout, tag: str) -> Output:
    """DeepSpeed files are those of one topology and ZeRO stage, in a tag folder."""
    return Output("deepspeed", target.topology(), tag)


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    """What happens to DeepSpeed's train_batch_size when dp changes, and which setting keeps it."""
    config = notes.of(catalog).ds_config or {}
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
    return advice


class _Context:
    """What every file of the target needs: source catalog, target layout, precision choices."""

    def __init__(self, catalog: Catalog, target: Layout, mp_rank: int = 0, model_extra: dict | None = None):
        self.catalog = catalog
        self.mp_rank = mp_rank
        # keys the engine adds to this mp rank's model states after the training state
        # (universal_checkpoint_info of an AutoTP model), and shared_params when not the catalog's
        self.model_extra = dict(model_extra or {})
        self.module_in_layer_files = False     # pipeline stages: "module" is None
        self.target = target
        self.dp = target.dp
        self.lp_dtype = target.dtype
        source_config = notes.of(catalog).ds_config or {}
        self.config = copy.deepcopy(source_config)
        if self.config:
            self.config.setdefault("zero_optimization", {})["stage"] = target.zero
            if "tensor_parallel" in self.config:     # AutoTP (a Megatron-style model cuts itself: no key)
                self.config["tensor_parallel"]["autotp_size"] = target.tp
        zero_cfg = self.config.get("zero_optimization") or {}
        options = target.options
        self.bf16_prefix = self.lp_dtype == "bfloat16"
        grad_accum = ((self.config.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
        self.bf16_optimizer = (target.zero == 1 and self.lp_dtype == "bfloat16"
                               and (grad_accum in ("fp32", "float32", "float") or
                                    (options.get("bf16_optimizer") and not grad_accum)))
        self.elastic = bool(options.get("elastic")) and target.zero in (1, 2) and not self.bf16_optimizer
        self.round_robin = bool(zero_cfg.get("round_robin_gradients", options.get("round_robin_gradients")))
        self.param_alignment = bool(zero_cfg.get("parameter_alignment", options.get("parameter_alignment")))
        self.sub_group_size = int(zero_cfg.get("sub_group_size", options.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))
        self.states = catalog.optimizer_states()
        # A source not saved by DeepSpeed names no version; DeepSpeed asserts one and refuses ZeRO-1
        # files older than 0.3.17, so say the version whose layout this writer follows.
        self.ds_version = notes.of(catalog).ds_version or WRITES_DS_VERSION
        self._scalars = None

    def numel(self, name: str) -> int:
        return math.prod(self.catalog.params[name].shape)

    def shape(self, name: str) -> Size:
        return Size(self.catalog.params[name].shape)

    def weight_source(self, name: str) -> tuple:
        """The 16-bit module copy: saved one if any, else the master copy (cast on the way)."""
        return (name, MODULE) if (name, MODULE) in self.catalog.tensors else (name, MASTER)

    def trainable(self):
        return [p for p in self.catalog.params.values() if p.kind == "trainable"]

    def frozen(self):
        return [p for p in self.catalog.params.values() if p.kind == "frozen"]

    def scalars(self, g: int) -> dict:
        """Group g's optimizer scalars, one value each (the target was refused when a group's params differ)."""
        if self._scalars is None:
            self._scalars = self.catalog.scalars_of_groups(TARGET)
        return self._scalars[g] if g < len(self._scalars) else {}

    def hyper_params(self, g: int) -> dict:
        return {k: v for k, v in self.catalog.param_groups[g].items() if k != "params"}

    def loss_scaler_state(self) -> dict:
        """The ZeRO optimizer's global scalars, carried over (fresh defaults after a BF16_Optimizer)."""
        state = notes.of(self.catalog)
        scaler = state.loss_scaler
        if scaler is None:
            scaler = standins.LossScaler()
            scaler.__dict__.update(cur_scale=1.0, dynamic=False)
        return {"loss_scaler": scaler, "dynamic_loss_scale": state.dynamic_loss_scale,
                "overflow": state.overflow, "clip_grad": state.clip_grad}

    def model_states_tail(self) -> dict:
        """Training state of a model-states file, after the parameter bookkeeping keys."""
        state, training = notes.of(self.catalog), self.catalog.training
        tail = {"lr_scheduler": training.lr_scheduler, "data_sampler": state.data_sampler,
                "random_ltd": state.random_ltd}
        tail.update(skipped_steps=training.skipped_steps or 0, global_steps=training.global_steps or 0,
                    global_samples=training.global_samples, dp_world_size=self.dp,
                    mp_world_size=self.target.tp * self.target.pp,
                    checkpoint_parallel_dimensions={"pp_degree": self.target.pp, "tp_degree": self.target.tp},
                    ds_config=self.config, ds_version=self.ds_version)
        if training.global_samples is None:
            # unknown (a source that does not count samples): without the key the engine takes
            # global_steps x train_batch_size (engine.py _load_checkpoint), and inspect says unknown, not 0
            del tail["global_samples"]
        tail.update({k: v for k, v in self.model_extra.items() if k != "shared_params"})
        tail.update(state.client_state)
        return tail


def _scalar_slot(file: TorchFile, value) -> object:
    if isinstance(value, ScalarTensor):
        return file.slot(value.dtype, (), [Piece(1, value=value.value)])
    return value


def _state_dict_entry(ctx, file, g, lengths_by_state) -> dict:
    """One optimizer state entry: scalars (step) first, then per-element states as slots."""
    entry = {key: _scalar_slot(file, value) for key, value in ctx.scalars(g).items()}
    for state, (length, pieces) in lengths_by_state.items():
        entry[state] = file.slot("float32", (length,), pieces)
    return entry


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2


class _FlatGroup:
    """One param group flattened as DeepSpeed does for the target dp."""

    def __init__(self, ctx: _Context, g: int):
        self.g = g
        self.original = list(ctx.catalog.param_groups[g]["params"])
        self.flat = _round_robin(self.original, ctx.dp) if ctx.round_robin else list(self.original)
        align = 16 // math.gcd(16, itemsize(ctx.lp_dtype)) if ctx.param_alignment else 1
        self.offsets, self.paddings, offset = {}, [], 0
        for i, name in enumerate(self.flat):
            self.offsets[name] = offset
            offset += ctx.numel(name)
            pad = 0 if i == len(self.flat) - 1 else (-offset) % align
            self.paddings.append(pad)
            offset += pad
        self.end = offset
        self.padded = ceil_div(offset, 2 * ctx.dp) * 2 * ctx.dp
        self.part = self.padded // ctx.dp
        self.ctx = ctx

    def tail_padding(self, rank: int) -> int:
        lo = rank * self.part
        return max(0, min(lo + self.part, self.padded) - max(lo, self.end))

    def pieces(self, state: str, lo: int, hi: int) -> list:
        """Elements [lo, hi) of the flat group for `state`, as pieces (zeros in the gaps)."""
        out, cursor = [], lo
        for name in self.flat:
            start = self.offsets[name]
            overlap = intersect(start, start + self.ctx.numel(name), lo, hi)
            if overlap is None:
                continue
            a, b = overlap
            if a > cursor:
                out.append(Piece.zeros(a - cursor))
            out.append(Piece(b - a, (name, state), a - start))
            cursor = b
        if hi > cursor:
            out.append(Piece.zeros(hi - cursor))
        return out

    def slice_mappings(self, rank: int) -> OrderedDict:
        """param_slice_mappings exactly as DeepSpeed writes them.

        DeepSpeed computes them in the original param order, with offsets of the flat buffer only
        when per-param alignment padding exists, else by summing sizes in the original order; under
        round_robin_gradients that is not where the params are (its defect B1). Nothing loads them,
        but readers take the original order from them, so we write the same.
        """
        lo, hi = rank * self.part, (rank + 1) * self.part
        offsets, running = {}, 0
        for name in self.original:
            offsets[name] = self.offsets[name] if any(self.paddings) else running
            running += self.ctx.numel(name)
        mappings = OrderedDict()
        for name in self.original:
            start = offsets[name]
            overlap = intersect(start, start + self.ctx.numel(name), lo, hi)
            if overlap:
                mappings[name] = standins.fragment_address(numel=overlap[1] - overlap[0], start=overlap[0] - lo)
        return mappings


def _module(catalog, make_slot) -> tuple:
    """The module state_dict in model order, a tied name sharing its source's tensor; and the slots."""
    module, slots = OrderedDict(), {}
    for key in catalog.order:
        source = catalog.aliases.get(key, key)
        if source not in slots:
            slots[source] = make_slot(catalog.params[source])
        module[key] = slots[source]
    return module, slots


def _round_robin(names_in_order, dp):
    """DeepSpeed's _round_robin_reorder: param i goes to bucket i % dp, buckets concatenated."""
    buckets = OrderedDict()
    for i, name in enumerate(names_in_order):
        buckets.setdefault(i % dp, []).append(name)
    return [name for bucket in buckets.values() for name in bucket]


def _zero12_model_states(ctx: _Context, groups, tag) -> TorchFile:
    name = names.model_states_name(ctx.mp_rank)
    file = TorchFile(f"{tag}/{name}", archive=name[:-3])
    catalog = ctx.catalog

    def full(p):    # ZeRO-1/2 save the whole 16-bit module: buffers, frozen and trainable weights
        dtype = catalog.tensors[(p.name, MODULE)].dtype if p.kind == "buffer" else ctx.lp_dtype
        src = (p.name, MODULE) if p.kind != "trainable" else ctx.weight_source(p.name)
        return file.slot(dtype, p.shape, [Piece(ctx.numel(p.name), src, 0)])

    if ctx.module_in_layer_files:     # a PipelineModule's weights are in layer files; frozen ones too
        module, slots = None, {p.name: None for p in ctx.frozen()}
    else:
        module, slots = _module(catalog, full)
    stage2 = ctx.target.zero == 2
    frozen = ctx.frozen()
    tree = {
        "module": module,
        "buffer_names": [p.name for p in catalog.params.values() if p.kind == "buffer"],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, ctx.shape(n)) for n in group.flat) for group in groups],
        "frozen_param_shapes": OrderedDict((p.name, ctx.shape(p.name)) for p in frozen) if stage2 else None,
        "shared_params": ctx.model_extra.get("shared_params", dict(catalog.aliases)),
        "frozen_param_fragments": OrderedDict((p.name, slots[p.name]) for p in frozen) if stage2 else None,
        **ctx.model_states_tail(),
    }
    file.tree = tree
    return file


def _zero12_optim_states(ctx: _Context, rank, groups, tag) -> TorchFile:
    name = names.optim_states_name(rank, ctx.mp_rank, ctx.bf16_prefix)
    file = TorchFile(f"{tag}/{name}", archive=name[:-3])
    fp32_parts, paddings, states, lean_states, param_groups, mappings = [], [], {}, [], [], []
    for group in groups:
        lo = rank * group.part
        pad = group.tail_padding(rank)
        lean = group.part - pad
        fp32_len = group.part if ctx.bf16_optimizer else lean
        fp32_parts.append(file.slot("float32", (fp32_len,), group.pieces(MASTER, lo, lo + fp32_len)))
        state_len = lean if ctx.elastic else group.part
        entry = _state_dict_entry(ctx, file, group.g, {
            s: (state_len, group.pieces(s, lo, lo + state_len)) for s in ctx.states})
        if ctx.elastic:
            lean_states.append(entry)
        else:
            states[group.g] = entry
        param_groups.append({**ctx.hyper_params(group.g), "params": [group.g]})
        paddings.append(pad)
        mappings.append(group.slice_mappings(rank))
    base = lean_states if ctx.elastic else {"state": states, "param_groups": param_groups}
    count = [ctx.dp] * len(groups)
    if ctx.bf16_optimizer:
        inner = {"clip_grad": ctx.loss_scaler_state()["clip_grad"], "base_optimizer_state": base,
                 "single_partition_of_fp32_groups": fp32_parts, "group_paddings": paddings,
                 "partition_count": count, "ds_version": ctx.ds_version, "param_slice_mappings": mappings}
    else:
        inner = {**ctx.loss_scaler_state(), "base_optimizer_state": base}
        if ctx.elastic:
            inner.update(_elastic_step(ctx))
        inner.update({"single_partition_of_fp32_groups": fp32_parts,
                 "zero_stage": standins.ZeroStageEnum(ctx.target.zero), "group_paddings": paddings,
                 "param_alignment_paddings": [list(group.paddings) for group in groups],
                 "partition_count": count, "ds_version": ctx.ds_version, "param_slice_mappings": mappings})
    file.tree = {"optimizer_state_dict": inner, "ds_config": ctx.config, "ds_version": ctx.ds_version}
    return file


def _elastic_step(ctx) -> dict:
    """`base_optimizer_state_step` for elastic files.

    DeepSpeed writes it only when the optimizer keeps `step` in its param groups (its FusedAdam),
    yet its elastic loader asserts it is there, so its own elastic checkpoints of torch.optim.Adam
    cannot be resumed. We always write it (the per-group step counter) so the engine can load ours.
    """
    steps = ctx.catalog.scalar_values("step")
    if len(steps) != 1:
        return {}
    step = steps.pop()
    return {"base_optimizer_state_step": int(step) if float(step).is_integer() else step}


# ---------------------------------------------------------------------------------------------
# ZeRO-3


def _zero3_sub_groups(ctx: _Context) -> list:
    """[(param group, [names])] as DeepSpeed's _create_fp16_sub_groups forms them for the target dp."""
    out = []
    for g, group in enumerate(ctx.catalog.param_groups):
        params = list(group["params"])
        parts = [ceil_div(ctx.numel(n), ctx.dp) for n in params]
        if ctx.sub_group_size >= sum(parts):
            out.append((g, params))
            continue
        current, size = [], 0
        for name, part in zip(params, parts):
            current.append(name)
            size += part
            if size >= ctx.sub_group_size or name == params[-1]:
                out.append((g, current))
                current, size = [], 0
    return out


def _zero3_part_pieces(ctx, name, state, rank) -> list:
    """Rank's ceil(n/dp) part of one param: its real elements, then padding zeros."""
    n = ctx.numel(name)
    part = ceil_div(n, ctx.dp)
    held = max(0, min(part, n - rank * part))
    pieces = [Piece(held, (name, state), rank * part)] if held else []
    if part > held:
        pieces.append(Piece.zeros(part - held))
    return pieces


def _zero3_model_states(ctx: _Context, rank, sub_groups, tag) -> TorchFile:
    name = names.model_states_name(ctx.mp_rank, rank)
    file = TorchFile(f"{tag}/{name}", archive=name[:-3])
    catalog = ctx.catalog

    def partitioned(p):     # ZeRO-3 params are partitioned: the module holds empty placeholders
        if p.kind != "buffer":
            return file.slot(ctx.lp_dtype, (0,), [])
        tensor = catalog.tensors[(p.name, MODULE)]
        return file.slot(tensor.dtype, p.shape, [Piece(tensor.numel, (p.name, MODULE), 0)])

    module, _ = _module(catalog, partitioned)
    frozen_fragments = OrderedDict()
    for p in ctx.frozen():
        part = ceil_div(ctx.numel(p.name), ctx.dp)
        frozen_fragments[p.name] = file.slot(catalog.tensors[(p.name, MODULE)].dtype, (part,),
                                             _zero3_part_pieces(ctx, p.name, MODULE, rank))
    file.tree = {
        "module": module,
        "buffer_names": [p.name for p in catalog.params.values() if p.kind == "buffer"],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, ctx.shape(n)) for n in members) for _, members in sub_groups],
        "frozen_param_shapes": OrderedDict((p.name, ctx.shape(p.name)) for p in ctx.frozen()),
        "shared_params": dict(catalog.aliases) if rank == 0 else {},
        "frozen_param_fragments": frozen_fragments,
        **ctx.model_states_tail(),
    }
    return file


def _zero3_optim_states(ctx: _Context, rank, sub_groups, tag) -> TorchFile:
    name = names.optim_states_name(rank, ctx.mp_rank, ctx.bf16_prefix)
    file = TorchFile(f"{tag}/{name}", archive=name[:-3])
    states, flat_groups = {}, []
    group_members = [[] for _ in ctx.catalog.param_groups]
    for i, (g, members) in enumerate(sub_groups):
        length = sum(ceil_div(ctx.numel(n), ctx.dp) for n in members)
        pieces = {s: [p for n in members for p in _zero3_part_pieces(ctx, n, s, rank)]
                  for s in [MASTER, *ctx.states]}
        states[i] = _state_dict_entry(ctx, file, g, {s: (length, pieces[s]) for s in ctx.states})
        flat_groups.append(file.slot("float32", (length,), pieces[MASTER]))
        group_members[g].append(i)
    param_groups = [{**ctx.hyper_params(g), "params": members} for g, members in enumerate(group_members)]
    scaler = ctx.loss_scaler_state()
    inner = {"zero_stage": standins.ZeroStageEnum.weights, "loss_scaler": scaler["loss_scaler"],
             "dynamic_loss_scale": scaler["dynamic_loss_scale"], "overflow": scaler["overflow"],
             "partition_count": ctx.dp,
             "optimizer_state_dict": {"state": states, "param_groups": param_groups},
             "fp32_flat_groups": flat_groups}
    file.tree = {"optimizer_state_dict": inner, "ds_config": ctx.config, "ds_version": ctx.ds_version}
    return file
