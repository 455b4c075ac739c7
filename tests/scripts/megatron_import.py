"""One job of tests/scripts/megatron_load.py for a Hugging Face model imported as a weights-only Megatron save (`reshard
convert hf/ save/ --format megatron --names megatron-core-llama`): every rank makes the model parallel groups at the
job's tp and pp, builds megatron-core's GPTModel (local layer spec) of the job's shape, loads the save as
Megatron-LM's load_checkpoint does with --finetune (the common state's args must name this tp and pp;
`dist_checkpointing.load` of the model's sharded state dict alone, `load_state_dict` strict, the fresh optimizer's
masters taken from the loaded weights), runs Megatron's forward of the job's fixed tokens through its pipeline
schedule (the last stage's logits, gathered over tensor parallelism), and one training step with that fresh optimizer.

    job: {"label", "save", "tp", "pp", "model": {"layers", "hidden", "heads", "groups", "ffn", "kv", "rows" (the
          embedding's rows as padded here), "tokens" (the vocabulary), "seq", "eps", "rope_base", "tied"; a mixture
          of experts' "experts", "topk"}, "ep" (with experts: the expert-parallel degree, 1 otherwise), "fp32",
          "tokens": [[...]], "logits": where rank 0 writes the logits (safetensors: "logits", the tokens' rows)}

A mixture of experts is built as the MoE fixtures build it (tools/fixture_megatron_core.py): every layer's MLP
SequentialMLP experts of width "ffn", a top-"topk" softmax router, the allgather dispatcher, expert-parallel over ep
of the data-parallel ranks (expert tensor parallelism: tp, megatron-core's default). A job with "train": false runs
the forward alone: megatron-core trains a mixture of experts at tp > 1 with sequence parallelism only, which the
local spec's torch norms do not take (Transformer Engine's do: no CPU build).
    result: {"label", "loaded", "error", "problems", "logits_file", "losses", "moved" (the last two where it
             trains)}
"""
from __future__ import annotations

import os


def run(job: dict, fixture) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from torch.distributed.checkpoint.api import CheckpointException

    with open(os.path.join(job["save"], "latest_checkpointed_iteration.txt")) as f:
        marker = f.read().strip()
    folder = os.path.join(job["save"], "release" if marker == "release" else f"iter_{int(marker):07d}")
    out = {"label": job["label"], "loaded": False, "error": None, "problems": [], "logits_file": job["logits"]}
    args = dist_checkpointing.load_common_state_dict(folder)["args"]
    if (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) != (job["tp"], job["pp"]):
        out["problems"].append(f"args name tp={args.tensor_model_parallel_size}, pp="
                               f"{args.pipeline_model_parallel_size}, not the run's {job['tp']}, {job['pp']}")
    config, model, ddp, optimizer, scheduler = _build(job)
    content = dist_checkpointing.load_content_metadata(folder) or {}
    metadata = {**content, "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    try:
        with torch.no_grad():
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, folder)
            model.load_state_dict(loaded["model"], strict=True)
            optimizer.reload_model_params()     # (load_checkpoint without the optimizer: masters from the weights)
    except (Exception, CheckpointException) as e:
        lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
        out["error"] = lines[-1][:400]
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, out["error"])
    out["error"] = next((e for e in errors if e), None)
    if out["error"]:
        return out
    out["loaded"] = True
    logits = _forward(job, config, ddp)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, logits)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file
        found = next(g for g in gathered if g is not None)
        save_file({"logits": found.contiguous()}, job["logits"])
    if not job.get("train", True):
        return out
    before = [p.detach().clone() for p in model.parameters()]
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, fixture.train(config, ddp, optimizer, scheduler, 1, seed=11,
                                                 vocab=job["model"]["tokens"]))
    out["losses"] = [x for rank in losses for x in rank]
    moved = [None] * dist.get_world_size()
    dist.all_gather_object(moved, any(not torch.equal(a, p.detach())
                                      for a, p in zip(before, model.parameters(), strict=True)))
    out["moved"] = all(moved)
    return out


def _build(job: dict):
    """(config, model, ddp, optimizer, scheduler): the job's GPTModel at its tp and pp, wrapped as Megatron-LM wraps
    it (bf16: Float16Module, gradients reduced in fp32), with a fresh Adam (the plain optimizer) and scheduler."""
    import torch
    from megatron.core import parallel_state as mpu, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    m, fp32 = job["model"], job["fp32"]
    ep = job.get("ep", 1)
    mpu.initialize_model_parallel(job["tp"], job["pp"], expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    dtype = torch.float32 if fp32 else torch.bfloat16
    experts = m.get("experts")
    moe = {} if not experts else dict(
        num_moe_experts=experts, moe_router_topk=m["topk"], moe_ffn_hidden_size=m["ffn"], moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep)
    config = TransformerConfig(
        **moe,
        num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"], num_query_groups=m["groups"],
        ffn_hidden_size=m["ffn"], kv_channels=m["kv"], normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=job["tp"],
        pipeline_model_parallel_size=job["pp"], use_cpu_initialization=True, bf16=not fp32, params_dtype=dtype,
        pipeline_dtype=dtype, sequence_parallel=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        init_method_std=0.02, layernorm_epsilon=m["eps"])
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=m["rows"],
                     max_sequence_length=m["seq"], pre_process=mpu.is_pipeline_first_stage(),
                     post_process=mpu.is_pipeline_last_stage(), share_embeddings_and_output_weights=m["tied"],
                     position_embedding_type="rope", rotary_base=m["rope_base"])
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False,
                                                                        grad_reduce_in_fp32=not fp32),
                                  model if fp32 else Float16Module(config, model))
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=not fp32, clip_grad=1.0),
                                       [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=1e-3, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0,
                                        lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    return config, model, ddp, optimizer, scheduler


def _forward(job: dict, config, ddp):
    """Megatron's logits of the job's tokens through its pipeline schedule (forward only), in fp32, the
    vocabulary's padded rows cut; None on a rank not of the last stage."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.tensor(job["tokens"])
    batch, seq = tokens.shape

    def forward_step(data_iterator, module):
        positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
        output = module(next(data_iterator), positions, None, runtime_gather_output=True)

        def logits(output_tensor, non_loss_data=False):
            return output_tensor.detach().float()[..., :job["model"]["tokens"]].clone()
        return output, logits

    ddp.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp],
                                          num_microbatches=1, seq_length=seq, micro_batch_size=batch,
                                          forward_only=True, collect_non_loss_data=True)
    ddp.train()
    return out[0] if mpu.is_pipeline_last_stage() else None
