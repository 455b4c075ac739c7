#!/usr/bin/env python
"""Megatron-core torch_dist fixtures: a tiny Llama-configured GPTModel trained by the real megatron-core on CPU.

Usage::

    python tools/fixture_megatron_core.py [--only NAME[,NAME...]] [--out DIR] [--list]

Made with megatron-core 0.16.1 (the newest pip installs on Python 3.11; ``*_v015`` with 0.15.3 and ``*_v019`` with
0.19.2, see below), torch 2.13.0+cpu and psutil (without it the torch_dist writer's subprocess dies and the save
hangs: every launch runs under a timeout). For each configuration this launches ``torchrun --nproc_per_node <world>
tools/fixture_megatron_core.py --worker NAME`` (gloo, the CUDA
shim of tools/megatron_cpu.py). The worker builds a ``GPTModel`` configured as Llama (RMSNorm, SwiGLU, RoPE, no
biases, untied output layer, grouped-query attention: 4 heads, 2 query groups; 2 layers, hidden 16, SwiGLU width 32,
vocab 64, RMSNorm epsilon 1e-5, RoPE base 10000) from the local layer spec, wraps it as Megatron-LM does
(Float16Module for bf16, DistributedDataParallel), trains it ``STEPS`` Adam steps on deterministic tokens through
megatron's forward-backward schedule, and saves it as
Megatron-LM's ``save_checkpoint`` lays out a torch_dist save: ``<out>/<NAME>/save/latest_checkpointed_iteration.txt``
and ``iter_0000003/`` written by ``dist_checkpointing.save`` of ``generate_state_dict``'s dict (args, checkpoint
version 3.0, iteration, model, optimizer, scheduler, RNG state, flops) with the sharding metadata Megatron-LM passes
as ``content_metadata``. Megatron-LM's own training loop is not in the megatron-core wheel; ``args`` is an
``argparse.Namespace`` holding the arguments that describe this run under Megatron-LM's names.

Beside ``save/`` rank 0 writes the truth, taken from the live model and optimizer, not from the files:

* ``truth.safetensors``: ``module/<name>`` (the bf16 weights), ``fp32/<name>`` (the fp32 master), ``exp_avg/<name>``,
  ``exp_avg_sq/<name>``, per parameter under Megatron's per-layer names
  (``decoder.layers.<i>.self_attention.linear_qkv.weight``; a layer's norms under the names its sharded state dict
  gives them, ``...linear_qkv.layer_norm_weight``): every ShardedTensor of the model's and the optimizer's sharded
  state dict (the distributed optimizer asked for its gathered ``fully_reshardable`` form, whatever is saved) put
  together from every rank at its global offsets, and cut along the stacked layer axis;
* ``truth_forward.safetensors``: Megatron's own forward of the saved weights in fp32 (``tokens``, a fixed batch of 2×8
  token ids, and their ``logits``): after the save every rank makes the model parallel groups again at tp=1, pp=1
  and builds the same GPTModel in fp32, given every parameter's fp32 master at its sharded state dict's global
  offsets; what ``export --names megatron-core-llama`` writes must give the same logits in transformers' Llama;
* ``truth.json``: megatron-core and torch versions, topology (tp, pp, dp), optimizer, sharding type, iteration, the
  optimizer step, param groups' hyper-parameters, and Megatron's own buffer layout (per parameter its
  [start, end) in its bucket, per bucket ``numel_unpadded``), for the distributed optimizer.

The configurations (each file well under 1 MB):

* ``mcore_plain_tp2_pp2``: plain (Float16) optimizer, tp=2, pp=2, dp=1;
* ``mcore_fully_reshardable_tp2_dp2``: distributed optimizer, ``fully_reshardable``, tp=2, dp=2;
* ``mcore_dp_reshardable_tp2_dp2``: distributed optimizer, ``dp_reshardable`` (Megatron-LM's default), tp=2, dp=2;
* ``mcore_dp_reshardable_tp2_pp2_dp2``: the same at tp=2, pp=2, dp=2 (8 processes);
* ``mcore_legacy_plain_tp2_pp2`` and ``mcore_legacy_distributed_tp2_dp2``: the runs of ``mcore_plain_tp2_pp2`` and
  ``mcore_dp_reshardable_tp2_dp2`` saved in Megatron-LM's legacy format (``--ckpt-format torch``) as its
  save_checkpoint writes it: ``iter_0000003/mp_rank_TT[_PPP]/model_optim_rng.pt`` from each tensor/pipeline rank's
  first data-parallel rank, and the distributed optimizer's gathered ``distrib_optim.pt`` beside it;
* ``mcore_fully_sharded_model_space_tp2_dp2_v015``: the distributed optimizer at tp=2, dp=2 saved by megatron-core
  0.15.3 (``pip install megatron-core==0.15.3`` in a venv of its own) in 0.15's default sharding,
  ``fully_sharded_model_space``: model-shaped states, each stored block-wise flattened (``flattened_range``);
* ``mcore_dp_reshardable_tp2_dp2_v019``: ``mcore_dp_reshardable_tp2_dp2`` saved by megatron-core 0.19.2, whose layout
  keeps the common state inside the DCP checkpoint (no ``common.pt``). 0.19 declares Python >= 3.12, but its wheel
  runs here: in a venv with torch==2.13.0, psutil, numpy, packaging and triton (which 0.19 imports unconditionally),
  unpack it into site-packages (``pip download megatron-core==0.19.2 --python-version 3.12 --only-binary=:all:
  --no-deps``, then ``python -m zipfile -e WHEEL SITE_PACKAGES``) and run this script with that venv's python and
  ``PYTHONPATH=tools``. The worker refuses to make a configuration with another version than it names;
* ``mcore_moe_dp_reshardable_ep2_dp2`` and ``mcore_moe_fully_reshardable_ep2_dp2``: the same model with every layer's
  MLP a mixture of EXPERTS (4) SequentialMLP experts (``moe_grouped_gemm`` off, width EXPERT_FFN), a top-TOPK (2)
  router without load-balancing loss, the allgather token dispatcher (the alltoall one needs CUDA events), trained
  at ep=2 over the dp=2 ranks; truth.json adds ep, experts, topk and expert_ffn, truth.safetensors names each
  expert's params ``decoder.layers.<i>.mlp.experts.experts.<e>.linear_fc1.weight``, and its buffer layout lists every
  rank's (the experts' grad buffer differs between expert-parallel ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torchrun_jobs

REPO = Path(__file__).resolve().parent.parent

STEPS = 3
VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, SEQ, MICRO = 64, 16, 4, 2, 32, 2, 8, 2
NORM_EPS, ROPE_BASE = 1e-5, 10000
FORWARD_SEED = 99          # the fixed token batch whose logits truth_forward.safetensors holds

CONFIGS = {
    "mcore_plain_tp2_pp2": dict(tp=2, pp=2, dp=1, distributed=False, sharding=None),
    "mcore_fully_reshardable_tp2_dp2": dict(tp=2, pp=1, dp=2, distributed=True, sharding="fully_reshardable"),
    "mcore_dp_reshardable_tp2_dp2": dict(tp=2, pp=1, dp=2, distributed=True, sharding="dp_reshardable"),
    "mcore_dp_reshardable_tp2_pp2_dp2": dict(tp=2, pp=2, dp=2, distributed=True, sharding="dp_reshardable"),
    "mcore_fully_sharded_model_space_tp2_dp2_v015": dict(tp=2, pp=1, dp=2, distributed=True,
                                                         sharding="fully_sharded_model_space", megatron="0.15."),
    "mcore_legacy_plain_tp2_pp2": dict(tp=2, pp=2, dp=1, distributed=False, sharding=None, format="torch"),
    "mcore_legacy_distributed_tp2_dp2": dict(tp=2, pp=1, dp=2, distributed=True, sharding="dp_zero_gather_scatter",
                                             format="torch"),
    "mcore_dp_reshardable_tp2_dp2_v019": dict(tp=2, pp=1, dp=2, distributed=True, sharding="dp_reshardable",
                                            megatron="0.19."),
    # MoE: every layer's MLP EXPERTS experts (SequentialMLP), expert-parallel over ep of the dp ranks
    "mcore_moe_dp_reshardable_ep2_dp2": dict(tp=1, pp=1, dp=2, ep=2, distributed=True, sharding="dp_reshardable"),
    "mcore_moe_fully_reshardable_ep2_dp2": dict(tp=1, pp=1, dp=2, ep=2, distributed=True,
                                                sharding="fully_reshardable"),
    # Megatron-LM's own defaults (mlm): the args its validate_args leaves (bf16 with fp32 gradient reduction,
    # accumulate_allreduce_grads_in_fp32; the tokenizer's MLM_VOCAB padded to make_vocab_size_divisible_by (128) x tp,
    # which another tp pads otherwise; the tokenizer's own size not in args), and fp32 runs
    "mcore_mlm_bf16_dp_reshardable_tp2": dict(tp=2, pp=1, dp=1, distributed=True, sharding="dp_reshardable",
                                              mlm=True),
    "mcore_mlm_bf16_dp_reshardable_dp2": dict(tp=1, pp=1, dp=2, distributed=True, sharding="dp_reshardable",
                                              mlm=True),
    "mcore_mlm_bf16_fully_reshardable_tp2": dict(tp=2, pp=1, dp=1, distributed=True, sharding="fully_reshardable",
                                                 mlm=True),
    "mcore_mlm_fp32_plain_tp2": dict(tp=2, pp=1, dp=1, distributed=False, sharding=None, mlm=True, fp32=True),
    "mcore_mlm_fp32_fully_reshardable_pp2": dict(tp=1, pp=2, dp=1, distributed=True, sharding="fully_reshardable",
                                                 mlm=True, fp32=True),
    "mcore_mlm_fp32_dp_reshardable_dp2": dict(tp=1, pp=1, dp=2, distributed=True, sharding="dp_reshardable",
                                              mlm=True, fp32=True),
    "mcore_mlm_fp32_fully_sharded_model_space_dp2_v015": dict(tp=1, pp=1, dp=2, distributed=True,
                                                             sharding="fully_sharded_model_space", megatron="0.15.",
                                                             mlm=True, fp32=True),
    "mcore_mlm_legacy_fp32_plain_tp2": dict(tp=2, pp=1, dp=1, distributed=False, sharding=None, format="torch",
                                            mlm=True, fp32=True),
    "mcore_mlm_legacy_fp32_distributed_dp2": dict(tp=1, pp=1, dp=2, distributed=True,
                                                  sharding="dp_zero_gather_scatter", format="torch", mlm=True,
                                                  fp32=True),
}
MLM_VOCAB = 100         # the tokenizer's vocabulary of the mlm configurations (tokens are drawn below it)
VOCAB_DIVISOR = 128     # Megatron-LM's --make-vocab-size-divisible-by default


def padded_vocab(cfg: dict, tp: int) -> int:
    """The embedding's rows of configuration `cfg` at tensor-parallel degree `tp`: an mlm configuration's tokenizer
    vocabulary padded as Megatron-LM's build_tokenizer pads it (up to a multiple of make_vocab_size_divisible_by x
    tp); the others' VOCAB."""
    if not cfg.get("mlm"):
        return VOCAB
    multiple = VOCAB_DIVISOR * tp
    return -(-MLM_VOCAB // multiple) * multiple
EXPERTS, TOPK, EXPERT_FFN = 4, 2, 16     # the MoE configurations' experts, router top-k and each expert's width


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--out", default=str(REPO / "fixtures" / "megatron_core"))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.list:
        print("\n".join(CONFIGS))
        return 0
    if args.worker:
        torchrun_jobs.run_rank(worker, args.worker, Path(args.out))     # (leaves the process group, ends the rank)
    names = args.only.split(",") if args.only else list(CONFIGS)
    for name in names:
        cfg = CONFIGS[name]
        world = cfg["tp"] * cfg["pp"] * cfg["dp"]
        final = Path(args.out) / name
        stage = Path(tempfile.mkdtemp(prefix=f"{name}."))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        print(f"{name}: {world} processes", flush=True)
        torchrun_jobs.make_fixture(name, world, [__file__, "--worker", name, "--out", stage], env, args.timeout,
                                   stage / name, final)
        shutil.rmtree(stage, ignore_errors=True)
    return 0


def worker(name: str, out: Path) -> None:
    import megatron_cpu
    megatron_cpu.install()

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state as mpu, tensor_parallel

    cfg = CONFIGS[name]
    import megatron.core
    if not megatron.core.__version__.startswith(cfg.get("megatron", "0.16.")):
        raise SystemExit(f"{name} is made with megatron-core {cfg.get('megatron', '0.16.')}x, not "
                         f"{megatron.core.__version__}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config, model, ddp, optimizer, scheduler = build(cfg["tp"], cfg["pp"], cfg["distributed"], cfg.get("ep", 1),
                                                     vocab=padded_vocab(cfg, cfg["tp"]), fp32=cfg.get("fp32", False))
    train(config, ddp, optimizer, scheduler, STEPS, seed=7, vocab=MLM_VOCAB if cfg.get("mlm") else VOCAB)
    iteration = STEPS

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if cfg["distributed"]:
        metadata["distrib_optim_sharding_type"] = cfg["sharding"]
        if cfg["sharding"] == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    sd_metadata = {**metadata, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    run_args = _megatron_args(cfg, iteration)
    save = out / name / "save"
    checkpoint = save / f"iter_{iteration:07d}"
    if rank == 0:
        checkpoint.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if cfg.get("format") == "torch":
        _save_legacy(checkpoint, cfg, run_args, iteration, model, optimizer, scheduler, mpu, tensor_parallel)
    else:
        state_dict = {"args": run_args, "checkpoint_version": 3.0, "iteration": iteration}
        state_dict["model"] = model.sharded_state_dict(metadata=sd_metadata)   # unwrapped, as Megatron-LM saves
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=sd_metadata)
        state_dict["opt_param_scheduler"] = scheduler.state_dict()
        state_dict["rng_state"] = rng_state(mpu, tensor_parallel)
        state_dict["num_floating_point_operations_so_far"] = 0
        dist_checkpointing.save(state_dict, str(checkpoint), content_metadata=metadata)
    dist.barrier()
    if rank == 0:
        (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))

    # The truth, from the live model and optimizer: the model's sharded state dict and the optimizer's in model space
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, live_pieces(model, optimizer, sd_metadata, cfg["distributed"]))
    layout = _buffer_layout(ddp, optimizer) if cfg["distributed"] else None
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                                     mpu.get_data_parallel_rank(), layout))
    if rank == 0:
        _write_truth(out / name, cfg, name, gathered, layouts, optimizer, iteration)
    dist.barrier()
    if not cfg.get("mlm"):      # (export's truth: the Llama-configured fixtures')
        _forward(out / name, config, gathered, rank)
    dist.barrier()
    dist.destroy_process_group()
    end_helpers()


