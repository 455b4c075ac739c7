"""Catalog x target Layout -> a Megatron-LM save dir as megatron-core 0.16 writes it in the torch_dist format, at any
tp, pp and dp, that `dist_checkpointing.load` reads at the target topology.

    <out>/latest_checkpointed_iteration.txt     the iteration (written last)
    <out>/iter_NNNNNNN/metadata.json            {"sharded_backend": "torch_dist", ...}
                       common.pt                the source's common state: args with the target's degrees, the
                                                optimizer's param groups and step as the target's sharding keeps
                                                them, content_metadata naming that sharding
                       __R_0.distcp, .metadata  a DCP checkpoint: rank R = tp_rank + tp·(dp_rank + dp·pp_rank) writes
                                                what it holds (data-parallel rank 0 the model's chunks)

Every tensor is written as Megatron's sharded state dict names it: a layer stack under its stacked key with a leading
layer axis (global layer numbers), one chunk per (layer, tensor-parallel box: tp_boxes, from the rule file's
`tensor_parallel`); the optimizer state model-shaped (plain: optimizer.state.fp32_param.*, fully_reshardable:
optimizer.state.param.*) or, dp_reshardable, in flat per-bucket buffers laid out for the target's tp, pp and dp by
buckets.lay_out (the layout the reader checks against real saves), each data-parallel rank's part a chunk.

A Megatron source has the common state Megatron needs (args, scheduler); a source of another format (a DeepSpeed
checkpoint of megatron-core's GPTModel, under torch_dist's names by `--names megatron-core-modules` undone) gets it
from the user's Megatron-LM arguments, `--to ...,args=FILE` (run_args: checked against its tensors, the param groups
megatron-core's defaults), and is refused without them; its layers' extra states are the local spec's empty ones.
Any layout the reader reads is a source (0.15, 0.16, 0.19 torch_dist, the legacy torch format): its common state comes
from reader.common_state. Objects a torch_dist source saved that do not depend on the topology (layers'
`_extra_state`) are copied as their bytes lie; a legacy source's extra-state values are written as torch_dist's
objects (legacy.extra_states). The RNG state is copied where tp and pp are kept and the source is torch_dist, and
otherwise left out, with `args.no_save_rng` set, as Megatron-LM itself ignores the RNG state on a change of tp or pp.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.core.catalog import MASTER, MODULE, Catalog, CatalogBuilder, TensorKey
from reshard.core.layout import Layout
from reshard.core.placement import Shard
from reshard.core.write_requests import Output, Piece, TextFile
from reshard.errors import CheckpointError, ReshardError, UsageError
from reshard.formats.dcp import metadata as md
from reshard.formats.dcp.chunks import METADATA, MISSING, Chunks
from reshard.formats.dcp.writer import DistcpFileBuilder, MetadataBuilder
from reshard.formats.megatron import buckets, legacy, model_args, order as param_order, run_args, run_config, tp_boxes
from reshard.formats.megatron.pickles import Namespace
from reshard.formats.megatron.reader import (
    BUCKET,
    COMMON,
    CONFIG,
    ITERATION,
    RELEASE,
    TRACKER,
    common_state,
    source_metadata,
)
from reshard.formats.megatron.topology import (
    DP_RESHARDABLE,
    FULLY_RESHARDABLE,
    PLAIN,
    WEIGHTS_ONLY,
    MegatronNotes,
    MegatronTopology,
)
from reshard.formats.torchsave_read import DType
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder
from reshard.rules.export_names import ModelFacts

FORMAT = "megatron"
PLACES_EXPERTS = True      # a mixture of experts' save, at any ep dividing dp and the experts (tp=1, pp=1)
RESUMED_BY_FRAMEWORKS = False
SAVES_OWN_NAMES = True    # torch_dist keys: megatron-core-modules undone
OWN_RANK_STATE = False

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
# the model-shaped optimizer states' key prefixes, by sharding
STATE_PREFIX = {PLAIN: {MASTER: "optimizer.state.fp32_param.", "exp_avg": "optimizer.state.exp_avg.",
                        "exp_avg_sq": "optimizer.state.exp_avg_sq."},
                FULLY_RESHARDABLE: {MASTER: "optimizer.state.param.", "exp_avg": "optimizer.state.exp_avg.",
                                    "exp_avg_sq": "optimizer.state.exp_avg_sq."}}
BUCKET_STATES = {"param": MASTER, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
GROUP = "optimizer.distributed.dp_group_idx_{}"
EXTRA_STATE = re.compile(r".*\._extra_state/shard_(\d+)_(\d+)$")
EXPERT_EXTRA_STATE = re.compile(r".*\._extra_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")   # (layer, expert of each)
# with experts megatron-core chains two distributed optimizers: the dense params' and the experts'
DENSE_CHAIN, EXPERT_CHAIN = "chained_0.", "chained_1."
RNG = "rng_state/shard_{}.{}_{}.{}"
# what Megatron-LM's save (_build_sharded_state_dict_metadata) records in content_metadata beside the optimizer's
# sharding, as every torch_dist fixture (0.15, 0.16, 0.19) holds it: for a legacy source, which records none
SAVE_CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


@dataclass(frozen=True)
class Grid:
    """The target's degrees and Megatron's rank order (tp fastest, then dp, then pp)."""
    tp: int
    pp: int
    dp: int

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def group(self, tp_rank: int, pp_rank: int) -> int:
        """The distributed optimizer's dp_group_idx of a model-parallel rank."""
        return tp_rank + self.tp * pp_rank


