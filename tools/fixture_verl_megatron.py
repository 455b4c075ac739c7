#!/usr/bin/env python
"""verl Megatron-backend fixture: a tiny GPTModel actor trained and saved by verl 0.9.1's own MegatronCheckpointManager,
CPU, 2 processes: tp=1, pp=1, dp=2 (dp2) and tp=2, pp=1, dp=1 (tp2).

Usage::

    PYTHONPATH=<ray and its imports, see below> python tools/fixture_verl_megatron.py [--only dp2|tp2] [--out DIR]

Made with verl 0.9.1, megatron-core 0.16.1, torch 2.13.0+cpu, gloo, and the CPU shim of tools/megatron_cpu.py. What
each rank builds is what verl's Megatron engine (verl/workers/engine/megatron/transformer_impl.py) builds for its
actor, where this machine lets it:

* the TransformerConfig by verl's own converter (``verl.models.mcore.hf_to_mcore_config``) from a tiny Qwen2
  config (tools/verl_cpu.config: 2 layers, hidden 16, vocab 32 padded to VOCAB), with the fusions that need CUDA off
  and sequence parallelism off (the converter turns it on at tp > 1; gloo has no reduce-scatter);
* the model wrapped as verl's ``get_model`` wraps it (Float16Module for bf16, Megatron's DistributedDataParallel with
  the distributed optimizer's buffers, ``grad_reduce_in_fp32``, no overlapped grad reduction, the parameters
  broadcast), written out here: verl's own wrap imports a name megatron-core 0.16.1 lacks; the GPTModel itself from
  megatron-core's *local* layer spec: verl's ``init_mcore_model`` asks for Transformer Engine's spec, which needs
  CUDA. On disk the two agree but for TE's ``_extra_state`` entries (docs/formats/verl.md);
* the optimizer by verl's ``init_megatron_optim_config`` and ``get_megatron_optimizer`` (Adam, bf16, the distributed
  optimizer, verl's default) and its scheduler by ``get_megatron_optimizer_param_scheduler``;
* ``MegatronCheckpointManager`` as the engine constructs it, with ``use_dist_checkpointing=True`` and no bridge:
  verl's default (``use_dist_checkpointing=False``) saves the weights through mbridge or Megatron-Bridge, neither
  installable here, and the manager refuses that setting without one. ``dist_ckpt_optim_fully_reshardable`` is
  verl's default (False): the distributed optimizer saves ``dp_reshardable`` buckets.

Three Adam steps through megatron's forward-backward schedule, then ``save_checkpoint(<run>/global_step_3/actor,
global_step=3)`` on every rank, then what verl's trainer writes beside it (ray_trainer._save_checkpoint):
``global_step_3/data.pt`` and ``latest_checkpointed_iteration.txt``. Rank 0 adds ``truth.json`` (versions,
settings, losses).

verl's ``megatron_checkpoint_manager`` imports ``verl.utils.megatron_utils``, whose ``verl.workers.config`` imports
the profiler and through it ``verl.protocol``, which imports Ray at import time (nothing of Ray runs here). Ray is no
dependency of reshard: the fixture was made with ray 2.60.0 and what its import needs (protobuf, jsonschema,
jsonschema-specifications, referencing, rpds-py, msgpack) and verl's codetiming installed with ``pip install
--no-deps --target DIR`` and DIR on PYTHONPATH. The tests read the committed result and need none of them.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torchrun_jobs

REPO = Path(__file__).resolve().parent.parent

WORLD, STEPS, NAME = 2, 3, "verl_megatron"
CONFIGS = {"dp2": 1, "tp2": 2}      # each configuration's tensor-parallel degree (dp: what the 2 ranks leave)
VOCAB = 64      # the embedding's rows (fixture_megatron_core's training batches draw below it)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "fixtures" / NAME))
    parser.add_argument("--only", choices=sorted(CONFIGS))
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.worker:
        torchrun_jobs.run_rank(worker, Path(args.worker), CONFIGS[args.name])   # (leaves the group, ends the rank)
    for name in [args.only] if args.only else list(CONFIGS):
        stage = Path(tempfile.mkdtemp(prefix=f"{NAME}_{name}."))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONHASHSEED": "0",
               "VERL_LOGGING_LEVEL": "WARNING"}
        torchrun_jobs.make_fixture(name, WORLD, [__file__, "--worker", stage, "--name", name], env, args.timeout,
                                   stage, Path(args.out) / name)
        print("wrote", Path(args.out) / name)
    return 0


def actor(tp: int):
    """(tf_config, ddp module, optimizer, scheduler, checkpoint manager) of verl's Megatron actor at this process
    group (model parallel groups made at tp, pp=1)."""
    import megatron_cpu
    megatron_cpu.install()
    import verl_cpu
    verl_cpu.install()
    import torch
    from megatron.core import parallel_state as mpu, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from omegaconf import OmegaConf
    from verl.models.mcore import hf_to_mcore_config
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron.optimizer import (
        get_megatron_optimizer,
        get_megatron_optimizer_param_scheduler,
        init_megatron_optim_config,
    )
    from verl.utils.megatron_utils import get_hf_rope_theta

    mpu.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    hf_config = verl_cpu.config()
    hf_config.vocab_size = VOCAB
    hf_config.architectures = ["Qwen2ForCausalLM"]
    # the fusions verl's converter turns on run CUDA kernels; the CPU initialisation keeps the weights on the CPU
    tf_config = hf_to_mcore_config(hf_config, torch.bfloat16, use_cpu_initialization=True,
                                   masked_softmax_fusion=False, bias_activation_fusion=False,
                                   bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                                   gradient_accumulation_fusion=False, attention_backend="local",
                                   sequence_parallel=False)

    def provider(pre_process, post_process, vp_stage=None):
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False)
        return GPTModel(tf_config, spec, vocab_size=VOCAB, max_sequence_length=hf_config.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=False, position_embedding_type="rope",
                        rotary_base=get_hf_rope_theta(hf_config))

    # verl's get_model, less its wrap: wrap_model_chunks_with_layerwise_aware_ddp imports a name megatron-core 0.16.1
    # lacks (layer_wise_optimizer.tag_params_for_buffer_routing); its wrap without the layer-wise (Muon) option is
    # this, the DDP config it makes
    model = provider(pre_process=True, post_process=True)
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=False)
    module = [DDP(config=tf_config, module=Float16Module(tf_config, model), disable_bucketing=False,
                  ddp_config=ddp_config)]
    module[0].broadcast_params()
    optim = OmegaConf.create({"optimizer": "adam", "lr": 1e-2, "min_lr": 1e-3, "clip_grad": 1.0,
                              "weight_decay": 0.01, "lr_warmup_init": 0.0, "lr_warmup_steps": 1,
                              "lr_decay_steps": 10, "total_training_steps": 10, "lr_decay_style": "constant",
                              "weight_decay_incr_style": "constant", "lr_wsd_decay_style": "exponential",
                              "lr_warmup_steps_ratio": None, "lr_wsd_decay_steps": None,
                              "use_checkpoint_opt_param_scheduler": False})
    optimizer = get_megatron_optimizer(module, init_megatron_optim_config(optim, use_distributed_optimizer=True,
                                                                          bf16=True))
    scheduler = get_megatron_optimizer_param_scheduler(optimizer, optim)
    # what the engine's initialize() passes (transformer_impl.py), the engine config's defaults but for
    # use_dist_checkpointing
    config = OmegaConf.create({"model": {"path": "tiny-qwen2"},
                               "megatron": {"dist_ckpt_optim_fully_reshardable": False,
                                            "distrib_optim_fully_reshardable_mem_efficient": False}})
    checkpoint = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                   "load_contents": ["model", "optimizer", "extra"], "async_save": False})
    manager = MegatronCheckpointManager(
        config=config, checkpoint_config=checkpoint, model_config=hf_config, transformer_config=tf_config,
        role="actor", model=module, arch=hf_config.architectures[0], hf_config=hf_config,
        param_dtype=torch.bfloat16, share_embeddings_and_output_weights=False,
        processing_class=verl_cpu.tokenizer(), optimizer=optimizer, optimizer_scheduler=scheduler,
        use_distributed_optimizer=True, use_checkpoint_opt_param_scheduler=False, use_dist_checkpointing=True,
        bridge=None, provider=None, peft_cls=None, use_megatron_fsdp=False)
    return tf_config, module, optimizer, scheduler, manager


def worker(out: Path, tp: int) -> None:
    import torch
    import torch.distributed as dist

    import fixture_megatron_core
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tf_config, module, optimizer, scheduler, manager = actor(tp)
    from megatron.core.distributed import finalize_model_grads
    tf_config.no_sync_func = module[0].no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    losses = fixture_megatron_core.train(tf_config, module[0], optimizer, scheduler, STEPS, seed=7, vocab=VOCAB)
    step_dir = out / f"global_step_{STEPS}"
    manager.save_checkpoint(str(step_dir / "actor"), global_step=STEPS)
    dist.barrier()
    if rank == 0:
        import megatron.core

        import verl_cpu
        verl_cpu.save_trainer_files(out, STEPS)
        (out / "truth.json").write_text(json.dumps({
            "verl": verl_cpu.VERL, "megatron_core": megatron.core.__version__, "torch": torch.__version__,
            "world": dist.get_world_size(), "tp": tp, "pp": 1, "dp": WORLD // tp, "step": STEPS,
            "params_dtype": "bfloat16",
            "optimizer": "distributed", "sharding_type": "dp_reshardable", "use_dist_checkpointing": True,
            "bridge": None, "layer_spec": "local", "losses": losses}, indent=1) + "\n")
    dist.barrier()
    fixture_megatron_core.end_helpers()


if __name__ == "__main__":
    raise SystemExit(main())