def build(tp: int, pp: int, distributed: bool, ep: int = 1, experts: int | None = None, vocab: int = VOCAB,
          fp32: bool = False):
    """(config, model, ddp, optimizer, scheduler): the fixtures' Llama-configured GPTModel (local layer spec) at tp, pp
    (the model parallel groups made here; dp is what the world leaves) with `vocab` embedding rows, its MLPs mixtures
    of `experts` (EXPERTS where ep > 1) expert-parallel over ep ranks, wrapped as Megatron-LM wraps it (bf16:
    Float16Module, and gradients reduced in fp32 as Megatron-LM's accumulate_allreduce_grads_in_fp32 does for every
    bf16 run; `fp32`: neither), DistributedDataParallel, with Megatron's Adam (the distributed optimizer where
    `distributed`) and scheduler. The ranks' process group must exist."""
    import torch
    from megatron.core import parallel_state as mpu, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    mpu.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = transformer_config(tp, pp, ep, experts if experts is not None else (EXPERTS if ep > 1 else None), fp32)
    model = gpt_model(config, vocab)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=False,
                                               grad_reduce_in_fp32=not fp32)
    ddp = DistributedDataParallel(config, ddp_config, model if fp32 else Float16Module(config, model))
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01, adam_beta1=0.9,
                                 adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=not fp32,
                                 use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=10, wd_incr_style="constant")
    return config, model, ddp, optimizer, scheduler