@dataclass(frozen=True)
class Param:
    """A parameter as the target saves it: its logical name, stacked key and layer (None outside a stack), its
    shape there and as the source saved it (another where the target pads the vocabulary otherwise)."""
    name: str
    key: str
    layer: int | None
    shape: tuple[int, ...]
    saved: tuple[int, ...]
    cut: param_order.TpCut | None
    parts: int
    expert: int | None = None     # an expert's param: its global expert number (saved on an expert axis)

    def pieces(self, state: str, shard: Shard, start: int, count: int) -> list[Piece]:
        """Elements [start, start + count) of `shard` (a shard of the target's tensor) of `state`, from the
        source's."""
        if self.saved != self.shape:
            return run_config.repadded_pieces((self.name, state), self.saved, shard, start, count)
        return [Piece(count, (self.name, state), start, shard=None if shard == Shard.whole(self.shape) else shard)]


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    return _Writer(catalog, target, tag).files()


def output_tag(catalog: Catalog, tag: str) -> str:
    """A source of another format (a DeepSpeed tag global_step3) is written in Megatron's folder of its step
    (iter_0000003) where it records one."""
    step = catalog.training.global_steps
    if catalog.format == FORMAT or ITERATION.match(tag) or tag == RELEASE:
        return tag
    if step is None:    # a model alone (no step, no optimizer state): the folder a fine-tune starts from
        return RELEASE if not catalog.layout.master_dtype else tag
    return f"iter_{step:07d}"


def describe(target: Layout, tag: str) -> Output:
    return Output(FORMAT, target.topology(), tag)


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    if target.dp == catalog.layout.dp:
        return None
    return (f"Megatron-LM keeps --global-batch-size: at dp={target.dp} each step runs global / (micro-batch size x "
            f"{target.dp}) micro-batches per rank (it must divide evenly)")


