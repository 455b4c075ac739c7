"""A Megatron-LM save dir of megatron-core's torch_dist format -> Catalog, from metadata alone.

    <save>/latest_checkpointed_iteration.txt      the iteration Megatron-LM loads ("3"; "release")
    <save>/iter_0000003/metadata.json             {"sharded_backend": "torch_dist", ...}
                        common.pt                 args (argparse.Namespace), iteration, checkpoint_version,
                                                  content_metadata (the distributed optimizer's sharding type), ...
                        .metadata, __R_I.distcp   a DCP checkpoint of every sharded tensor and object
megatron-core 0.19 writes no common.pt: the common state is the DCP object common_state (metadata.json names no
common backend).

The path is the save dir (its latest iteration, or `--tag iter_NNNNNNN`) or an iteration folder. Keys:

  decoder.layers.<key>                        a layer stack: a leading layer axis, one chunk per (layer, TP shard)
                                              -> one logical tensor per layer, decoder.layers.<i>.<key>
  <model key>                                 -> (key, module)
  optimizer.state.{fp32_param|param}.<key>    -> (key, fp32)   the plain optimizer / fully_reshardable
  optimizer.state.{exp_avg|exp_avg_sq}.<key>  -> (key, state)
                                              (0.15, fully_sharded_model_space: stored block-wise flattened, each
                                              chunk a flat range of one tensor-parallel block; _reformulated)
  optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(P, G).bucket_idx_K.{param|exp_avg|exp_avg_sq}
                                              dp_reshardable: per model-parallel rank G (tp rank + tp * pp rank) and
                                              grad buffer, flat buckets, mapped onto the params by recomputing
                                              megatron's bucketing (buckets.py) in the parameter order of a rule
                                              file (order.py), checked against per_bucket_numel(_unpadded)

Every pickle (common.pt, `.metadata`, the objects inside the `.distcp` files) goes through an allow-list
(pickles.py): nothing in a checkpoint runs.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.catalog import (
    MASTER,
    MODULE,
    Catalog,
    CatalogBuilder,
    ExpertLayer,
    ExpertParallel,
    FileInfo,
    Fragment,
    LogicalTensor,
    ParamInfo,
    Replica,
    TensorDraft,
    TensorKey,
)
from reshard.core.layout import Layout
from reshard.core.placement import Block, Shard
from reshard.errors import CheckpointError, ReshardError
from reshard.formats.dcp import metadata as md
from reshard.formats.dcp.chunks import METADATA, MISSING, Chunks, dtype_of, rank_of
from reshard.formats.megatron import buckets, common as common_fields, legacy, order as param_order
from reshard.formats.megatron.pickles import COMMON_ALLOWED, METADATA_ALLOWED, Namespace
from reshard.formats.megatron.topology import (
    DP_RESHARDABLE,
    LAYOUT_015,
    LAYOUT_016,
    LAYOUT_019,
    PLAIN,
    WEIGHTS_ONLY,
)
from reshard.formats.protocol import TagOption
from reshard.formats.torchsave_read import DType, TensorRef, load as load_pickle
from reshard.reading.source_bytes import read_scalar
from reshard.storage import files as fs

FORMAT = "megatron"
OPTIONS = TagOption
IN_FRAMEWORK_FOLDERS = False

TRACKER = "latest_checkpointed_iteration.txt"
ITERATION = re.compile(r"iter_(\d{7})$")
RELEASE = "release"
CONFIG = "metadata.json"
COMMON = "common.pt"
OPTIMIZER_STATE = "optimizer.state."
# the optimizer's state names -> the catalog's: the fp32 copy is the master
STATES = {"fp32_param": MASTER, "param": MASTER, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# (a mixture of experts' save chains two distributed optimizers, the dense params' and the experts': chained_K.)
BUCKET = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(\(.*\))"
                    r"\.bucket_idx_(\d+)\.(\w+)$")
PER_BUCKET = "{}optimizer.distributed.dp_group_idx_{}.{}"
SHARDING_KEY = "distrib_optim_sharding_type"
LAYER_STACKS = ("decoder.layers.", "encoder.layers.")     # a TransformerBlock's layers, saved stacked
CHAINED = re.compile(r"chained_\d+\.optimizer\.")
BUCKET_OBJECT = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.")
COMMON_STATE = "common_state"         # 0.19: the common state's DCP key (its ShardedObject: common_state/shard_0_1)


def sniff(path: str, tag: str | None) -> bool:
    if not fs.isdir(path):
        return False
    if tag is not None:
        return _is_iteration_dir(os.path.join(path, tag))
    if fs.isfile(os.path.join(path, TRACKER)) or _is_iteration_dir(path):
        return True
    return any(ITERATION.match(n) and _is_iteration_dir(os.path.join(path, n)) for n in fs.listdir(path))


def _is_iteration_dir(path: str) -> bool:
    """A folder megatron-core's dist_checkpointing wrote (metadata.json naming a sharded backend), or one of
    Megatron-LM's legacy format."""
    config = _config(os.path.join(path, CONFIG))
    return isinstance(config, dict) and "sharded_backend" in config or legacy.is_legacy(path)


def _config(path: str):
    try:
        with fs.open(path) as f:
            return json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None