def transformer_config(tp: int, pp: int, ep: int = 1, experts: int | None = None, fp32: bool = False):
    """The fixtures' TransformerConfig (Llama-configured, bf16; `fp32`: fp32) at tp, pp; with `experts`, each layer's
    MLP a mixture
    of them (SequentialMLP: one MLP module per expert, top-TOPK softmax router, no load-balancing loss, the
    all-to-all token dispatcher) expert-parallel over ep ranks."""
    import torch
    from megatron.core.transformer import TransformerConfig
    moe = {} if not experts else dict(
        num_moe_experts=experts, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep)
    return TransformerConfig(**moe,
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, kv_channels=HIDDEN // HEADS, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, use_cpu_initialization=True, bf16=not fp32,
        params_dtype=torch.float32 if fp32 else torch.bfloat16,
        pipeline_dtype=torch.float32 if fp32 else torch.bfloat16, sequence_parallel=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        init_method_std=0.02, layernorm_epsilon=NORM_EPS)


def gpt_model(config, vocab: int = VOCAB):
    """The fixtures' GPTModel (local layer spec, RMSNorm, RoPE, untied output layer, `vocab` embedding rows) of this
    stage of `config`'s pipeline (the model parallel groups made)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=vocab,
                    max_sequence_length=SEQ, pre_process=mpu.is_pipeline_first_stage(),
                    post_process=mpu.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", rotary_base=ROPE_BASE)


def train(config, ddp, optimizer, scheduler, steps: int, seed: int, vocab: int = VOCAB) -> list:
    """`steps` Adam steps on deterministic tokens below `vocab` (per data-parallel rank) through Megatron's
    forward-backward schedule; the losses the last pipeline stage saw (empty elsewhere)."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    generator = torch.Generator().manual_seed(seed + mpu.get_data_parallel_rank())

    def batches():
        while True:
            tokens = torch.randint(0, vocab, (MICRO, SEQ + 1), generator=generator)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO, SEQ)
        output = module(batch["tokens"], position_ids, None, labels=batch["labels"])

        def loss_func(losses):
            loss = losses.float().mean()
            return loss, {"loss": loss.detach()}
        return output, loss_func

    forward_backward = get_forward_backward_func()
    data = batches()
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=2,
                               seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
        optimizer.step()
        scheduler.step(increment=1)
        losses += [float(o["loss"]) for o in out]
    return losses


