"""Megatron-LM's legacy checkpoints (`--ckpt-format torch`) -> Catalog, from the pickles' metadata alone.

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000003/mp_rank_TT[_PPP]/model_optim_rng.pt   per tensor- (and pipeline-) parallel rank, written by
                                                             its first data-parallel rank: args, iteration, the
                                                             rank's own module state dict, the optimizer's state
                                                             dict, scheduler, RNG states
                                         distrib_optim.pt    the distributed optimizer's state, gathered over data
                                                             parallelism: per grad buffer one flat fp32 param,
                                                             exp_avg and exp_avg_sq, the buckets without padding

Nothing in the files says how tensor parallelism cut a tensor: the parameter-order file does (its `tensor_parallel`
cuts, tp_boxes.py), applied to the names megatron-core's sharded state dict gives (its `state_dict_keys_map`), so a
legacy save reads to the same logical tensors as a torch_dist save of the same run. A pipeline stage numbers its
layers from 0: stage s of P holds layers s·L/P onwards (even stages only). The plain optimizer's state is keyed by
position in its param groups, which hold the stage's params in registration order (the state dict's order) split by
weight decay (order.py); the distributed optimizer's flat buffers are laid out as buckets.py recomputes, each
bucket's unpadded part after the one before.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from reshard.core.catalog import (
    MASTER,
    MODULE,
    CatalogBuilder,
    FileInfo,
    Fragment,
    ParamInfo,
    TensorDraft,
    TensorKey,
)
from reshard.core.layout import Layout
from reshard.core.placement import Shard
from reshard.errors import CheckpointError, ReshardError
from reshard.formats.megatron import buckets, common as common_fields, order as param_order, pickles, tp_boxes
from reshard.formats.megatron.topology import PLAIN
from reshard.formats.torchsave_read import TensorRef, load as load_pickle
from reshard.reading.source_bytes import read_scalar
from reshard.storage import files as fs

MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"
RANK_FOLDER = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")
GATHERED = "dp_zero_gather_scatter"    # megatron's name for the distributed optimizer's state gathered per buffer
LAYOUT = "legacy torch format (mp_rank_* folders of pickles)"
STATES = ("param", "exp_avg", "exp_avg_sq")     # a buffer's flat states; param is the fp32 master


def is_legacy(folder: str) -> bool:
    """An iteration folder of Megatron-LM's legacy format: mp_rank_* folders holding model_optim_rng.pt."""
    try:
        names = fs.listdir(folder)
    except OSError:
        return False
    return any(RANK_FOLDER.match(n) and fs.isfile(os.path.join(folder, n, MODEL_FILE)) for n in names)


def read(folder: str, save_dir: str | None, name: str, format_name: str):
    return _LegacyReader(folder, save_dir, name, format_name).read()


# what a torch_dist save keeps apart from its common state: the model, the optimizer's state, the RNG state
SHARDED_PARTS = ("model", "optimizer", "rng_state")
EXTRA_STATE = "._extra_state"
EMPTY_DROPPED = ("output_layer._extra_state",)     # GPTModel's sharded state dict drops it (asserting it empty)


def common_state(folder: str) -> tuple[dict, str]:
    """(the common state, where it is): what the first rank file holds beside the model, the optimizer's state and
    the RNG state, which a torch_dist save keeps in its sharded tensors and objects (args, iteration, checkpoint
    version, scheduler, counters)."""
    reader = _LegacyReader(folder, None, os.path.basename(folder), "megatron")
    ranks = reader._rank_folders()
    if not ranks:
        raise CheckpointError(folder, "no mp_rank_* folder")
    path = os.path.join(ranks[min(ranks)], MODEL_FILE)
    head = reader._load(path)
    return {k: v for k, v in head.items() if k not in SHARDED_PARTS}, path