def resolve(path: str, tag: str | None) -> tuple[str, str | None, str]:
    """(iteration folder, save dir or None, its name) of the checkpoint at `path`."""
    path = fs.abspath(path)
    if tag is not None:
        return os.path.join(path, tag), path, tag
    if _is_iteration_dir(path):
        parent = os.path.dirname(path)
        return path, parent if fs.isfile(os.path.join(parent, TRACKER)) else None, os.path.basename(path)
    tracker = os.path.join(path, TRACKER)
    if not fs.isfile(tracker):
        raise CheckpointError(tracker, "missing: name the iteration folder (--tag iter_NNNNNNN or its path)")
    with fs.open(tracker) as f:
        text = f.read(64).strip()
    if text == RELEASE:
        name = RELEASE
    elif re.fullmatch(r"[0-9]+", text):
        name = f"iter_{int(text):07d}"
    else:
        raise CheckpointError(tracker, f"holds {text[:20]!r}, not an iteration number")
    folder = os.path.join(path, name)
    if not fs.isdir(folder):
        raise CheckpointError(folder, f"missing: {TRACKER} names iteration {text}")
    return folder, path, name


def read(path: str, options: TagOption) -> Catalog:
    folder, save_dir, name = resolve(path, options.tag)
    try:
        if not fs.isfile(os.path.join(folder, CONFIG)) and legacy.is_legacy(folder):
            return legacy.read(folder, save_dir, name, FORMAT)
        return _Reader(folder, save_dir, name).read()
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise ReshardError.at(folder, f"not the structure megatron-core writes ({type(e).__name__}: {e})") from None