def live_pieces(model, optimizer, sd_metadata, distributed: bool) -> list:
    """pieces() of the live model's and optimizer's sharded state dict, the distributed optimizer asked for its
    model-space (fully_reshardable) form: what truth.safetensors is assembled from."""
    truth_sd = {"model": model.sharded_state_dict(metadata=sd_metadata)}
    truth_metadata = {**sd_metadata}
    if distributed:
        truth_metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        truth_metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    truth_sd["optimizer"] = optimizer.sharded_state_dict(truth_sd, metadata=truth_metadata)
    return pieces(truth_sd)


def assemble(gathered) -> dict:
    """{"<state>/<per-layer name>": tensor} from every rank's pieces(): each ShardedTensor put at its global offsets,
    a layer stack cut along its layer axis (the names truth.safetensors uses)."""
    import torch
    full: dict = {}
    prepended: dict = {}
    for rank_pieces in gathered:
        for key, shape, offset, prepend, data in rank_pieces:
            tensor = full.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            local = (1,) * prepend + tuple(data.shape)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
            tensor[index] = data.reshape(local)
            prepended[key] = prepend
    out = {}
    for key, tensor in full.items():
        assert not (tensor.is_floating_point() and tensor.isnan().any()), f"{key}: not every element was gathered"
        state, name_ = state_of(key)
        if prepended[key] == 2:     # a layer stack of experts: (layer, expert, ...) -> one tensor per expert
            stack, _, rest = name_.partition(".layers.")
            within, _, own = rest.partition(".experts.experts.")
            assert own, key
            for layer in range(tensor.shape[0]):
                for expert in range(tensor.shape[1]):
                    out[f"{state}/{stack}.layers.{layer}.{within}.experts.experts.{expert}.{own}"] = \
                        tensor[layer, expert].clone()
        elif prepended[key]:
            assert prepended[key] == 1, key
            stack, _, rest = name_.partition(".layers.")
            for layer in range(tensor.shape[0]):
                out[f"{state}/{stack}.layers.{layer}.{rest}"] = tensor[layer].clone()
        else:
            out[f"{state}/{name_}"] = tensor
    return out


