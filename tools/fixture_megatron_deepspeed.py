#!/usr/bin/env python
"""A DeepSpeed checkpoint of megatron-core's GPTModel trained under DeepSpeed: the source of `convert --format
megatron` from DeepSpeed, universal and DCP (tests/formats/megatron/test_megatron_from.py).

Usage::

    python tools/fixture_megatron_deepspeed.py [--out DIR] [--zero STAGE]

Made with megatron-core 0.16.1, DeepSpeed 0.19.8 and torch 2.13.0+cpu (DS_ACCELERATOR=cpu, gloo, the CUDA shim of
tools/megatron_cpu.py). ``torchrun --nproc_per_node 2 tools/fixture_megatron_deepspeed.py --worker`` builds the
fixtures' Llama-configured GPTModel of tools/fixture_megatron_core.py (local layer spec, tp=1, pp=1) on each rank,
hands it to ``deepspeed.initialize`` as tests/scripts/megatron_deepspeed_load.py does (bf16, ZeRO-1, torch's AdamW in
megatron-core's two param groups: weight decay 0.01, and none for one-dimensional params), trains ``STEPS`` steps
on deterministic tokens and saves with ``engine.save_checkpoint`` (tag ``global_step3``). The module keeps the
local spec's own names (a layer's norms are ``input_layernorm`` and ``pre_mlp_layernorm``).

Beside it, in ``<out>/mcore_deepspeed_z1_dp2/``:

* ``checkpoint/``: the DeepSpeed save dir (DeepSpeed 0.19.8's ``ds_to_universal`` cannot convert it: with
  ``--inject_missing_state`` it fails on the layers' empty extra states, "'NoneType' object has no attribute
  'float'"; the tests make the universal and DCP sources with reshard);
* ``truth.safetensors``: the live engine's ``module/``, ``fp32/``, ``exp_avg/``, ``exp_avg_sq/`` tensors
  (tests/helpers/engine_state.py) at save time, under the names megatron-core's torch_dist save gives them
  (``...self_attention.linear_qkv.layer_norm_weight`` for ``...input_layernorm.weight``: RENAMES below, written here
  independently of reshard's rule file), what tests/scripts/megatron_load.py compares a loaded Megatron model with;
* ``truth.json``: the step, the iteration (DeepSpeed's global_steps) and the param groups' hyper-parameters;
* ``megatron_args.json``: the Megatron-LM arguments and scheduler state of this run, as a user converting it writes
  them (``--to ...,args=megatron_args.json``): the model's shape, the optimizer's hyper-parameters, the batch sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torchrun_jobs

REPO = Path(__file__).resolve().parent.parent

NAME = "mcore_deepspeed_z1_dp2"
STEPS, TAG, LR, WEIGHT_DECAY = 3, "global_step3", 1e-2, 0.01
# the local spec's module names of a layer's norms -> the torch_dist save's keys
RENAMES = ((re.compile(r"(.*\.layers\.\d+)\.input_layernorm\.(weight|bias)"),
            r"\1.self_attention.linear_qkv.layer_norm_\2"),
           (re.compile(r"(.*\.layers\.\d+)\.pre_mlp_layernorm\.(weight|bias)"), r"\1.mlp.linear_fc1.layer_norm_\2"))


def torch_dist_name(name: str) -> str:
    for pattern, template in RENAMES:
        if pattern.fullmatch(name):
            return pattern.sub(template, name)
    return name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "fixtures" / "megatron_deepspeed"))
    parser.add_argument("--zero", type=int, default=1, help="the ZeRO stage (the fixture's is 1; 2 and 3 for a check "
                        "by hand, written as mcore_deepspeed_z<STAGE>_dp2)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.worker:
        torchrun_jobs.run_rank(worker, Path(args.worker), args.zero)
    stage = Path(tempfile.mkdtemp(prefix=f"{NAME}."))
    # the worker imports tests.helpers (from the repository root) and its sibling tools
    path = os.pathsep.join((str(REPO), str(REPO / "tools")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": path}
    torchrun_jobs.make_fixture(NAME, 2, [__file__, "--worker", stage, "--zero", args.zero], env, args.timeout, stage,
                               Path(args.out) / NAME.replace("_z1_", f"_z{args.zero}_"))
    return 0


def worker(out: Path, zero: int) -> None:
    import megatron_cpu
    megatron_cpu.install()

    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu, tensor_parallel
    from safetensors.torch import save_file

    import fixture_megatron_core as fixture
    from tests.helpers.engine_state import engine_tensors

    deepspeed.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    model = fixture.gpt_model(fixture.transformer_config(1, 1))
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": WEIGHT_DECAY},
              {"params": [p for _, p in named if p.dim() == 1], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": fixture.MICRO, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "bf16": {"enabled": True}, "zero_optimization": {"stage": zero},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": WEIGHT_DECAY, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    generator = torch.Generator().manual_seed(7 + dist.get_rank())
    position_ids = torch.arange(fixture.SEQ).unsqueeze(0).expand(fixture.MICRO, fixture.SEQ)
    for _ in range(STEPS):
        tokens = torch.randint(0, fixture.VOCAB, (fixture.MICRO, fixture.SEQ + 1), generator=generator)
        loss = engine(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(out / "checkpoint"), tag=TAG)
    truth = {f"{k.split('/', 1)[0]}/{torch_dist_name(k.split('/', 1)[1])}": v
             for k, v in engine_tensors(engine, model).items()}
    inner = engine.optimizer.optimizer
    steps = sorted({int(s["step"]) for s in inner.state.values() if "step" in s})
    if dist.get_rank() == 0:
        save_file(truth, str(out / "truth.safetensors"))
        hyper = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, list))}
                 for g in inner.param_groups]
        info = {"kind": "megatron-core under deepspeed", "deepspeed": deepspeed.__version__,
                "torch": torch.__version__, "zero": zero, "dp": 2, "step": steps, "iteration": engine.global_steps,
                "param_groups": hyper}
        (out / "truth.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        (out / "megatron_args.json").write_text(json.dumps(megatron_args(fixture), indent=1) + "\n")
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


def megatron_args(fixture) -> dict:
    """What a user converting this run to Megatron gives (args=FILE): Megatron-LM's arguments under its names and
    the scheduler state its load_checkpoint restores (this run kept a constant learning rate: no warmup, no decay)."""
    layers = fixture.LAYERS
    return {
        "args": {"num_layers": layers, "hidden_size": fixture.HIDDEN, "ffn_hidden_size": fixture.FFN,
                 "num_attention_heads": fixture.HEADS, "group_query_attention": True,
                 "num_query_groups": fixture.GROUPS, "kv_channels": fixture.HIDDEN // fixture.HEADS,
                 "padded_vocab_size": fixture.VOCAB, "max_position_embeddings": fixture.SEQ,
                 "seq_length": fixture.SEQ, "normalization": "RMSNorm", "norm_epsilon": fixture.NORM_EPS,
                 "swiglu": True, "add_bias_linear": False, "position_embedding_type": "rope",
                 "rotary_base": fixture.ROPE_BASE, "untie_embeddings_and_output_weights": True,
                 "transformer_impl": "local", "bf16": True, "fp16": False, "optimizer": "adam", "lr": LR,
                 "min_lr": LR, "weight_decay": WEIGHT_DECAY, "adam_beta1": 0.9, "adam_beta2": 0.95,
                 "adam_eps": 1e-8, "clip_grad": 1.0, "grad_reduce_in_fp32": True, "micro_batch_size": fixture.MICRO,
                 "global_batch_size": fixture.MICRO * 2, "train_iters": 10},
        "opt_param_scheduler": {"max_lr": LR, "min_lr": LR, "lr_warmup_steps": 0, "lr_decay_steps": 10,
                                "lr_decay_style": "constant", "num_steps": STEPS * fixture.MICRO * 2,
                                "start_wd": WEIGHT_DECAY, "end_wd": WEIGHT_DECAY, "wd_incr_steps": 10,
                                "wd_incr_style": "constant"}}


if __name__ == "__main__":
    sys.exit(main())
