"""Resume a DeepSpeed conversion of a Megatron torch_dist save in the real DeepSpeed engine around megatron-core's
own GPTModel (torchrun, gloo, CPU; 2 ranks, tp=1, pp=1).

    torchrun --nproc_per_node 2 tests/scripts/megatron_deepspeed_load.py JOBS.json RESULTS.json

JOBS.json lists {"label", "checkpoint": a DeepSpeed save dir written by `convert --format deepspeed --names
megatron-core-modules`, "truth": the Megatron fixture's truth.safetensors, "zero": the ZeRO stage}. Every rank builds
the fixtures' GPTModel (tools/fixture_megatron_core.py) at tp=1, pp=1, hands it to `deepspeed.initialize` with bf16,
that ZeRO stage and torch's AdamW in megatron-core's two param groups (weight decay, and none for one-dimensional
params), and calls the ordinary `engine.load_checkpoint(dir)`. The engine's fp32 masters, both moments and module
weights (tests/helpers/engine_state.py) are compared with the truth bit for bit under the module's names, and one more
training step runs through the engine. Rank 0 writes {"label", "problems", "error", "step", "losses", "moved"} per
job: `error`, what load_checkpoint raised where it failed (its start, on one line).
"""
import json
import re

from tests.helpers.rank_main import run_main

# the torch_dist names of a layer's norms -> the local spec's modules
# (reshard/layouts/module-names/megatron-core-modules.json)
RENAMES = ((re.compile(r"(.*\.layers\.\d+)\.self_attention\.linear_qkv\.layer_norm_(weight|bias)"),
            r"\1.input_layernorm.\2"),
           (re.compile(r"(.*\.layers\.\d+)\.mlp\.linear_fc1\.layer_norm_(weight|bias)"), r"\1.pre_mlp_layernorm.\2"))


def module_name(name: str) -> str:
    for pattern, template in RENAMES:
        if pattern.fullmatch(name):
            return pattern.sub(template, name)
    return name


def main(jobs_path, results_path):
    import megatron_cpu
    megatron_cpu.install()

    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu, tensor_parallel
    from safetensors.torch import load_file

    import fixture_megatron_core as fixture
    from tests.helpers.engine_state import engine_tensors

    deepspeed.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(1, 1)
    results = []
    for job in json.loads(open(jobs_path).read()):
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        model = fixture.gpt_model(fixture.transformer_config(1, 1))
        named = list(model.named_parameters())
        groups = [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.01},
                  {"params": [p for _, p in named if p.dim() == 1], "weight_decay": 0.0}]
        config = {"train_micro_batch_size_per_gpu": fixture.MICRO, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10**9, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": job["zero"]},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": 0.01, "torch_adam": True}}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        out = {"label": job["label"], "problems": [], "error": None}
        try:
            path, _ = engine.load_checkpoint(job["checkpoint"])
        except Exception as e:      # the negative control: names the model does not hold
            out["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:600]
            results.append(out)
            engine.destroy()
            continue
        if path is None:
            out["problems"].append("load_checkpoint found nothing to load")
        got = {k: v for k, v in engine_tensors(engine, model).items() if "_extra_state" not in k}
        if dist.get_rank() == 0:
            truth = {f"{k.split('/', 1)[0]}/{module_name(k.split('/', 1)[1])}": v
                     for k, v in load_file(job["truth"]).items()}
            for key in sorted(set(truth) | set(got)):
                if key not in got or key not in truth:
                    out["problems"].append(f"{key}: {'not loaded' if key not in got else 'not in the truth'}")
                elif got[key].dtype != truth[key].dtype or not torch.equal(got[key], truth[key]):
                    out["problems"].append(f"{key}: differs from the truth")
        out["step"] = engine.global_steps
        before = [p.detach().clone() for p in model.parameters()]
        generator = torch.Generator().manual_seed(11 + dist.get_rank())
        tokens = torch.randint(0, fixture.VOCAB, (fixture.MICRO, fixture.SEQ + 1), generator=generator)
        position_ids = torch.arange(fixture.SEQ).unsqueeze(0).expand(fixture.MICRO, fixture.SEQ)
        loss = engine(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        engine.backward(loss)
        engine.step()
        out["losses"] = [float(loss)]
        out["moved"] = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
        out["step_after"] = engine.global_steps
        results.append(out)
        engine.destroy()
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main, 2)
