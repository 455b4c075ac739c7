#!/usr/bin/env python
"""A Llama-70B-shaped Megatron-LM torch_dist save with the distributed optimizer (dp_reshardable) as sparse files.

Usage::

    python tools/bench_megatron_sparse.py DIR [--tp 8] [--pp 4] [--dp 4] [--layers 80]

The model is megatron-core's GPTModel of the local layer spec configured as Llama-2-70B (hidden 8192, SwiGLU 28672,
64 query heads in 8 query groups of head size 128, 80 layers, a vocabulary of 32768 tokens, untied output layer,
RMSNorm, no biases), trained with bf16 weights, fp32 grad reduction, overlapped grad reduction (buckets of 40M
elements on the first pipeline stage) and Adam. reshard's own Megatron writer (reshard/formats/megatron/writer.py)
lays out every file for tp x pp x dp, from a catalog of the model's shapes at tp=1: `metadata.json`, `common.pt`
(Megatron-LM's args for the run), DCP's `.metadata` (every chunk and object, real) and the `__R_0.distcp` files,
whose objects and zip framing are written for real and every tensor chunk's bytes left a hole (lseek past them) with
the CRC-32 that many zero bytes have. About 0.98 TB apparent, a few hundred MB on disk; a reader that opens a chunk
reads zeros. No RNG state or layers' `_extra_state` objects are written (the catalog has no source to take them from).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib

from bench_sparse import HoleSink, crc32_of_zeros, write_sparse_torch_file
from reshard.core.catalog import MASTER, MODULE, CatalogBuilder, ParamInfo, TensorDraft, TrainingState
from reshard.core.layout import Layout
from reshard.core.write_requests import TensorFile, TextFile
from reshard.formats import writer
from reshard.formats.dcp import metadata as md
from reshard.formats.dcp.chunkzip import CHUNK, Archive
from reshard.formats.megatron.pickles import Namespace
from reshard.formats.megatron.topology import DP_RESHARDABLE, LAYOUT_016, MegatronNotes, MegatronTopology
from reshard.formats.torchsave_read import DType
from reshard.formats.torchsave_write import pickle_tree

VOCAB, HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM = 32768, 8192, 28672, 64, 8, 128
ITERATION = 1
STATES = ("exp_avg", "exp_avg_sq")


def params(layers: int) -> list:
    """[(name, saved key, layer or None, shape)] in the order the GPTModel registers them."""
    layer = [("self_attention.linear_qkv.layer_norm_weight", (HIDDEN,)),
             ("self_attention.linear_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
             ("self_attention.linear_qkv.weight", ((HEADS + 2 * GROUPS) * HEAD_DIM, HIDDEN)),
             ("mlp.linear_fc1.layer_norm_weight", (HIDDEN,)),
             ("mlp.linear_fc1.weight", (2 * FFN, HIDDEN)),
             ("mlp.linear_fc2.weight", (HIDDEN, FFN))]
    return ([("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None, (VOCAB, HIDDEN))]
            + [(f"decoder.layers.{i}.{key}", f"decoder.layers.{key}", i, shape) for i in range(layers)
               for key, shape in layer]
            + [("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None, (HIDDEN,)),
               ("output_layer.weight", "output_layer.weight", None, (VOCAB, HIDDEN))])


def run_args(tp: int, pp: int, dp: int, layers: int) -> Namespace:
    args = Namespace()
    args.__dict__.update(
        num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, group_query_attention=True, kv_channels=HEAD_DIM, seq_length=4096,
        max_position_embeddings=4096, padded_vocab_size=VOCAB, vocab_size=VOCAB, make_vocab_size_divisible_by=128,
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=dp, world_size=tp * pp * dp, bf16=True, fp16=False, params_dtype=DType("bfloat16"),
        optimizer="adam", lr=1.5e-4, min_lr=1.5e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=1.0, use_distributed_optimizer=True, overlap_grad_reduce=True,
        overlap_param_gather=True, ddp_bucket_size=None, ddp_pad_buckets_for_high_nccl_busbw=False,
        grad_reduce_in_fp32=True, norm_epsilon=1e-5, rotary_base=10000, micro_batch_size=1,
        global_batch_size=1024, iteration=ITERATION, consumed_train_samples=1024, ckpt_format="torch_dist",
        no_save_rng=True, transformer_impl="local", virtual_pipeline_model_parallel_size=None)
    return args


def source(root: str, layers: int):
    """A catalog of the model's shapes at tp=pp=dp=1 (no fragments: only the output's files are written), and the
    source folder the writer reads the common state from (common.pt, an empty .metadata)."""
    common = {"args": run_args(1, 1, 1, layers), "checkpoint_version": 3.0, "iteration": ITERATION,
              "opt_param_scheduler": {"max_lr": 1.5e-4, "min_lr": 1.5e-5, "num_steps": 1024},
              "num_floating_point_operations_so_far": 0,
              "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                                   "distrib_optim_sharding_type": DP_RESHARDABLE}}
    write_sparse_torch_file(os.path.join(root, "common.pt"), pickle_tree(common), [], {}, "common")
    with open(os.path.join(root, ".metadata"), "wb") as f:
        f.write(md.dumps(md.Metadata({}, None, {}, md.StorageMeta(None, "stub", None, []), "1.0.0")))
    topology = MegatronTopology(DP_RESHARDABLE, ITERATION, 3.0, LAYOUT_016)
    catalog = CatalogBuilder(root=root, format="megatron", tag=f"iter_{ITERATION:07d}",
                             layout=Layout.of(1, dtype="bfloat16", format_topology=topology))
    notes = {}
    hyper = {"lr": 1.5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "lr_mult": 1.0, "is_expert_parallel": False, "default_config": True,
             "is_decoupled_lr": False, "max_lr": 1.5e-4, "min_lr": 1.5e-5}
    decay, no_decay = [], []
    for name, key, layer, shape in params(layers):
        group = 1 if len(shape) == 1 else 0
        (no_decay if group else decay).append(name)
        catalog.params[name] = ParamInfo(name, shape, "trainable", group)
        catalog.order.append(name)
        catalog.add(TensorDraft(name, MODULE, shape, "bfloat16"))
        for state in (MASTER, *STATES):
            catalog.add(TensorDraft(name, state, shape, "float32"))
        notes[name] = {"saved_as": key, **({"layer": layer} if layer is not None else {})}
    catalog.param_groups += [{**hyper, "weight_decay": 0.1, "wd_mult": 1.0, "params": decay},
                             {**hyper, "weight_decay": 0.0, "wd_mult": 0.0, "params": no_decay}]
    catalog.group_scalars += [{"step": 1.0}, {"step": 1.0}]
    catalog.training = TrainingState(global_steps=ITERATION, global_samples=1024, optimizer="AdamW")
    catalog.notes = MegatronNotes(notes, {"iteration": ITERATION}, ())
    return catalog.freeze()


def write_sparse_distcp(path: str, file, dense: bool = False) -> int:
    """A `.distcp` file as reshard's writer lays it out: its objects written, each chunk's bytes a hole (`dense`:
    random bytes, as a real save's are on disk)."""
    sink = HoleSink(path)
    nbytes = {s.key: s.nbytes for s in file.slots}
    try:
        for item, fixed in zip(file.items, file.fixed, strict=True):
            if item.kind != CHUNK:
                sink.write(fixed)
                continue
            archive = Archive(fixed, nbytes[item.key])
            sink.write(archive.head())
            if dense:
                crc = 0
                for block in random_blocks(nbytes[item.key]):
                    sink.write(block)
                    crc = zlib.crc32(block, crc)
            else:
                sink.skip(nbytes[item.key])
                crc = crc32_of_zeros(nbytes[item.key])
            sink.write(archive.tail(crc))
        return sink.tell()
    finally:
        sink.close()


_RANDOM = os.urandom(1 << 24)


def random_blocks(n: int):
    """n bytes of incompressible data, in blocks of at most 16 MiB (windows of one random buffer)."""
    at = 0
    while at < n:
        size = min(n - at, len(_RANDOM) - 4096)
        start = (at // 4096 * 7919) % 4096
        yield _RANDOM[start:start + size]
        at += size


def make(dst: str, tp: int, pp: int, dp: int, layers: int, dense: bool = False) -> tuple[int, int]:
    """Write the save under dst; (files, apparent bytes)."""
    with tempfile.TemporaryDirectory() as stub:
        catalog = source(stub, layers)
        target = catalog.layout.with_degrees({"tp": tp, "pp": pp, "dp": dp})
        items = writer("megatron").target_files(catalog, target, f"iter_{ITERATION:07d}")
    count = apparent = 0
    for item in items:
        path = os.path.join(dst, item.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(item, TextFile):
            data = item.text.encode() if isinstance(item.text, str) else item.text
            with open(path, "wb") as f:
                f.write(data)
            apparent += len(data)
        elif hasattr(item, "items"):        # a .distcp file
            apparent += write_sparse_distcp(path, item, dense)
        elif isinstance(item, TensorFile):  # common.pt
            apparent += write_sparse_torch_file(path, item.header(), item.slots, item.pieces,
                                                item.container().archive)
        count += 1
    return count, apparent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--dims", help="VOCAB,HIDDEN,FFN,HEADS,GROUPS: another model of the same shape (head size 128)")
    parser.add_argument("--dense", action="store_true", help="random tensor bytes, not holes (a save to copy and "
                        "convert against the disk's speed; size it with --dims and --layers)")
    args = parser.parse_args()
    if args.dims:
        global VOCAB, HIDDEN, FFN, HEADS, GROUPS
        VOCAB, HIDDEN, FFN, HEADS, GROUPS = (int(v) for v in args.dims.split(","))
    start = time.perf_counter()
    files, apparent = make(args.dir, args.tp, args.pp, args.dp, args.layers, args.dense)
    print(f"{args.dir}: {files} files, {apparent / 1e9:.2f} GB {'' if args.dense else 'apparent '}(tp={args.tp}, "
          f"pp={args.pp}, dp={args.dp}, {args.layers} layers) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