class _Writer:
    def __init__(self, catalog: Catalog, target: Layout, tag: str):
        topology = target.format_topology
        given = topology.run_args if isinstance(topology, MegatronTopology) else None
        self.foreign = catalog.format != FORMAT     # a source without Megatron's common state: args=FILE gives it
        # a model without optimizer state whose hyperparameters are known (a Hugging Face model imported with an
        # export-names file read backwards): its args derived from them, args=FILE overriding
        self.model = self.foreign and isinstance(catalog.notes, ModelFacts) and not catalog.layout.master_dtype
        if self.foreign and given is None and not self.model:
            alone = "" if catalog.layout.master_dtype else \
                "; a model alone takes them from its config.json with --names megatron-core-llama (export names " \
                "read backwards)"
            raise UsageError.at(catalog.root, "Megatron output needs Megatron's common state (args, scheduler), which "
                                f"a {catalog.format} checkpoint does not hold: give the run's Megatron-LM arguments, "
                                f"--to ...,args=FILE (docs/formats/megatron.md){alone}")
        if not self.foreign and given is not None:
            raise UsageError(f"--to args={given}: a Megatron source has its own arguments (args= is for a source "
                             "that holds none)")
        if tag != RELEASE and not ITERATION.match(tag):
            raise UsageError(f"--tag-out {tag!r}: Megatron-LM loads iteration folders named iter_NNNNNNN (or release)")
        self.sharding = topology.sharding if isinstance(topology, MegatronTopology) else DP_RESHARDABLE
        self.given_vocab = topology.vocab if isinstance(topology, MegatronTopology) else None
        self.catalog, self.tag = catalog, tag
        self.grid = Grid(target.tp, target.pp, target.dp)
        self.source = catalog.layout
        own = self.source.format_topology
        self.legacy = isinstance(own, MegatronTopology) and own.backend != "torch_dist"
        self.rules = param_order.load()
        # the parameters (a DeepSpeed module state dict's order also names its layers' extra states)
        self.names = [n for n in catalog.order if n in catalog.params] if self.foreign else list(catalog.order)
        if self.model:
            self.common, self.args, self.groups = self._model_state(given)
        elif given is not None:
            self.common, self.args, self.groups = self._given_state(given)
        else:
            self.common, self.args, self.groups = self._source_state()
        self._check()
        # where a torch_dist source keeps its objects (a legacy save keeps them in its rank files; another format,
        # none but its layers' empty extra states)
        self.source_meta = None if self.legacy or self.foreign else \
            source_metadata(os.path.join(catalog.root, METADATA))
        self.source_chunks: Chunks | None = None     # where the source's objects lie, when one is copied
        self.files_by_rank: dict[int, DistcpFileBuilder] = {}
        self.meta = MetadataBuilder(planner=False)
        self.params = self._params()
        self.by_name = {p.name: p for p in self.params}
        self.ep, self.experts = self._experts(target)

    # -- the common state: the source's, or the user's arguments (args=FILE) for a source of another format

    def _source_state(self) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
        """(common state, args, param groups less their params) of a Megatron source."""
        common, common_path = common_state(self.catalog.root)
        args = common.get("args")
        if not isinstance(args, Namespace):
            raise CheckpointError(common_path, "holds no args namespace to write at the target")
        return common, dict(vars(args)), [{k: v for k, v in g.items() if k != "params"}
                                          for g in self.catalog.param_groups]

    def _given_state(self, path: str) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
        """The same from the arguments file at `path`, checked against the source (run_args.load); the output's
        iteration folder must be the run's."""
        self._refuse_unplaced()
        run = run_args.load(path, self.catalog, self.rules)
        if ITERATION.match(self.tag) and int(self.tag[len("iter_"):]) != run.iteration:
            raise UsageError(f"--tag-out {self.tag}: the run's iteration is {run.iteration}")
        common = {"checkpoint_version": run_args.CHECKPOINT_VERSION, "iteration": run.iteration,
                  "opt_param_scheduler": dict(run.scheduler)}
        return common, dict(run.args), [dict(g) for g in run.param_groups]

    def _model_state(self, path: str | None) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
        """The same for a model alone (model_args: derived from its hyperparameters, the file at `path` over them):
        written without optimizer state, as the iteration a fine-tune starts from."""
        self._refuse_unplaced()
        if self.sharding != WEIGHTS_ONLY:
            raise ReshardError.at(self.catalog.root, f"sharding={self.sharding}: a model without optimizer state is "
                                  "written alone (sharding=none)")
        assert isinstance(self.catalog.notes, ModelFacts)
        args = model_args.derive(self.catalog.notes.hyperparameters(), self.catalog, self.rules, path)
        return {"checkpoint_version": run_args.CHECKPOINT_VERSION, "iteration": 0}, args, []

    # -- what the target can be

    def _refuse_unplaced(self) -> None:
        """A source of another format under names that are not torch_dist's keys (a DeepSpeed save holds the
        module's own: a layer's input_layernorm) is refused, naming the rule file that brings them back."""
        for name in self.names:
            if not self.rules.places(name):
                raise ReshardError.at(self.catalog.root, f"{name}: not a parameter of megatron-core's torch_dist "
                                      f"save ({self.rules.path}); a {self.catalog.format} checkpoint of its GPTModel "
                                      "holds the modules' own names: --names megatron-core-modules brings them "
                                      "back")

    def _check(self) -> None:
        args, grid = self.args, self.grid
        impl = args.get("transformer_impl", "local")
        if impl not in self.rules.transformer_impl:
            raise ReshardError.at(self.rules.path, f"transformer_impl {impl!r}: how its parameters are cut and "
                                  f"laid out is known for {', '.join(self.rules.transformer_impl)} only")
        for key in ("virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers"):
            if args.get(key):
                raise ReshardError.at(self.catalog.root, f"args.{key} = {args[key]}: uneven or virtual pipeline "
                                      "stages are not written yet")
        layers = args.get("num_layers")
        if not isinstance(layers, int) or layers % grid.pp:
            raise ReshardError(f"target pp={grid.pp}: {layers} layers do not split into equal pipeline stages")
        for key in ("num_query_groups", "num_attention_heads"):
            count = args.get(key)
            if isinstance(count, int) and count % grid.tp:
                raise ReshardError(f"target tp={grid.tp}: args.{key} = {count} is not a multiple of it")
        self.vocab = self._vocabulary()
        # (the model alone holds the tied embedding once: the last stage's output layer loads it as a replica)
        if grid.pp > 1 and not args.get("untie_embeddings_and_output_weights", True) and \
                self.sharding != WEIGHTS_ONLY:
            raise ReshardError("a tied embedding at pp > 1 (the last stage's copy, a bucket of its own) is not "
                               "written yet")
        dtypes = {self.catalog.tensors[TensorKey(n, MODULE)].dtype for n in self.names}
        if len(dtypes) != 1:
            raise ReshardError(f"parameters of several dtypes ({', '.join(sorted(dtypes))}): megatron-core keeps a "
                               "grad buffer per dtype, not written yet")
        self.model_dtype = dtypes.pop()
        states = {TensorKey(n, s) in self.catalog.tensors for n in self.names
                  for s in (MASTER, "exp_avg", "exp_avg_sq")}
        if states != {True} and self.sharding != WEIGHTS_ONLY:
            raise ReshardError.at(self.catalog.root, "Megatron's optimizer state needs every parameter's fp32 master "
                                  "and both Adam moments; this checkpoint lacks some")

    def _vocabulary(self) -> run_config.Vocabulary | None:
        """The rows of the vocabulary-sized params (the rule file's padded_vocabulary) at the target, as Megatron-LM
        pads its tokenizer's vocabulary there (run_config.vocabulary); None for a model without them."""
        saved = {self.catalog.tensors[TensorKey(n, MODULE)].shape[0] for n in self.names if n in self.rules.vocabulary}
        if not saved:
            return None
        if len(saved) != 1:
            raise ReshardError.at(self.catalog.root, f"vocabulary-sized params of {sorted(saved)} rows: one "
                                  "padded vocabulary was expected")
        return run_config.vocabulary(self.args, saved.pop(), self.source.tp, self.grid.tp, self.given_vocab,
                                     self.catalog.root)

    def _params(self) -> list[Param]:
        notes = self.catalog.notes
        out = []
        for name in self.rules.ordered(self.names):
            detail = notes.param_details(name) if notes is not None else {}
            key, layer = detail.get("saved_as"), detail.get("layer")
            where = self.rules.layer_of(name)
            if key is None and where is not None:     # (a legacy save or a model alone: stacked by the rules)
                key, layer = self.rules.stacked_key(name), where[0]
            key = key or name
            saved = tuple(self.catalog.tensors[TensorKey(name, MODULE)].shape)
            shape = (self.vocab.rows, *saved[1:]) if self.vocab and name in self.rules.vocabulary else saved
            cut = self.rules.tp_cut(name)
            parts = 1
            if cut is not None:
                parts = cut.parts if cut.parts_when is None or self.args.get(cut.parts_when) else 1
            own = self.rules.expert_of(name)
            expert = None if own is None else detail.get("expert", own[1] if self.model else None)
            param = Param(name, key, layer, shape, saved, cut, parts, expert)
            self._check_cut(param)
            out.append(param)
        return out

    def _check_cut(self, param: Param) -> None:
        """The rule file's cut of `param` at the source's tp must be the boxes the source saved: a model the rules do
        not describe is refused, not written with its tensors cut wrongly."""
        tp = self.source.tp
        if tp == 1:     # (no tensor parallelism: its boxes are how its files hold it, a fused QKV's q, k, v parts)
            return
        ruled = {(tuple(at), tuple(size)) for rank in range(tp)
                 for at, size in tp_boxes.rank_boxes(param.name, param.saved, param.cut, param.parts, tp, rank)}
        saved = set()
        for fragment in self.catalog.tensors[TensorKey(param.name, MODULE)].fragments:
            shard = fragment.shard or Shard.whole(param.saved)
            saved |= {(tuple(b.at), tuple(b.shape)) for b in shard.blocks}
        whole = {((0,) * len(param.saved), param.saved)}
        # (a tensor saved whole says nothing of its cut, nor does a catalog of shapes alone: bench_megatron_sparse)
        if saved and ruled != saved and saved != whole:
            raise ReshardError.at(self.rules.path, f"{param.name}: the source saved it in boxes "
                                  f"{sorted(saved)[:2]}..., this rule file cuts it at tp={tp} into "
                                  f"{sorted(ruled)[:2]}...: its tensor-parallel layout is not the one described")

    def _experts(self, target: Layout) -> tuple[int, int]:
        """(the target's expert-parallel degree, experts per layer), (1, 0) without experts: checked against what
        is written (tp=1, pp=1; ep dividing dp and the experts; the distributed optimizer)."""
        experts = self.catalog.experts
        topology = target.format_topology
        asked = topology.ep if isinstance(topology, MegatronTopology) else None
        if self.model and any(p.expert is not None for p in self.params):
            # a model alone (its args from its config): each layer's experts as args.num_experts says
            counts, saved_ep = [int(self.args["num_experts"])] * int(self.args["num_layers"]), 1
        elif experts is None:
            if asked not in (None, 1):
                raise ReshardError(f"ep={asked}: this save has no experts")
            return 1, 0
        else:
            counts, saved_ep = [layer.num_experts for layer in experts.layers], experts.ep
        ep = asked or saved_ep
        count = counts[0] if len(set(counts)) == 1 else 0
        if not count or count % ep or self.grid.dp % ep:
            hint = f" (experts are parallel within the data-parallel ranks: give dp, e.g. dp={ep})" \
                if count and not count % ep else ""
            raise ReshardError(f"ep={ep} must divide dp={self.grid.dp} and each layer's experts "
                               f"({', '.join(str(c) for c in counts)}){hint}")
        if self.args.get("overlap_grad_reduce"):
            raise ReshardError.at(self.catalog.root, "overlapped grad reduction: the experts' bucket sizes are not "
                                  "written yet")
        # (the model alone is written at any tp and pp: its experts cut as their expert-tensor-parallel ranks hold
        # them, expert_tensor_parallel_size being tp, megatron-core's default)
        if self.sharding != WEIGHTS_ONLY and ((self.grid.tp, self.grid.pp) != (1, 1) or self.sharding == PLAIN):
            raise ReshardError("a mixture of experts is written at tp=1, pp=1 with the distributed optimizer only "
                               f"(asked: tp={self.grid.tp}, pp={self.grid.pp}, sharding={self.sharding})")
        if any(p.expert is None for p in self.params if self.rules.expert_of(p.name) is not None):
            raise ReshardError.at(self.catalog.root, "its experts' params do not say which expert they are")
        return ep, count

    def _expert_rank(self, expert: int, edp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> int:
        """The rank holding `expert` at expert-data-parallel rank `edp_rank`, tensor-parallel rank `tp_rank` and stage
        `pp_rank` (megatron-core's expert grid: tp fastest, then ep, then expert dp, then pp; the expert-parallel
        rank runs fastest within the data-parallel ranks)."""
        return self.grid.rank(tp_rank, expert // (self.experts // self.ep) + self.ep * edp_rank, pp_rank)

    # -- files

    def _file(self, rank: int) -> DistcpFileBuilder:
        if rank not in self.files_by_rank:
            self.files_by_rank[rank] = DistcpFileBuilder(f"{self.tag}/__{rank}_0.distcp")
        return self.files_by_rank[rank]

    def _chunk(self, rank: int, key: str, global_shape: tuple, dtype: str, offsets: tuple, sizes: tuple,
               pieces: list) -> None:
        file = self._file(rank)
        offset, length = file.add_chunk(dtype, sizes, pieces)
        self.meta.chunk(key, None, global_shape, dtype, offsets, sizes, os.path.basename(file.path), offset, length)

    def _value(self, rank: int, key: str, value: object) -> None:
        file = self._file(rank)
        offset, length = file.add_value([value])     # dist_checkpointing saves a ShardedObject as [value]
        self.meta.blob(key, os.path.basename(file.path), offset, length)

    def _blob(self, rank: int, key: str) -> None:
        assert self.source_meta is not None
        if self.source_chunks is None:
            problems = CatalogBuilder(self.catalog.root, FORMAT, self.catalog.layout)
            self.source_chunks = Chunks(self.catalog.root, self.source_meta, problems)
        blob = self.source_chunks.blob(key)
        if blob is MISSING or not isinstance(blob, bytes):
            raise CheckpointError(os.path.join(self.catalog.root, METADATA), f"{key}: cannot be read to copy")
        file = self._file(rank)
        offset, length = file.add_blob(blob)
        self.meta.blob(key, os.path.basename(file.path), offset, length)

    def files(self) -> list:
        self._model_shaped({MODULE: ""})
        if self.sharding == WEIGHTS_ONLY:
            pass        # the model alone
        elif self.sharding in STATE_PREFIX:
            prefixes = STATE_PREFIX[self.sharding]
            if self.sharding == PLAIN and self.model_dtype == "float32":    # FP32Optimizer: the params are the masters
                prefixes = {k: v for k, v in prefixes.items() if k != MASTER}
            self._model_shaped(prefixes)
        else:
            self._buckets()
        self._objects()
        folder = self.tag
        common = self._common()
        iteration = 0 if self.tag == RELEASE else int(self.tag[len("iter_"):])
        tensor_files = [self.files_by_rank[r].build() for r in sorted(self.files_by_rank)]
        return [*tensor_files, common, TextFile(f"{folder}/{CONFIG}", json.dumps(BACKEND)),
                TextFile(f"{folder}/{METADATA}", md.dumps(self.meta.build(self.tag))),
                TextFile(TRACKER, RELEASE if self.tag == RELEASE else str(iteration))]

    # -- tensors

    def _stage(self, param: Param) -> int:
        layers = int(self.args["num_layers"])
        return next(s for s in range(self.grid.pp) if self.rules.on_stage(param.name, s, self.grid.pp, layers))

    def _model_shaped(self, prefixes: Mapping[str, str]) -> None:
        """The model's weights (`{MODULE: ""}`) or model-shaped optimizer states: per layer and tensor-parallel box one
        chunk, written by that rank at data-parallel rank 0; a tensor every tp rank holds, by tp rank 0."""
        layers = int(self.args["num_layers"])
        for state, prefix in prefixes.items():
            for param in self.params:
                tensor = self.catalog.tensors[TensorKey(param.name, state)]
                stage = self._stage(param)
                key = prefix + param.key
                global_shape = (layers, *param.shape) if param.layer is not None else param.shape
                if param.expert is not None:
                    self._expert_shaped(param, state, key, tensor.dtype)
                    continue
                ranks = range(self.grid.tp) if param.cut is not None else range(1)
                for tp_rank in ranks:
                    for at, size in tp_boxes.rank_boxes(param.name, param.shape, param.cut, param.parts,
                                                        self.grid.tp, tp_rank):
                        pieces = param.pieces(state, Shard.box(at, size), 0, math.prod(size))
                        offsets, sizes = (at, size) if param.layer is None else \
                            ((param.layer, *at), (1, *size))
                        self._chunk(self.grid.rank(tp_rank, 0, stage), key, global_shape, tensor.dtype,
                                    tuple(offsets), tuple(sizes), pieces)

    def _expert_shaped(self, param: Param, state: str, key: str, dtype: str) -> None:
        """An expert's param (or model-shaped state): its boxes (SwiGLU's fc1 in two parts, as the save cuts it) at
        (layer, expert) of the expert stack, written by the expert-parallel rank holding it."""
        assert param.expert is not None and param.layer is not None
        layers = int(self.args["num_layers"])
        stage = self._stage(param)
        for tp_rank in range(self.grid.tp):
            for at, size in tp_boxes.rank_boxes(param.name, param.shape, param.cut, param.parts, self.grid.tp,
                                                tp_rank):
                pieces = param.pieces(state, Shard.box(at, size), 0, math.prod(size))
                self._chunk(self._expert_rank(param.expert, 0, tp_rank, stage), key,
                            (layers, self.experts, *param.shape), dtype, (param.layer, param.expert, *at),
                            (1, 1, *size), pieces)
            if param.cut is None:
                break       # (a param every expert-tensor-parallel rank holds whole: saved once)

    def _buckets(self) -> None:
        """dp_reshardable: per model-parallel rank of the target its grad buffer's buckets laid out as megatron-core
        lays them (buckets.lay_out over the params of its stage, each its local tensor-parallel part); per bucket
        and state one flat tensor of the unpadded bucket, each data-parallel rank's part of each param a chunk (and
        each gap, zeros), with per_bucket_numel(_unpadded)."""
        grid = self.grid
        notes = self.catalog.notes
        saved = notes.grad_buffers if isinstance(notes, MegatronNotes) else ()
        kept = run_config.grad_buffer(self.args, self.model_dtype, saved, self.catalog.root)
        dtypes = f"({kept[0]}, {kept[1]})"
        pair = (DType(kept[0].removeprefix("torch.")), DType(kept[1].removeprefix("torch.")))
        master = self.catalog.tensors[TensorKey(self.params[0].name, MASTER)].dtype
        for pp_rank in range(grid.pp):
            for tp_rank in range(grid.tp):
                group = grid.group(tp_rank, pp_rank)
                shards: dict[str, Shard] = {}
                sizes = []
                for param in self.params:
                    if self._stage(param) != pp_rank or (param.expert is not None and self.ep > 1):
                        continue
                    boxes = tp_boxes.rank_boxes(param.name, param.shape, param.cut, param.parts, grid.tp, tp_rank)
                    shard = tp_boxes.local_shard(boxes, param.cut)
                    shards[param.name] = shard
                    sizes.append((param.name, tp_boxes.numel(shard)))
                chained = bool(self.experts) and self.ep > 1
                self._buffer(DENSE_CHAIN if chained else "", group, sizes, shards, grid.dp, pp_rank, dtypes, pair,
                             master, lambda dp_rank, t=tp_rank, p=pp_rank: grid.rank(t, dp_rank, p),
                             False if self.experts else None)
        # (at ep=1 megatron-core holds the experts as dense params: in the one buffer above, one optimizer)
        for ep_rank in range(self.ep if self.experts and self.ep > 1 else 0):
            mine = [p for p in self.params if p.expert is not None and self._expert_rank(p.expert) == ep_rank]
            shards = {p.name: Shard.whole(p.shape) for p in mine}
            self._buffer(EXPERT_CHAIN, ep_rank, [(p.name, math.prod(p.shape)) for p in mine], shards,
                         grid.dp // self.ep, 0, dtypes, pair, master,
                         lambda edp_rank, r=ep_rank: r + self.ep * edp_rank, True)

    def _buffer(self, prefix: str, group: int, sizes: list, shards: Mapping[str, Shard], dp: int, pp_rank: int,
                dtypes: str, pair: tuple, master: str, rank_of, expert: bool | None) -> None:
        """One distributed optimizer's grad buffer of model-parallel group `group` (keys under `prefix`): its
        buckets laid out over `dp` ranks (`rank_of(dp rank)` writes each part), per bucket and state a flat tensor,
        with per_bucket_numel(_unpadded) and the param groups of that optimizer (`expert`: the experts' or the
        dense params' groups; None: all)."""
        args = self.args
        laid = buckets.lay_out(sizes, dp, buckets.bucket_size(args, pp_rank, dp), frozenset(),
                               bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")))
        owner = rank_of(0)
        name_of = f"{prefix}{GROUP.format(group)}"
        for index, bucket in enumerate(laid):
            starts = {p.name: p.start for p in bucket.params}
            for saved, state in BUCKET_STATES.items():
                key = f"{name_of}.gbuf_idx_0.dtype_{dtypes}.bucket_idx_{index}.{saved}"
                assert BUCKET.match(key), key
                for start, size, name in bucket.chunks(dp):
                    dp_rank = min(start // (bucket.numel // dp), dp - 1)
                    if name is None:
                        pieces = [Piece.zeros(size)]
                    else:
                        pieces = self.by_name[name].pieces(state, shards[name], start - starts[name], size)
                    self._chunk(rank_of(dp_rank), key, (bucket.numel_unpadded,), master, (start,), (size,), pieces)
        counts = {"per_bucket_numel": [{pair: [b.numel for b in laid]}],
                  "per_bucket_numel_unpadded": [{pair: [b.numel_unpadded for b in laid]}]}
        for what, value in counts.items():
            self._value(owner, f"{name_of}.{what}/shard_0_1", value)
        self._value(owner, f"{name_of}.optimizer/shard_0_1",
                    {"param_groups": self._param_groups(with_step=True, expert=expert)})

    # -- the optimizer's param groups and step

    def _step(self) -> float:
        steps = {float(s) for s in self.catalog.scalar_values("step")}
        if len(steps) != 1:
            raise ReshardError.at(self.catalog.root, f"optimizer steps {sorted(steps)}: Megatron's optimizer keeps "
                                  "one step for every param group")
        return steps.pop()

    def _param_groups(self, with_step: bool, expert: bool | None = None) -> list[dict]:
        """The param groups (`expert` given: the experts' optimizer's, marked is_expert_parallel, or the dense
        params'). megatron-core groups the params alike whatever the ep, apart from is_expert_parallel, which it sets
        on the experts' at ep > 1 (a group of its own for each grouping that holds experts) and on none at ep=1 (the
        experts then in the dense params' groups)."""
        if expert is None:      # (the source's groups, or those of the arguments given for another format)
            return self._groups_of(self.groups, with_step)
        merged: dict[tuple, dict] = {}
        for group in self.catalog.param_groups:
            experts = [n for n in group.get("params", ()) if self.rules.expert_of(n) is not None]
            held = experts if expert else [n for n in group.get("params", ()) if n not in experts]
            if expert and self.ep == 1:
                held = []
            elif not expert and self.ep == 1:
                held = list(group.get("params", ()))
            if not held:
                continue
            plain = {**group, "is_expert_parallel": expert and self.ep > 1}
            key = tuple(sorted((k, repr(v)) for k, v in plain.items() if k != "params"))
            merged.setdefault(key, {**plain, "params": []})["params"] += held
        return self._groups_of(list(merged.values()), with_step)

    def _groups_of(self, given: Sequence[Mapping[str, Any]], with_step: bool) -> list[dict]:
        groups = []
        for group in given:
            plain = {k: v for k, v in group.items() if k != "params"}
            groups.append({**plain, "step": self._step()} if with_step else plain)
        return groups

    # -- objects and the common state

    def _empty_extra_states(self) -> list[str]:
        """The `_extra_state` names of a source of another format: those its module state dict names (a DeepSpeed
        save's), or, where it names none (a universal or DCP checkpoint), one for each module the rule file says
        saves one, in each layer holding a param of that module."""
        named = [n for n in self.catalog.order if n.endswith(legacy.EXTRA_STATE) and n not in self.catalog.params]
        if named:
            return named
        modules = []
        for param in self.params:
            # (a module is there where its weight is: an MoE layer's pre-MLP norm keeps linear_fc1's name, no fc1)
            module = param.name.removesuffix(".weight")
            if module != param.name and self.rules.saves_extra_state(module) and module not in modules:
                modules.append(module)
        return [f"{module}{legacy.EXTRA_STATE}" for module in modules]

    def _objects(self) -> None:
        """The layers' `_extra_state` objects: a torch_dist source's as their bytes lie, a legacy source's values as
        megatron-core's torch_dist save writes them ([value]: the empty ones of the local spec); the source's RNG state
        where tp and pp are the source's and it is saved as the target keeps it (torch_dist's per-rank objects)."""
        layers = int(self.args["num_layers"])
        per_stage = layers // self.grid.pp

        def owner(key: str) -> int | None:
            expert = EXPERT_EXTRA_STATE.match(key)
            if expert is not None and self.experts:
                return self._expert_rank(int(expert.group(2)), 0, 0, int(expert.group(1)) // per_stage)
            extra = EXTRA_STATE.match(key)
            if extra is None:
                return None
            stage = int(extra.group(1)) // per_stage if int(extra.group(2)) == layers else 0
            return self.grid.rank(0, 0, stage)
        if self.foreign:        # its layers' extra states, empty in the local spec (transformer_impl: _check)
            for name in self._empty_extra_states():
                key = legacy.extra_state_key(self.rules, name, 0, layers, self.catalog.root, self.experts)
                rank = None if key is None else owner(key)
                if key is not None and rank is not None:
                    self._value(rank, key, None)
            self.rng = False
            return
        if self.source_meta is None:
            for key, value in legacy.extra_states(self.catalog.root).items():
                rank = owner(key)
                if rank is None:
                    raise ReshardError.at(self.catalog.root, f"{key}: not a layer's extra state as written here")
                self._value(rank, key, value)
            self.rng = False    # (its RNG lists hold tensors: not re-serialized into value items yet)
            return
        saved = self.source_meta.state_dict_metadata
        same_grid = (self.grid.tp, self.grid.pp) == (self.source.tp, self.source.pp)
        keep_rng = self.sharding != WEIGHTS_ONLY and same_grid and not (
            self.args.get("data_parallel_random_init") and self.grid.dp != self.source.dp) and all(
            RNG.format(p, t, self.grid.pp, self.grid.tp) in saved for p in range(self.grid.pp)
            for t in range(self.grid.tp))
        self.rng = keep_rng
        for key, entry in saved.items():
            rank = owner(key)
            if rank is not None and not isinstance(entry, md.TensorStorageMetadata):
                self._blob(rank, key)
        if keep_rng:
            for pp_rank in range(self.grid.pp):
                for tp_rank in range(self.grid.tp):
                    self._blob(self.grid.rank(tp_rank, 0, pp_rank), RNG.format(pp_rank, tp_rank, self.grid.pp,
                                                                               self.grid.tp))

    def _common(self) -> TorchFile:
        """common.pt: the source's common state with the target's degrees in args, its optimizer's param groups and
        step as the target's sharding keeps them, and content_metadata naming that sharding."""
        grid, sharding = self.grid, self.sharding
        args = {**self.args, "tensor_model_parallel_size": grid.tp, "pipeline_model_parallel_size": grid.pp,
                "data_parallel_size": grid.dp, "world_size": grid.tp * grid.pp * grid.dp,
                "use_distributed_optimizer": sharding not in (PLAIN, WEIGHTS_ONLY),
                "dist_ckpt_optim_fully_reshardable": sharding == FULLY_RESHARDABLE}
        if sharding == WEIGHTS_ONLY:        # what Megatron-LM's --no-save-optim --no-save-rng records
            args.update(no_save_optim=True, no_save_rng=True)
        if self.experts:
            args["expert_model_parallel_size"] = self.ep
        if self.vocab is not None and "padded_vocab_size" in args:
            args["padded_vocab_size"] = self.vocab.rows
            if self.vocab.tokens is not None:       # (carried: a later change of tp re-pads without asking)
                args["vocab_size"] = self.vocab.tokens
        if not self.rng:
            args["no_save_rng"] = True
        if "ckpt_format" in args:       # (a legacy source's "torch": the output is torch_dist)
            args["ckpt_format"] = "torch_dist"
        namespace = Namespace()
        namespace.__dict__.update(args)
        content = {k: v for k, v in (self.common.get("content_metadata") or SAVE_CONTENT).items()
                   if not k.startswith("distrib_optim_")}
        file = TorchFileBuilder(f"{self.tag}/{COMMON}", archive="common")
        if sharding == WEIGHTS_ONLY:      # (generate_state_dict leaves out the optimizer and the scheduler)
            common = {k: v for k, v in self.common.items() if k not in ("opt_param_scheduler", "optimizer")}
            return file.build({**common, "args": namespace, "content_metadata": content})
        if sharding == PLAIN:
            step = file.slot("float32", (), [Piece(1, None, value=self._step())])
            inner = {"param_groups": self._param_groups(with_step=False), "state": {"common_step": step}}
            # (Float16Optimizer's state dict holds its torch optimizer's under "optimizer"; FP32Optimizer's is it)
            optimizer: dict = inner if self.model_dtype == "float32" else {"optimizer": inner}
        elif sharding == FULLY_RESHARDABLE:
            content.update(distrib_optim_sharding_type=sharding, distrib_optim_fully_reshardable_mem_efficient=False)
            optimizer = {"optimizer": {"param_groups": self._param_groups(with_step=True,
                                                                          expert=False if self.experts else None)},
                         "param_state_sharding_type": sharding}
        else:
            content.update(distrib_optim_sharding_type=sharding)
            optimizer = {"param_state_sharding_type": sharding}
        if self.experts and self.ep > 1:     # megatron-core's ChainedOptimizer: {index: each one's}, the experts' 2nd
            optimizer = {index: {**({"optimizer": {"param_groups": self._param_groups(True, expert)}}
                                    if sharding == FULLY_RESHARDABLE else {}), "param_state_sharding_type": sharding}
                         for index, expert in enumerate((False, True))}
        return file.build({**self.common, "args": namespace, "optimizer": optimizer, "content_metadata": content})