def _forward(folder: Path, config, gathered, rank: int) -> None:
    """Megatron's own forward of the saved weights, in fp32: the model parallel groups made again at tp=1, pp=1, a
    GPTModel of the same config in fp32 given the fp32 master of every parameter (gathered from every rank) at its
    sharded state dict's global offsets, and its logits of a fixed token batch, which rank 0 writes to
    ``truth_forward.safetensors`` (``tokens``, ``logits``)."""
    import dataclasses

    import torch
    from megatron.core import parallel_state as mpu, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    # (a config of its own: the trained one holds the DDP's hooks, which an expert's deepcopy of it cannot copy)
    fp32 = dataclasses.replace(transformer_config(1, 1, 1, config.num_moe_experts), bf16=False,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    model = GPTModel(fp32, spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=ROPE_BASE)
    masters = {}
    for rank_pieces in gathered:
        for key, shape, offset, prepend, data in rank_pieces:
            state, name = state_of(key)
            if state != "fp32":
                continue
            full = masters.setdefault(name, torch.full(shape, float("nan"), dtype=torch.float32))
            local = (1,) * prepend + tuple(data.shape)
            full[tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))] = data.reshape(local)
    loaded = set()
    with torch.no_grad():
        for key, shape, offset, prepend, data in pieces(model.sharded_state_dict(), clone=False):
            assert tuple(masters[key].shape) == shape, key
            local = (1,) * prepend + tuple(data.shape)
            source = masters[key][tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))]
            assert not source.isnan().any(), key
            data.copy_(source.reshape(data.shape))
            loaded.add(key)
    assert loaded == set(masters), set(masters) ^ loaded
    for key, _shape, offset, prepend, data in pieces(model.sharded_state_dict()):     # copied into the params
        local = (1,) * prepend + tuple(data.shape)
        assert torch.equal(masters[key][tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))],
                           data.reshape(local)), key
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(FORWARD_SEED))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    with torch.no_grad():
        logits = model(tokens, position_ids, None)
    assert logits.shape == (2, SEQ, VOCAB) and logits.dtype == torch.float32, (logits.shape, logits.dtype)
    if rank == 0:
        from safetensors.torch import save_file
        save_file({"tokens": tokens.contiguous(), "logits": logits.contiguous()},
                  str(folder / "truth_forward.safetensors"))