class _Reader:
    def __init__(self, folder: str, save_dir: str | None, name: str):
        self.folder, self.save_dir, self.name = folder, save_dir, name
        self.meta_path = os.path.join(folder, METADATA)
        self.boxes: dict[str, list[tuple]] = {}     # model param name -> (at, size) of each chunk of it
        self.notes: dict[str, dict[str, Any]] = {}
        self.flattened = False      # a 0.15 save: states stored as flat ranges of blocks (_reformulated)
        self.grad_buffers: set[tuple[str, str]] = set()     # dp_reshardable: each buffer's (param, grad) dtypes

    def read(self) -> Catalog:
        folder = self.folder
        config = _config(os.path.join(folder, CONFIG))
        if not isinstance(config, dict):
            raise CheckpointError(os.path.join(folder, CONFIG), "missing or not JSON: not a megatron-core "
                                  "distributed checkpoint")
        backend = config.get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(os.path.join(folder, CONFIG), f"sharded backend {backend!r}: only torch_dist "
                                  "saves are read")
        if not fs.isfile(self.meta_path):
            raise CheckpointError(self.meta_path, "missing: DCP writes .metadata last, so the save did not finish")
        meta = source_metadata(self.meta_path)
        self.meta = meta
        # tp and pp come from the common state's args: the layout is set once they are known
        catalog = CatalogBuilder(folder, FORMAT, Layout.of(1, 1, 1), tag=self.name, save_dir=self.save_dir or folder)
        self.catalog = catalog
        chunks = Chunks(folder, meta, catalog)
        self.chunks = chunks
        common, self.common_path, layout = _common(folder, config, lambda: chunks)
        self.common = common
        args = common.get("args")
        self.args = vars(args) if isinstance(args, Namespace) else {}
        content = common.get("content_metadata")
        self.content = content if isinstance(content, dict) else {}
        tp = self._degree("tensor_model_parallel_size")
        pp = self._degree("pipeline_model_parallel_size")
        self.tp, self.pp = tp, pp
        catalog.layout = Layout.of(1, tp, pp)
        world = chunks.world()
        dp = self._degree("data_parallel_size", world // (tp * pp) if world % (tp * pp) == 0 else 1)
        self.dp = dp
        entries = meta.state_dict_metadata
        tensors = {k: e for k, e in entries.items() if isinstance(e, md.TensorStorageMetadata)}
        model = {k: e for k, e in tensors.items() if not k.startswith("optimizer.") and not CHAINED.match(k)}
        optimizer = {k: e for k, e in tensors.items() if k.startswith(OPTIMIZER_STATE)}
        distributed = {k: e for k, e in tensors.items() if BUCKET.match(k)}
        other = sorted(k for k in tensors if (k.startswith("optimizer.") or CHAINED.match(k)) and k not in optimizer
                       and k not in distributed)
        if other:
            catalog.problem(self.meta_path, f"optimizer tensors of no known layout: {', '.join(other[:3])}")
        for key, entry in model.items():
            self._add(key, entry, key, MODULE, model_tensor=True)
        names = [n for n in self.boxes]
        sharding = self.content.get(SHARDING_KEY)
        if not optimizer and not distributed and "optimizer" not in common:
            sharding = WEIGHTS_ONLY     # the model alone (--no-save-optim): every param frozen to the catalog
        elif sharding is None:
            sharding = PLAIN if optimizer or not distributed else DP_RESHARDABLE
        states: set[str] = set()
        for key, entry in optimizer.items():
            state, _, target = key[len(OPTIMIZER_STATE):].partition(".")
            if state not in STATES or target not in model:
                catalog.problem(self.meta_path, f"{key}: optimizer state of no model tensor in this save")
                continue
            stored, model_shape = _size(entry), _size(model[target])
            blocks = self._reformulated(key, stored)
            if blocks is _UNREADABLE:
                continue
            if (stored if blocks is None else blocks.shape) != model_shape:
                catalog.problem(self.meta_path, f"{key}: saved as {list(stored)}, its model tensor as "
                                f"{list(model_shape)}, and no block-wise flattening (0.15's mcore_data) relates "
                                "the two")
                continue
            states |= set(self._add(key, entry, target, STATES[state], blocks=blocks))
        if distributed:
            if sharding != DP_RESHARDABLE:
                raise CheckpointError(self.common_path, f"content_metadata says {sharding}, but the save holds the "
                                      "distributed optimizer's dp_reshardable buckets")
            states |= self._buckets(distributed, names)
        common_fields.params_as_masters(catalog, [n for n in names if n in states])
        ordered = self._ordered(names)
        groups, step = self._param_groups() if sharding != WEIGHTS_ONLY else ([], None)
        group_of = self._group_of(ordered, groups)
        for name in ordered:
            tensor = catalog.tensors[TensorKey(name, MODULE)]
            trainable = name in states
            catalog.params[name] = ParamInfo(name, tensor.shape, "trainable" if trainable else "frozen",
                                             group_of.get(name) if trainable else None)
            catalog.order.append(name)
        catalog.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [n for n in ordered if group_of.get(n) == i
                                            and catalog.params[n].kind == "trainable"]}
                                for i, g in enumerate(groups)]
        catalog.group_scalars = [({"step": step} if step is not None else {}) for _ in groups]
        if self.flattened:
            layout = LAYOUT_015
        catalog.experts = self._experts(ordered)
        if catalog.experts is not None and self.content.get("singleton_local_shards"):
            raise CheckpointError(self.common_path, "singleton_local_shards: experts saved under per-expert keys are "
                                  "not read yet (Megatron-LM's default saves them on an expert axis)")
        catalog.files = self._files(chunks)
        common_fields.finish(catalog, (dp, tp, pp), sharding, common, self.args, layout, self.notes,
                             grad_buffers=tuple(sorted(self.grad_buffers)))
        return catalog.freeze()

    # -- degrees and files

    def _degree(self, key: str, default: int = 1) -> int:
        value = self.args.get(key, default)
        if value is None:
            return default
        if not isinstance(value, int) or value < 1:
            raise CheckpointError(self.common_path, f"args.{key} is {value!r}, not a positive whole number")
        return value

    def _files(self, chunks: Chunks) -> list[FileInfo]:
        """The iteration folder's files (the save dir's tracker names the latest iteration; it is no part of one)."""
        own = ((CONFIG, "config"), (COMMON, "common")) if fs.isfile(self.common_path) else ((CONFIG, "config"),)
        return [FileInfo(name, role, None, fs.getsize(os.path.join(self.folder, name))) for name, role in own] + \
            chunks.files()

    # -- tensors

    def _add(self, key: str, entry, model_key: str, state: str, model_tensor: bool = False,
             blocks: FlatBlocks | None = None) -> list[str]:
        """The logical tensors of saved tensor `key` (state `state` of model tensor `model_key`): one per layer for
        a layer stack, each chunk a box of its layer's tensor (or, `blocks` given, a flat range of one: 0.15's
        reformulated states). Returns their names."""
        catalog, chunks = self.catalog, self.chunks
        dtype = dtype_of(entry, self.meta_path, key)
        stored = _size(entry)
        shape = stored if blocks is None else blocks.shape
        prefix = self._layer_prefix(model_key)
        stacked = prefix is not None and len(shape) >= 1
        rules = param_order.load()
        # an expert stack: (layers, experts, ...), one logical tensor per layer and expert
        experts = stacked and prefix is not None and rules.is_expert_stack(model_key[len(prefix):]) and len(shape) >= 2
        axes = 2 if experts else 1 if stacked else 0
        logical: dict[tuple[int, ...], str]
        if experts:
            assert prefix is not None and rules.expert_prefix is not None
            own = model_key[len(prefix) + len(rules.expert_prefix):]
            logical = {(layer, e): f"{prefix}{layer}.{rules.expert_prefix}{e}.{own}"
                       for layer in range(shape[0]) for e in range(shape[1])}
            inner = shape[2:]
        elif stacked:
            assert prefix is not None
            rest = model_key[len(prefix):]
            logical = {(layer,): f"{prefix}{layer}.{rest}" for layer in range(shape[0])}
            inner = shape[1:]
        else:
            logical = {(): model_key}
            inner = shape
        drafts = {layer: catalog.add(TensorDraft(name, state, inner, dtype), self.meta_path)
                  for layer, name in logical.items()}
        if model_tensor:
            for index, name in logical.items():
                self.boxes[name] = []
                self.notes[name] = {"saved_as": key, **dict(zip(("layer", "expert"), index, strict=False))}
        for chunk in entry.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            sizes = tuple(int(s) for s in chunk.sizes)
            if len(offsets) != len(stored) or any(o < 0 or s < 0 or o + s > d
                                                  for o, s, d in zip(offsets, sizes, stored, strict=False)):
                catalog.problem(self.meta_path, f"{key}: chunk at {offsets} of size {sizes} lies outside the "
                                f"tensor's shape {stored}")
                continue
            if not math.prod(sizes):
                continue
            if blocks is not None and experts:
                catalog.problem(self.meta_path, f"{key}: experts stored block-wise flattened (0.15) are not read")
                continue
            if blocks is not None:
                self._add_flat_chunk(key, dtype, blocks, offsets, sizes, drafts, stacked)
                continue
            if any(n != 1 for n in sizes[:axes]):
                catalog.problem(self.meta_path, f"{key}: a chunk spans {sizes[:axes]} layers (and experts) at "
                                f"{offsets}; a layer stack is saved one layer (and expert) per chunk")
                continue
            layer = offsets[:axes]
            at, size = offsets[axes:], sizes[axes:]
            if model_tensor:        # (from .metadata: where the chunks lie, readable or not)
                self.boxes[logical[layer]].append((at, size))
            ref = chunks.chunk(key, dtype, offsets, sizes)
            if ref is None:
                continue
            shard = None if size == inner else Shard.box(at, size)
            drafts[layer].fragments.append(Fragment(0, math.prod(size), ref.storage, ref.storage_offset,
                                                    rank_of(ref.storage.file), shard))
        return list(logical.values())

    def _reformulated(self, key: str, stored: tuple[int, ...]):
        """megatron-core 0.15 (`fully_sharded_model_space`) saves a state whose dp ranks hold flat ranges of their
        tensor-parallel blocks reformulated: a tensor of global shape G cut into b_k blocks along each dim k is
        stored as (b_0, ..., b_{n-1}, block numel), each block flattened row-major (`mcore_data` records G as
        `nd_reformulated_orig_global_shape`). Its Blocks, None for a tensor stored as it is, or _UNREADABLE (a
        problem noted) where the two shapes do not fit."""
        extra = getattr(self.meta, "mcore_data", None)
        record = extra.get(key) if isinstance(extra, dict) else None
        original = record.get("nd_reformulated_orig_global_shape") if isinstance(record, dict) else None
        if original is None:
            return None
        if not isinstance(original, (tuple, list)) or not all(type(d) is int and d > 0 for d in original):
            self.catalog.problem(self.meta_path, f"{key}: nd_reformulated_orig_global_shape {original!r} is not a "
                                 "shape")
            return _UNREADABLE
        shape, counts = tuple(original), stored[:-1]
        if len(counts) != len(shape) or any(c < 1 or d % c for d, c in zip(shape, counts, strict=False)) or \
                math.prod(d // c for d, c in zip(shape, counts, strict=False)) != stored[-1]:
            self.catalog.problem(self.meta_path, f"{key}: stored as {list(stored)}, which is no block-wise "
                                 f"flattening of its global shape {list(shape)}")
            return _UNREADABLE
        self.flattened = True
        return FlatBlocks(shape, tuple(d // c for d, c in zip(shape, counts, strict=True)))

    def _add_flat_chunk(self, key: str, dtype: str, blocks: FlatBlocks, offsets: tuple, sizes: tuple,
                        drafts: dict, stacked: bool) -> None:
        """One chunk of a reformulated state (see _reformulated): a flat range of one block, at (block index...,
        flat start) with sizes (1, ..., 1, length)."""
        if any(s != 1 for s in sizes[:-1]):
            self.catalog.problem(self.meta_path, f"{key}: a chunk at {offsets} of size {sizes} spans blocks")
            return
        ref = self.chunks.chunk(key, dtype, offsets, sizes)
        if ref is None:
            return
        at = tuple(i * b for i, b in zip(offsets[:-1], blocks.block, strict=True))
        layer, at, block = ((at[0],), at[1:], blocks.block[1:]) if stacked else ((), at, blocks.block)
        if stacked and blocks.block[0] != 1:
            self.catalog.problem(self.meta_path, f"{key}: a block spans {blocks.block[0]} layers; a layer stack is "
                                 "saved one layer per block")
            return
        whole = block == (blocks.shape[1:] if stacked else blocks.shape)
        start = offsets[-1]
        drafts[layer].fragments.append(Fragment(start, start + sizes[-1], ref.storage, ref.storage_offset,
                                                rank_of(ref.storage.file), None if whole else Shard.box(at, block)))

    def _layer_prefix(self, key: str) -> str | None:
        """The layer stack `key` belongs to ("decoder.layers."), or None: megatron-core saves a TransformerBlock's
        layers stacked, a leading axis numbering them."""
        return next((prefix for prefix in LAYER_STACKS if key.startswith(prefix)), None)

    # -- the distributed optimizer's buckets (dp_reshardable)

    def _local_shard(self, name: str, tp_rank: int) -> tuple[Shard, int] | None:
        """(the shard of `name` tensor-parallel rank `tp_rank` holds, its elements): the model's chunks of it along
        the one axis they cut, every tp-th from the rank's (Megatron's SwiGLU fc1 holds its gate and up halves so),
        in that order; a tensor saved as one chunk is whole on every rank. None: the chunks do not say."""
        full = self.catalog.tensors[TensorKey(name, MODULE)].shape
        boxes = sorted(self.boxes[name])
        if len(boxes) == 1 and tuple(boxes[0][1]) == tuple(full):
            return Shard.whole(full), math.prod(full)
        axes = {d for d in range(len(full)) if len({b[0][d] for b in boxes}) > 1}
        if len(axes) != 1 or len(boxes) % self.tp:
            return None
        axis = axes.pop()
        mine = sorted(boxes, key=lambda b: b[0][axis])[tp_rank::self.tp]
        blocks, local = [], 0
        for at, size in mine:
            blocks.append(Block(tuple(at), tuple(local if d == axis else 0 for d in range(len(full))), tuple(size)))
            local += size[axis]
        shape = tuple(local if d == axis else n for d, n in enumerate(full))
        return Shard(shape, tuple(blocks)), math.prod(shape)

    def _buckets(self, distributed: Mapping[str, Any], names: list[str]) -> set[str]:
        """Fragments of every param's fp32 copy and moments from the dp_reshardable buckets; the names they cover."""
        rules = param_order.load()
        impl = self.args.get("transformer_impl", "local")
        if impl not in rules.transformer_impl:
            raise CheckpointError(self.common_path, f"transformer_impl {impl!r}: the distributed optimizer's "
                                  f"bucket layout is known for {', '.join(rules.transformer_impl)} only "
                                  f"({rules.path})")
        for key in ("virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers"):
            if self.args.get(key):
                raise CheckpointError(self.common_path, f"args.{key} = {self.args[key]}: uneven or virtual "
                                      "pipeline stages are not read yet in dp_reshardable saves")
        by_optimizer: dict[str, dict[int, dict[tuple, dict[str, tuple[str, Any]]]]] = {}
        for key, entry in distributed.items():
            found = BUCKET.match(key)
            assert found is not None
            chained, group, gbuf, dtypes, bucket, state = found.groups()
            pair = tuple(d.strip() for d in dtypes.strip("()").split(","))
            if len(pair) != 2:
                raise CheckpointError(self.meta_path, f"{key}: {dtypes} names no (param dtype, grad dtype)")
            self.grad_buffers.add((pair[0], pair[1]))
            if state not in STATES:
                self.catalog.problem(self.meta_path, f"{key}: an optimizer state reshard does not know")
                continue
            by_optimizer.setdefault(chained or "", {}).setdefault(int(group), {}).setdefault(
                (int(gbuf), dtypes, int(bucket)), {})[state] = (key, entry)
        experts = [n for n in names if rules.expert_of(n) is not None]
        dense = [n for n in names if rules.expert_of(n) is None]
        if self._degree("expert_model_parallel_size") == 1:     # (at ep=1 experts are dense params to megatron-core)
            experts, dense = [], names
        # megatron-core chains the dense params' distributed optimizer and the experts' (chained_0., chained_1.)
        expected = ["chained_0.", "chained_1."] if experts else [""]
        if sorted(by_optimizer) != expected:
            raise CheckpointError(self.meta_path, f"dp_reshardable buckets of optimizers {sorted(by_optimizer)}, "
                                  f"expected {expected} for a model {'with' if experts else 'without'} experts")
        groups = {g: (g % self.tp, g // self.tp) for g in range(self.tp * self.pp)}
        covered = self._optimizer_buckets(expected[0], by_optimizer[expected[0]], rules.ordered(dense), groups,
                                          self.dp, frozenset(rules.shared_embedding) if (self.pp > 1 and not
                                          self.args.get("untie_embeddings_and_output_weights", True)) else
                                          frozenset())
        if experts:
            ep = self._degree("expert_model_parallel_size")
            if self.tp > 1 or self.pp > 1 or self.args.get("overlap_grad_reduce") or \
                    self._degree("expert_tensor_parallel_size", self.tp) != self.tp or self.dp % ep:
                raise CheckpointError(self.common_path, "the experts' dp_reshardable buckets are read at tp=1, pp=1 "
                                      f"without overlapped grad reduction only (tp={self.tp}, pp={self.pp}, "
                                      f"dp={self.dp}, ep={ep})")
            # one model-parallel group per expert-parallel rank (its experts' grad buffer), over dp/ep ranks
            held = self._expert_ranks(rules.ordered(experts), ep)
            covered |= self._optimizer_buckets(expected[1], by_optimizer[expected[1]], [], {r: (0, 0) for r in
                                               range(ep)}, self.dp // ep, frozenset(), held)
        return covered

    def _expert_ranks(self, ordered: list[str], ep: int) -> dict[int, list[str]]:
        """{expert-parallel rank: its experts' params in registration order}: rank r holds experts
        [r·E/ep, (r+1)·E/ep) of every layer."""
        rules = param_order.load()
        counts: dict[int, int] = {}
        for name in ordered:
            found = rules.expert_of(name)
            assert found is not None
            counts[found[0]] = max(counts.get(found[0], 0), found[1] + 1)
        if any(n % ep for n in counts.values()):
            raise CheckpointError(self.common_path, f"experts per layer {sorted(set(counts.values()))} do not divide "
                                  f"among ep={ep} ranks")
        out: dict[int, list[str]] = {r: [] for r in range(ep)}
        for name in ordered:
            layer, expert, _ = rules.expert_of(name) or (0, 0, "")
            out[expert // (counts[layer] // ep)].append(name)
        return out

    def _optimizer_buckets(self, prefix: str, by_group: Mapping[int, Mapping[tuple, Any]], ordered: list[str],
                           groups: Mapping[int, tuple[int, int]], dp: int, shared: frozenset[str],
                           held: Mapping[int, list[str]] | None = None) -> set[str]:
        """Fragments from one distributed optimizer's buckets (keys under `prefix`): per model-parallel group (its
        (tp rank, pp rank) in `groups`) the params it holds (`held[group]`, else those of `ordered` on its stage)
        laid out over `dp` ranks, checked against the stored counts. The names covered."""
        rules = param_order.load()
        layers = self.args.get("num_layers")
        if sorted(by_group) != sorted(groups):
            raise CheckpointError(self.meta_path, f"{prefix}dp_reshardable buckets of model-parallel groups "
                                  f"{sorted(by_group)}, expected 0..{len(groups) - 1} (tp={self.tp}, pp={self.pp})")
        covered: set[str] = set()
        for group, saved in sorted(by_group.items()):
            tp_rank, pp_rank = groups[group]
            params = []
            shards = {}
            for name in (held[group] if held is not None else ordered):
                if held is None and self.pp > 1 and not rules.on_stage(name, pp_rank, self.pp, int(layers or 0)):
                    continue
                local = self._local_shard(name, tp_rank)
                if local is None:
                    raise CheckpointError(self.meta_path, f"{name}: its chunks do not say which part tensor-parallel"
                                          f" rank {tp_rank} holds, so the optimizer's buckets cannot be mapped")
                shards[name] = local[0]
                params.append((name, local[1]))
            laid = buckets.lay_out(params, dp, buckets.bucket_size(self.args, pp_rank, dp),
                                   shared & {n for n, _ in params},
                                   bool(self.args.get("ddp_pad_buckets_for_high_nccl_busbw")))
            self._check_counts(prefix, group, saved, laid, dp)
            for (_, _, k), states in sorted(saved.items()):
                for state, (key, entry) in states.items():
                    self._bucket_fragments(key, entry, laid[k], shards, STATES[state], tp_rank, group, dp,
                                           held is not None)
            covered |= set(shards)
        return covered

    def _check_counts(self, prefix: str, group: int, saved: Mapping[tuple, Any], laid: list[buckets.Bucket],
                      dp: int) -> None:
        """The stored per_bucket_numel(_unpadded) of group `group` against the recomputed buckets: refused where they
        differ (the parameters would be mapped to the wrong elements)."""
        recomputed = {"per_bucket_numel": [b.numel for b in laid],
                      "per_bucket_numel_unpadded": [b.numel_unpadded for b in laid]}
        for what, expected in recomputed.items():
            key = next((k for k in self.chunks.by_fqn if k.startswith(PER_BUCKET.format(prefix, group, what) + "/")),
                       None)
            if key is None:
                raise CheckpointError(self.meta_path, f"{PER_BUCKET.format(prefix, group, what)} is missing: the "
                                      "dp_reshardable buckets cannot be checked")
            value = self.chunks.value(key)
            path = self.chunks.path_of(key)
            if value is MISSING:      # its file's problem is noted; the saved chunk cuts still check the layout
                continue
            stored = _bucket_counts(value)
            if stored is None:
                raise CheckpointError(path or self.meta_path, f"{key} holds {value!r:.80}, not per-buffer lists of "
                                      "bucket sizes")
            if len(stored) != 1 or stored[0] != expected:
                raise CheckpointError(path or self.meta_path, f"dp_reshardable {prefix}{what} of model-parallel group "
                                      f"{group} is {stored}, recomputed {[expected]} from the parameters "
                                      f"(dp={dp}): the buckets cannot be mapped to parameters")
        if len(saved) != len(laid) or sorted(k for _, _, k in saved) != list(range(len(laid))):
            raise CheckpointError(self.meta_path, f"model-parallel group {group} saves buckets "
                                  f"{sorted(k for _, _, k in saved)}, recomputed {len(laid)}")

    def _bucket_fragments(self, key: str, entry, bucket: buckets.Bucket, shards: Mapping[str, Shard], state: str,
                          tp_rank: int, group: int, dp: int, experts: bool = False) -> None:
        dtype = dtype_of(entry, self.meta_path, key)
        if tuple(entry.size) != (bucket.numel_unpadded,):
            raise CheckpointError(self.meta_path, f"{key}: {list(entry.size)} elements saved, the recomputed bucket "
                                  f"holds {bucket.numel_unpadded}")
        expected = bucket.chunks(dp)
        saved = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in entry.chunks)
        if saved != [(start, size) for start, size, _ in expected]:
            raise CheckpointError(self.meta_path, f"{key}: saved in chunks {saved[:4]}..., the recomputed layout cuts "
                                  f"it at {[(s, n) for s, n, _ in expected][:4]}...: the buckets cannot be mapped")
        starts = {p.name: p.start for p in bucket.params}
        for start, size, name in expected:
            if name is None:
                continue
            ref = self.chunks.chunk(key, dtype, (start,), (size,))
            if ref is None:
                continue
            shard = shards[name]
            full = self.catalog.tensors[TensorKey(name, MODULE)].shape
            first = start - starts[name]
            whole = shard.blocks == Shard.whole(full).blocks and shard.shape == tuple(full)
            fragment = Fragment(first, first + size, ref.storage, ref.storage_offset, rank_of(ref.storage.file),
                                None if whole else shard)
            replicated = whole and self.tp > 1 and not experts
            if replicated and tp_rank != 0:
                copy = LogicalTensor(name, state, tuple(full), dtype, (fragment,))
                self.catalog.replicas.append(Replica(copy, f"model-parallel group {group} (tensor-parallel rank "
                                                           f"{tp_rank})", "tensor-parallel rank 0"))
                continue
            draft = self.catalog.add(TensorDraft(name, state, tuple(full), dtype), self.meta_path)
            draft.fragments.append(fragment)

    # -- order, param groups

    def _ordered(self, names: list[str]) -> list[str]:
        try:
            return param_order.load().ordered(names)
        except ReshardError:
            return names

    def _param_groups(self) -> tuple[list[dict], int | None]:
        """The optimizer's param groups as saved (hyper-parameters), and its step."""
        optimizer = self.common.get("optimizer")
        inner = None
        if isinstance(optimizer, dict) and optimizer and all(type(k) is int for k in optimizer):
            # chained optimizers (a mixture of experts': the dense params' and the experts'): their groups joined
            chained = [optimizer[k].get("optimizer") if isinstance(optimizer[k], dict) else None
                       for k in sorted(optimizer)]
            if all(isinstance(c, dict) and isinstance(c.get("param_groups"), list) for c in chained):
                optimizer = {"param_groups": [g for c in chained if c is not None for g in c["param_groups"]]}
        if isinstance(optimizer, dict):
            inner = optimizer.get("optimizer", optimizer)
        if not (isinstance(inner, dict) and isinstance(inner.get("param_groups"), list)):
            found = self._distributed_object("optimizer")
            if isinstance(found, dict):
                inner = found.get("optimizer", found)
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            self.catalog.problem(self.common_path, "no optimizer param groups found")
            return [], None
        steps = {int(g["step"]) for g in groups if isinstance(g.get("step"), (int, float))}
        state = inner.get("state") if isinstance(inner, dict) else None
        common_step = state.get("common_step") if isinstance(state, dict) else None
        if isinstance(common_step, TensorRef) and common_step.numel == 1:    # the plain optimizer's one step
            steps.add(int(read_scalar(common_step)))
        elif isinstance(common_step, (int, float)):
            steps.add(int(common_step))
        plain = [{k: v for k, v in g.items() if k != "step"} for g in groups]
        return plain, (max(steps) if steps else None)

    def _distributed_object(self, what: str):
        """The first readable copy of what every model-parallel group saves alike (its optimizer's param groups); of
        chained optimizers (a mixture of experts': the dense params' and the experts') their param groups joined,
        in chain order, as megatron-core's ChainedOptimizer lists them."""
        chained = sorted({found.group(1) or "" for k in self.chunks.by_fqn if (found := BUCKET_OBJECT.match(k))},
                         key=lambda p: int(p[len("chained_"):-1]) if p else -1)
        found_values = []
        for prefix in chained or [""]:
            for group in range(self.tp * self.pp * (self._degree("expert_model_parallel_size") if prefix else 1)):
                key = next((k for k in self.chunks.by_fqn if k.startswith(PER_BUCKET.format(prefix, group, what)
                                                                            + "/")), None)
                value = self.chunks.value(key) if key is not None else MISSING
                if value is not MISSING:
                    found_values.append(_object(value))
                    break
            else:
                return None
        if len(found_values) == 1:
            return found_values[0]
        inners = [v.get("optimizer", v) if isinstance(v, dict) else None for v in found_values]
        if not all(isinstance(i, dict) and isinstance(i.get("param_groups"), list) for i in inners):
            return None
        return {"param_groups": [g for inner in inners if inner is not None for g in inner["param_groups"]]}

    def _group_of(self, ordered: list[str], groups: list[dict]) -> dict[str, int]:
        """Each param's group: the saved groups name no params, so megatron-core's default grouping (the rule file:
        which params take no weight decay) puts each in the group whose wd_mult is 0 or in the other one. A save
        with other groups (decoupled or scaled learning rates) leaves the params unassigned, a problem noted. Experts'
        params are grouped alike among the groups marked is_expert_parallel."""
        if not groups:
            return {}
        rules = param_order.load()
        out = {}
        # (at ep=1 megatron-core groups the experts' params with the dense ones: no group is_expert_parallel)
        chained = any(g.get("is_expert_parallel") for g in groups)
        for expert in (False, True):
            mine = [i for i, g in enumerate(groups) if bool(g.get("is_expert_parallel")) == (expert and chained)]
            no_wd = [i for i in mine if groups[i].get("wd_mult") == 0.0]
            wd = [i for i in mine if groups[i].get("wd_mult") not in (0.0, None)]
            if len(mine) > 2 or len(no_wd) > 1 or len(wd) > 1:
                self.catalog.problem(self.common_path, f"{len(groups)} optimizer param groups: which params each "
                                     "holds is known for megatron-core's default grouping (weight decay or not, "
                                     "experts or not) only")
                return {}
            for name in ordered:
                if (rules.expert_of(name) is not None) != expert:
                    continue
                shape = self.catalog.tensors[TensorKey(name, MODULE)].shape
                group = no_wd if rules.takes_no_weight_decay(name, shape) else wd
                out[name] = group[0] if group else (mine[0] if mine else 0)
        return out

    def _experts(self, ordered: list[str]) -> ExpertParallel | None:
        """The save's expert parallelism (None without experts): ep from its args, each layer's experts divided
        evenly among the expert-parallel ranks in order, as SequentialMLP places them."""
        rules = param_order.load()
        per_layer: dict[int, dict[int, list[str]]] = {}
        for name in ordered:
            found = rules.expert_of(name)
            if found is not None:
                per_layer.setdefault(found[0], {}).setdefault(found[1], []).append(name)
        if not per_layer:
            return None
        ep = self._degree("expert_model_parallel_size")
        layers = []
        for index, (layer, experts) in enumerate(sorted(per_layer.items())):
            count = len(experts)
            if sorted(experts) != list(range(count)) or count % ep:
                raise CheckpointError(self.meta_path, f"layer {layer} saves experts {sorted(experts)}, which do not "
                                      f"divide among ep={ep} ranks")
            per = count // ep
            layers.append(ExpertLayer(index, count, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep)),
                                      tuple(n for e in range(count) for n in experts[e])))
        return ExpertParallel(ep, max(1, self.dp * self.tp // ep), tuple(layers))


_last_read: tuple[tuple[str, int, int], md.Metadata] | None = None


def source_metadata(path: str) -> md.Metadata:
    """The DCP `.metadata` at `path`, through Megatron's allow-list. The last one read is kept, by path, size and
    modification time: a conversion reads it to open the source and again to copy the source's objects, and a
    large save's takes a while (18,000 entries: about 0.3 s)."""
    global _last_read
    stamp = (path, fs.getsize(path), fs.mtime_ns(path))
    if _last_read is None or _last_read[0] != stamp:
        _last_read = stamp, md.read(path, METADATA_ALLOWED)
    return _last_read[1]


def common_state(folder: str) -> tuple[dict, str]:
    """(the common state, where it is) of iteration folder `folder`, whichever layout keeps it: common.pt (0.15,
    0.16), the DCP object common_state (0.19), or a legacy save's first rank file (legacy.common_state). What a
    writer at another topology starts from: args, iteration, scheduler, counters, content_metadata."""
    if not fs.isfile(os.path.join(folder, CONFIG)) and legacy.is_legacy(folder):
        return legacy.common_state(folder)
    config = _config(os.path.join(folder, CONFIG))

    def chunks() -> Chunks:     # (only where there is no common.pt: a large save's .metadata takes a while to read)
        meta = source_metadata(os.path.join(folder, METADATA))
        return Chunks(folder, meta, CatalogBuilder(folder, FORMAT, Layout.of(1, 1, 1)))
    common, path, _ = _common(folder, config if isinstance(config, dict) else {}, chunks)
    return common, path


def _common(folder: str, config: dict, chunks_of: Callable[[], Chunks]) -> tuple[dict, str, str]:
    """(the common state, where it is, which layout holds it): common.pt beside the DCP files (0.16), or the
    DCP object `common_state` (0.19, whose metadata.json names no common backend) of the DCP checkpoint
    `chunks_of()` gives."""
    common_path = os.path.join(folder, COMMON)
    chunks = None if fs.isfile(common_path) else chunks_of()
    stored = None if chunks is None else next((k for k in chunks.by_fqn if k.split("/")[0] == COMMON_STATE), None)
    if chunks is None:
        common, layout = load_pickle(common_path, allowed=COMMON_ALLOWED), LAYOUT_016
    elif stored is not None and "common_backend" not in config:
        common_path, layout = f"{os.path.join(folder, METADATA)}:{stored}", LAYOUT_019
        common = _object(chunks.value(stored, allowed=COMMON_ALLOWED))
        if common is MISSING:
            raise CheckpointError(common_path, "cannot be read (its .distcp file is missing or short), and "
                                  "without it the save's topology is unknown")
    else:
        raise CheckpointError(common_path, "missing: every torch_dist save of megatron-core 0.16 writes it "
                              f"(0.19 writes the DCP object {COMMON_STATE} instead)")
    if not isinstance(common, dict):
        raise CheckpointError(common_path, f"holds a {type(common).__name__}, not the common state dict")
    return common, common_path, layout


@dataclass(frozen=True)
class FlatBlocks:
    """A 0.15 reformulated state: its global shape and the shape of each block stored flattened."""
    shape: tuple[int, ...]
    block: tuple[int, ...]


_UNREADABLE = object()


def _size(entry) -> tuple[int, ...]:
    """The global shape of a DCP tensor entry."""
    return tuple(int(d) for d in entry.size)


def _object(value):
    """The object a megatron ShardedObject saved (dist_checkpointing stores it in a one-element list)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _bucket_counts(value) -> list | None:
    """[[count per bucket] per grad buffer] of a saved per_bucket_numel: a list of {(dtypes): [counts]}."""
    value = _object(value)
    if not isinstance(value, list):
        return None
    out = []
    for entry in value:
        if not isinstance(entry, dict) or len(entry) != 1:
            return None
        counts = next(iter(entry.values()))
        if not isinstance(counts, list) or not all(type(c) is int for c in counts):
            return None
        out.append(counts)
    return out


__all__ = ["FORMAT", "OPTIONS", "sniff", "read", "common_state", "DType", "TensorRef"]