def extra_states(folder: str) -> dict[str, object]:
    """{the key megatron-core's torch_dist save gives it: value} of every layer's `_extra_state` in the model state
    dicts (tensor-parallel rank 0's of each pipeline stage): a layer stack's as one object per layer
    (`decoder.layers.<key>._extra_state/shard_<layer>_<layers>`, global layer numbers), as its sharded state dict
    makes them; the output layer's, which GPTModel's sharded state dict drops when empty, left out. Only empty ones
    (None: the local spec's) are known: one that holds a value (Transformer Engine's FP8 metadata) or another
    module's is refused, as what a torch_dist save makes of it is not known here."""
    reader = _LegacyReader(folder, None, os.path.basename(folder), "megatron")
    ranks = reader._rank_folders()
    path = os.path.join(ranks[min(ranks)], MODEL_FILE)
    head = reader._load(path)
    args = head.get("args")
    args = vars(args) if isinstance(args, pickles.Namespace) else {}
    layers, pp = int(args.get("num_layers") or 0), int(args.get("pipeline_model_parallel_size") or 1)
    rules = reader.rules
    out: dict[str, object] = {}
    for (t, p), rank_folder in sorted(ranks.items()):
        if t != 0:
            continue
        path = os.path.join(rank_folder, MODEL_FILE)
        for name, value in reader._load(path)["model"].items():
            if not name.endswith(EXTRA_STATE):
                continue
            if value is not None:
                raise CheckpointError(path, f"{name} holds a {type(value).__name__}: only empty extra states (the "
                                      "local layer spec's) are written to torch_dist")
            key = extra_state_key(rules, name, p * (layers // pp), layers, path)
            if key is not None:
                out[key] = value
    return out


def extra_state_key(rules: param_order.ParamOrder, name: str, first_layer: int, layers: int,
                    path: str, experts: int = 0) -> str | None:
    """The torch_dist key of an empty `_extra_state` of a module state dict whose layers start at global layer
    `first_layer` (None: one GPTModel's sharded state dict leaves out); an expert's (of `experts` per layer) is
    sharded by (layer, expert); another outside the layer stack is refused, naming `path`."""
    where = rules.layer_of(name)
    expert = rules.expert_of(name)
    if expert is not None:
        return f"{rules.stacked_key(name)}/shard_{expert[0] + first_layer}.{expert[1]}_{layers}.{experts}"
    if where is not None:
        return f"{rules.layer_prefix}{where[1]}/shard_{where[0] + first_layer}_{layers}"
    if name not in EMPTY_DROPPED:
        raise CheckpointError(path, f"{name}: an extra state outside the layer stack, which a torch_dist save is not "
                              "known to keep")
    return None


class _LegacyReader:
    def __init__(self, folder: str, save_dir: str | None, name: str, format_name: str):
        self.folder, self.name = folder, name
        self.catalog = CatalogBuilder(folder, format_name, Layout.of(1, 1, 1), tag=name, save_dir=save_dir or folder)
        self.rules = param_order.load()
        self.notes: dict[str, dict[str, Any]] = {}
        self.steps: set[int] = set()        # the plain optimizer's per-param steps
        self.grad_buffers: set[tuple[str, str]] = set()     # distrib_optim.pt's (param dtype, grad dtype) keys

    def read(self):
        catalog = self.catalog
        ranks = self._rank_folders()
        first = os.path.join(ranks[min(ranks)], MODEL_FILE)
        states = {key: self._load(os.path.join(path, MODEL_FILE)) for key, path in ranks.items()}
        head = states[min(ranks)]
        args = head.get("args")
        self.args = vars(args) if isinstance(args, pickles.Namespace) else {}
        tp, pp, dp = (self._degree(first, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                       "data_parallel_size"))
        self.tp, self.pp = tp, pp
        for key in ("virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers", "expert_model_parallel_size"):
            if self.args.get(key) not in (None, 0, 1):
                raise CheckpointError(first, f"args.{key} = {self.args[key]}: not read in legacy saves yet")
        missing = sorted(set((t, p) for t in range(tp) for p in range(pp)) - set(ranks))
        for t, p in missing:
            catalog.problem(os.path.join(self.folder, _folder_name(t, p, pp)), "missing")
        extra = sorted(set(ranks) - set((t, p) for t in range(tp) for p in range(pp)))
        if extra:
            raise CheckpointError(os.path.join(self.folder, ranks[extra[0]]), f"a rank beyond tp={tp}, pp={pp}")
        layers = self.args.get("num_layers")
        if pp > 1 and (not isinstance(layers, int) or layers % pp):
            raise CheckpointError(first, f"args.num_layers {layers!r} does not split evenly over pp={pp}")
        catalog.layout = Layout.of(dp, tp, pp)

        local = {key: self._local_params(key, state, int(layers or 0)) for key, state in states.items()}
        shards = self._model(local)
        sharding = self._optimizer(ranks, states, local, shards)
        groups, step = self._param_groups(head)
        common_fields.params_as_masters(catalog, sorted({k.name for k in catalog.tensors if k.state != MODULE}))
        self._params(groups)
        catalog.group_scalars = [({"step": step} if step is not None else {}) for _ in groups]
        catalog.files = self._files(ranks)
        common_fields.finish(catalog, (dp, tp, pp), sharding, head, self.args, LAYOUT, self.notes, backend="torch",
                             grad_buffers=tuple(sorted(self.grad_buffers)))
        return catalog.freeze()

    # -- files

    def _rank_folders(self) -> dict[tuple[int, int], str]:
        out = {}
        for entry in sorted(fs.listdir(self.folder)):
            found = RANK_FOLDER.match(entry)
            if found is None or not fs.isdir(os.path.join(self.folder, entry)):
                continue
            if found.group(3):
                raise CheckpointError(os.path.join(self.folder, entry), "an expert-parallel rank's folder: legacy "
                                      "saves with expert parallelism are not read yet")
            out[(int(found.group(1)), int(found.group(2) or 0))] = os.path.join(self.folder, entry)
        return out

    def _load(self, path: str) -> Mapping[str, Any]:
        if not fs.isfile(path):
            raise CheckpointError(path, "missing")
        state = load_pickle(path, allowed=pickles.LEGACY_ALLOWED)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise CheckpointError(path, "not the state dict Megatron-LM's save_checkpoint writes (no model)")
        return state

    def _degree(self, path: str, key: str) -> int:
        value = self.args.get(key, 1)
        if value is None:
            return 1
        if not isinstance(value, int) or value < 1:
            raise CheckpointError(path, f"args.{key} is {value!r}, not a positive whole number")
        return value

    def _files(self, ranks: Mapping[tuple[int, int], str]) -> list[FileInfo]:
        out = []
        for (t, p), folder in sorted(ranks.items()):
            for name, role in ((MODEL_FILE, "model"), (OPTIMIZER_FILE, "optimizer")):
                path = os.path.join(folder, name)
                if fs.isfile(path):
                    out.append(FileInfo(os.path.relpath(path, self.folder), role, t + self.tp * p, fs.getsize(path)))
        return out

    # -- the model

    def _local_params(self, key: tuple[int, int], state: Mapping[str, Any], layers: int) -> dict[str, TensorRef]:
        """{name as a torch_dist save keys it: the rank's tensor}, in the rank's registration order: its layer
        numbers made global for its pipeline stage, `_extra_state` entries (no tensor) left out."""
        stage, out = key[1], {}
        for name, value in state["model"].items():
            if not isinstance(value, TensorRef):
                continue
            where = self.rules.layer_of(name)
            if where is not None and self.pp > 1:
                name = f"{self.rules.layer_prefix}{where[0] + stage * (layers // self.pp)}.{where[1]}"
            out[self.rules.sharded_name(name)] = value
        return out

    def _model(self, local: Mapping[tuple[int, int], dict[str, TensorRef]]) -> dict[str, dict[int, Shard | None]]:
        """The module tensors; {name: {tp rank: the shard it is read from}} for the optimizer's states (a tensor
        whole on every rank is read from tp rank 0: the others' shards hold no block)."""
        shards: dict[str, dict[int, Shard | None]] = {}
        for (t, _), params in sorted(local.items()):
            for name, ref in params.items():
                cut = self.rules.tp_cut(name)
                parts = cut.parts if cut is not None and (cut.parts_when is None or self.args.get(cut.parts_when)) \
                    else 1
                shape = tuple(n * self.tp if cut is not None and d == cut.axis else n
                              for d, n in enumerate(ref.shape))
                try:
                    boxes = tp_boxes.rank_boxes(name, shape, cut, parts, self.tp, t)
                except ReshardError as e:
                    raise CheckpointError(ref.storage.file, str(e)) from None
                shard = tp_boxes.local_shard(boxes, cut) if cut is not None or t == 0 else Shard(shape, ())
                shards.setdefault(name, {})[t] = None if shard == Shard.whole(shape) else shard
                self.catalog.add(TensorDraft(name, MODULE, shape, ref.dtype), ref.storage.file)
                self.notes.setdefault(name, {"tensor_parallel": f"axis {cut.axis}" + (
                    f", {parts} parts" if parts > 1 else "") if cut is not None else "whole on every rank"})
        for (t, p), params in sorted(local.items()):
            for name, ref in params.items():
                self._fragment(name, MODULE, ref, (t, p), shards)
        return shards

    def _fragment(self, name: str, state: str, ref: TensorRef, key: tuple[int, int],
                  shards: Mapping[str, Mapping[int, Shard | None]], storage_offset: int | None = None) -> None:
        """Rank `key`'s tensor of (name, state), stored at `ref` (at `storage_offset` elements of its storage, for
        a part of a flat buffer), as a fragment of the logical tensor: the shard tensor parallelism gives it."""
        full = self.catalog.tensors[TensorKey(name, MODULE)].shape
        draft = self.catalog.add(TensorDraft(name, state, full, ref.dtype), ref.storage.file)
        t, p = key
        shard = shards[name].get(t)
        if shard is not None and not shard.blocks:
            return          # a copy of what another rank holds
        if storage_offset is None and not ref.is_contiguous():
            self.catalog.problem(ref.storage.file, f"{name} ({state}): not stored contiguously")
            return
        numel = math.prod(shard.shape) if shard is not None else math.prod(full)
        draft.fragments.append(Fragment(0, numel, ref.storage,
                                        ref.storage_offset if storage_offset is None else storage_offset,
                                        t + self.tp * p, shard))

    # -- the optimizer

    def _optimizer(self, ranks, states, local, shards) -> str:
        """The fp32 masters and moments of every rank; the optimizer's sharding."""
        distributed = [os.path.join(path, OPTIMIZER_FILE) for path in ranks.values()]
        if any(fs.isfile(p) for p in distributed) or self.args.get("use_distributed_optimizer"):
            for key, path in sorted(ranks.items()):
                self._gathered(key, os.path.join(path, OPTIMIZER_FILE), local[key], shards)
            return GATHERED
        for key, state in sorted(states.items()):
            self._plain(key, os.path.join(ranks[key], MODEL_FILE), state, local[key], shards)
        return PLAIN

    def _groups_of(self, params: Mapping[str, TensorRef], groups: list) -> list[list[str]]:
        """The names each saved param group holds: the rank's params in registration order, the group without
        weight decay (wd_mult 0) taking what the parameter-order file says takes none."""
        no_decay = [self.rules.takes_no_weight_decay(n, ref.shape) for n, ref in params.items()]
        return [[n for n, nd in zip(params, no_decay, strict=True) if nd == (g.get("wd_mult") == 0.0)]
                for g in groups]

    def _plain(self, key, path, state, params, shards) -> None:
        """Megatron's Float16 optimizer: fp32_from_fp16_params[g][i] and state[index] of param_groups[g]'s i-th;
        its FP32Optimizer (an fp32 run) saves its torch optimizer's state dict itself, the params its masters."""
        optimizer = state.get("optimizer")
        inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
        masters = optimizer.get("fp32_from_fp16_params") if isinstance(optimizer, dict) else None
        if isinstance(optimizer, dict) and inner is None and masters is None and "param_groups" in optimizer:
            inner = optimizer
            masters = [[None] * len(g.get("params", ())) if isinstance(g, dict) else [] for g in
                       optimizer["param_groups"]]
        if not isinstance(inner, dict) or not isinstance(masters, list):
            self.catalog.problem(path, "no optimizer state (fp32_from_fp16_params) in it")
            return
        groups, saved = inner.get("param_groups", []), inner.get("state", {})
        for group, names, fp32 in zip(groups, self._groups_of(params, groups), masters, strict=False):
            indices = group.get("params", [])
            if not (len(names) == len(indices) == len(fp32)):
                self.catalog.problem(path, f"a param group of {len(indices)} params, {len(fp32)} fp32 copies, where "
                                     f"the parameter-order file puts {len(names)} of this rank's params")
                continue
            for name, index, master in zip(names, indices, fp32, strict=True):
                moments = saved.get(index, {})
                for state_name, ref in ((MASTER, master), ("exp_avg", moments.get("exp_avg")),
                                        ("exp_avg_sq", moments.get("exp_avg_sq"))):
                    if ref is not None or state_name != MASTER:     # (FP32Optimizer: no master copy)
                        self._state(path, name, state_name, ref, params[name], key, shards)
                step = moments.get("step")
                if isinstance(step, TensorRef) and step.numel == 1:
                    self.steps.add(int(read_scalar(step)))

    def _state(self, path, name, state_name, ref, param: TensorRef, key, shards) -> None:
        if not isinstance(ref, TensorRef) or tuple(ref.shape) != tuple(param.shape):
            shape = list(ref.shape) if isinstance(ref, TensorRef) else type(ref).__name__
            self.catalog.problem(path, f"{name} ({state_name}): the optimizer holds {shape} where the param is "
                                 f"{list(param.shape)}: its params are not in the order the parameter-order file "
                                 "gives")
            return
        self._fragment(name, state_name, ref, key, shards)

    def _gathered(self, key, path, params, shards) -> None:
        """distrib_optim.pt: {buckets_coalesced, grad buffer index: {(param dtype, grad dtype): {param, exp_avg,
        exp_avg_sq, numel_unpadded}}}, the buffer's params laid out as buckets.lay_out recomputes."""
        if not fs.isfile(path):
            self.catalog.problem(path, "missing: the distributed optimizer saves its state there")
            return
        saved = load_pickle(path, allowed=pickles.LEGACY_ALLOWED)
        buffers = {k: v for k, v in saved.items() if isinstance(k, int)} if isinstance(saved, dict) else {}
        if list(buffers) != [0] or not isinstance(buffers[0], dict) or len(buffers[0]) != 1:
            raise CheckpointError(path, "one grad buffer of one dtype is read (bf16 or fp16 params, fp32 grads); "
                                  f"this file holds {len(buffers)} buffers")
        dtypes, flat = next(iter(buffers[0].items()))
        if isinstance(dtypes, tuple) and len(dtypes) == 2:
            self.grad_buffers.add((str(dtypes[0]), str(dtypes[1])))
        laid = buckets.lay_out([(n, ref.numel) for n, ref in params.items()],
                               int(self.args.get("data_parallel_size") or 1), self._bucket_size(),
                               high_busbw=bool(self.args.get("ddp_pad_buckets_for_high_nccl_busbw")))
        unpadded = sum(b.numel_unpadded for b in laid)
        if flat.get("numel_unpadded") != unpadded or any(
                not isinstance(flat.get(s), TensorRef) or flat[s].numel != unpadded for s in STATES):
            raise CheckpointError(path, f"holds {flat.get('numel_unpadded')!r} elements per state where megatron's "
                                  f"bucketing of this rank's params gives {unpadded}")
        at = 0
        for bucket in laid:
            for placed in bucket.params:
                for state in STATES:
                    ref = flat[state]
                    self._fragment(placed.name, MASTER if state == "param" else state, ref, key, shards,
                                   storage_offset=ref.storage_offset + at + placed.start)
            at += bucket.numel_unpadded

    def _bucket_size(self) -> int | None:
        if not self.args.get("overlap_grad_reduce"):
            return None
        size = self.args.get("ddp_bucket_size")
        return size if isinstance(size, int) else max(40_000_000, 1_000_000 * int(self.args.get(
            "data_parallel_size") or 1))

    # -- groups and params

    def _param_groups(self, head: Mapping[str, Any]) -> tuple[list[dict], int | None]:
        optimizer = head.get("optimizer")
        inner = optimizer.get("optimizer", optimizer) if isinstance(optimizer, dict) else None    # (FP32Optimizer's)
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            self.catalog.problem(self.folder, "no optimizer param groups found")
            return [], None
        steps = self.steps | {int(g["step"]) for g in groups if isinstance(g.get("step"), (int, float))}
        return [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups], \
            (max(steps) if steps else None)

    def _params(self, groups: list[dict]) -> None:
        catalog = self.catalog
        names = [k.name for k in catalog.tensors if k.state == MODULE]
        ordered = self.rules.ordered(names)
        no_wd = [i for i, g in enumerate(groups) if g.get("wd_mult") == 0.0]
        wd = [i for i, g in enumerate(groups) if g.get("wd_mult") != 0.0]
        trainable = {k.name for k in catalog.tensors if k.state != MODULE}
        for name in ordered:
            shape = catalog.tensors[TensorKey(name, MODULE)].shape
            held = no_wd if self.rules.takes_no_weight_decay(name, shape) else wd
            kind = "trainable" if name in trainable else "frozen"
            catalog.params[name] = ParamInfo(name, shape, kind, held[0] if held and kind == "trainable" else None)
            catalog.order.append(name)
        catalog.param_groups = [{**g, "params": [n for n in ordered if catalog.params[n].group == i]}
                                for i, g in enumerate(groups)]


def _folder_name(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