def end_helpers() -> None:
    """End the processes the torch_dist writer left behind (a multiprocessing Manager for its results, the resource
    tracker): run_rank ends the rank with os._exit, which runs no finalizer, and they would hold torchrun's output
    pipes open."""
    import psutil
    helpers = psutil.Process().children(recursive=True)
    for helper in helpers:
        helper.terminate()
    psutil.wait_procs(helpers, timeout=10)


def _megatron_args(cfg, iteration):
    """The arguments Megatron-LM would pickle for this run (a subset, under its names)."""
    import signal

    import torch
    from megatron.core.transformer.enums import AttnBackend
    moe = {} if cfg.get("ep", 1) == 1 else dict(
        num_experts=EXPERTS, expert_tensor_parallel_size=cfg["tp"], moe_router_topk=TOPK,
        moe_ffn_hidden_size=EXPERT_FFN, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    args = dict(
        **moe, num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, group_query_attention=True, kv_channels=HIDDEN // HEADS, seq_length=SEQ,
        max_position_embeddings=SEQ, padded_vocab_size=VOCAB, normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"], data_parallel_size=cfg["dp"],
        context_parallel_size=1, expert_model_parallel_size=cfg.get("ep", 1), virtual_pipeline_model_parallel_size=None,
        world_size=cfg["tp"] * cfg["pp"] * cfg["dp"], bf16=True, fp16=False, params_dtype=torch.bfloat16,
        optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=1.0, use_distributed_optimizer=cfg["distributed"], overlap_grad_reduce=False,
        overlap_param_gather=False, ddp_bucket_size=None, ddp_pad_buckets_for_high_nccl_busbw=False,
        grad_reduce_in_fp32=True, dist_ckpt_optim_fully_reshardable=cfg["sharding"] == "fully_reshardable",
        norm_epsilon=NORM_EPS, rotary_base=ROPE_BASE, rotary_percent=1.0, rotary_interleaved=False,
        micro_batch_size=MICRO, global_batch_size=MICRO * 2 * cfg["dp"], train_iters=10, iteration=iteration,
        consumed_train_samples=iteration * MICRO * 2 * cfg["dp"], ckpt_format=cfg.get("format", "torch_dist"),
        no_save_rng=False, no_save_optim=False, save_interval=STEPS, transformer_impl="local",
        attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
    if cfg.get("mlm"):
        del args["grad_reduce_in_fp32"]
        args.update(_megatron_lm_defaults(cfg))
    return argparse.Namespace(**args)


def _megatron_lm_defaults(cfg) -> dict:
    """What Megatron-LM's parse_args and validate_args leave in args for a run of `cfg` that takes their defaults,
    where the arguments above say otherwise: its own name for the gradient reduction's dtype
    (accumulate_allreduce_grads_in_fp32, which validate_args turns on for bf16; DDP's grad_reduce_in_fp32 is set from
    it and is no argument), the vocabulary padded by build_tokenizer to make_vocab_size_divisible_by x tp (the
    tokenizer's own size is not kept: vocab_size is the --vocab-size argument, None with a tokenizer file), and the
    dtype of an fp32 run."""
    import torch
    fp32 = cfg.get("fp32", False)
    return dict(accumulate_allreduce_grads_in_fp32=not fp32, grad_reduce_in_bf16=False,
                main_grads_dtype=torch.float32, make_vocab_size_divisible_by=VOCAB_DIVISOR, vocab_size=None,
                padded_vocab_size=padded_vocab(cfg, cfg["tp"]), tokenizer_type="HuggingFaceTokenizer",
                bf16=not fp32, params_dtype=torch.float32 if fp32 else torch.bfloat16)


def _save_legacy(checkpoint: Path, cfg, run_args, iteration, model, optimizer, scheduler, mpu, tensor_parallel):
    """Megatron-LM's save_checkpoint with --ckpt-format torch: the first data-parallel rank of each (tp, pp) rank
    torch.saves generate_state_dict's dict (the model's state_dict_for_save_checkpoint, the optimizer's
    state_dict, scheduler, RNG states) to mp_rank_TT[_PPP]/model_optim_rng.pt; the distributed optimizer's
    parameter state goes to distrib_optim.pt beside it (save_parameter_state, gathered on that rank)."""
    import torch
    tp, pp = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    folder = checkpoint / (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if cfg["pp"] > 1 else ""))
    dp_rank = mpu.get_data_parallel_rank()
    if dp_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    if cfg["distributed"]:
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
    if dp_rank == 0:
        rng = rng_state(mpu, tensor_parallel).data
        torch.save({"args": run_args, "checkpoint_version": 3.0, "iteration": iteration,
                    "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": scheduler.state_dict(), "rng_state": rng,
                    "num_floating_point_operations_so_far": 0}, folder / "model_optim_rng.pt")


def rng_state(mpu, tensor_parallel):
    import random

    import numpy as np
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
              "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]
    return ShardedObject("rng_state", state, (mpu.get_pipeline_model_parallel_world_size(),
                                              mpu.get_tensor_model_parallel_world_size()),
                         (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                         replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))


def pieces(sharded, clone=True):
    """[(key, global shape, global offset, prepended axes, tensor)] of every ShardedTensor in a sharded state dict
    (factories built first); clone=False: the tensors themselves (the model's parameters)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories
    apply_factories(sharded)
    out = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensorFactory):
            raise AssertionError(f"an unbuilt factory {value.key}")
        if isinstance(value, ShardedTensor):
            assert value.flattened_range is None, value.key
            out.append((value.key, tuple(value.global_shape), tuple(value.global_offset), value.prepend_axis_num,
                        value.data.detach().clone().cpu() if clone else value.data))
    return out


def _buffer_layout(ddp, optimizer):
    """Megatron's own placement of each parameter in the distributed optimizer's buffers (for truth.json)."""
    names = {p: n.removeprefix("module.") for n, p in ddp.module.named_parameters()}
    out = []
    for b, buffer in enumerate([*ddp.buffers, *ddp.expert_parallel_buffers]):
        buckets = [{"numel": bucket.grad_data.numel(), "numel_unpadded": bucket.numel_unpadded,
                    "offset": bucket.offset} for bucket in buffer.buckets]
        params = {names[p]: list(where) for p, where in buffer.param_index_map.items()}
        out.append({"buffer": b, "expert": b >= len(ddp.buffers),
                    "data_parallel_group_idx": _group_idx(optimizer, b >= len(ddp.buffers)),
                    "param_dtype": str(buffer.param_dtype), "grad_dtype": str(buffer.grad_dtype),
                    "buckets": buckets, "params": params})
    return out


def _group_idx(optimizer, expert: bool = False):
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner in chained[1:] if expert else chained:     # (the expert params' optimizer is the second)
        if hasattr(inner, "data_parallel_group_idx"):
            return inner.data_parallel_group_idx
    return None


def _write_truth(folder: Path, cfg, name, gathered, layouts, optimizer, iteration):
    import megatron.core
    import torch
    from safetensors.torch import save_file
    truth = assemble(gathered)
    if cfg.get("fp32"):     # an fp32 run's params are its masters (the plain FP32Optimizer keeps no copy of them)
        truth.update({f"fp32/{k[len('module/'):]}": v.clone() for k, v in truth.items()
                      if k.startswith("module/") and f"fp32/{k[len('module/'):]}" not in truth})
    save_file(truth, str(folder / "truth.safetensors"))
    groups = []
    steps = set()
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if isinstance(v, (int, float, bool, str)) and k != "params"})
        for p in group["params"]:
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                state = inner.optimizer.state.get(p, {}) if hasattr(inner, "optimizer") else {}
                if "step" in state:
                    steps.add(int(state["step"]))
        if "step" in group:
            steps.add(int(group["step"]))
    info = {"kind": "megatron-core", "megatron_core": megatron.core.__version__, "torch": torch.__version__,
            "tp": cfg["tp"], "pp": cfg["pp"], "dp": cfg["dp"],
            "optimizer": "distributed" if cfg["distributed"] else "plain", "sharding_type": cfg["sharding"],
            "iteration": iteration, "step": sorted(steps), "param_groups": groups,
            "model_dtype": "float32" if cfg.get("fp32") else "bfloat16",
            "layers": LAYERS, "vocab": padded_vocab(cfg, cfg["tp"]), "hidden": HIDDEN, "heads": HEADS,
            "query_groups": GROUPS, "ffn": FFN}
    if cfg.get("ep", 1) > 1:
        info.update(ep=cfg["ep"], experts=EXPERTS, topk=TOPK, expert_ffn=EXPERT_FFN)
    if cfg.get("mlm"):      # (the padded rows are `vocab`; the tokenizer's size is not in the save)
        info.update(tokenizer_vocab=MLM_VOCAB, make_vocab_size_divisible_by=VOCAB_DIVISOR)
    if cfg["distributed"]:
        # (with experts each rank's: the expert buffers differ between expert-parallel ranks)
        info["buffer_layout"] = [{"tp_rank": t, "pp_rank": p, "dp_rank": d, "buffers": layout}
                                 for t, p, d, layout in layouts if d == 0 or cfg.get("ep", 1) > 1]
    (folder / "truth.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")


def state_of(key: str):
    """(state, model key) of a sharded key: the model's weights are `module`, the optimizer's fp32 copy `fp32`."""
    for prefix, state in (("optimizer.state.fp32_param.", "fp32"), ("optimizer.state.param.", "fp32"),
                          ("optimizer.state.exp_avg_sq.", "exp_avg_sq"), ("optimizer.state.exp_avg.", "exp_avg")):
        if key.startswith(prefix):
            return state, key[len(prefix):]
    return "module", key


if __name__ == "__main__":
    sys.exit(main())
