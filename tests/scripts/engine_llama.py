"""Train a tiny random Hugging Face Llama with the real DeepSpeed engine and save it (run under torchrun).

    torchrun --nproc_per_node 2 tests/scripts/engine_llama.py JOBS.json RESULTS.json

JOBS.json lists {"out": OUT, "stage": STAGE, "dtype": "fp32" | "bf16"}, run in order in one process. Each writes
OUT/checkpoint (DeepSpeed save dir), and from rank 0 OUT/hf_config/config.json and OUT/logits.pt: the engine
model's logits on a fixed input after training, for comparison with `LlamaForCausalLM.from_pretrained` of an
export. Rank 0 writes the jobs back as RESULTS.json, once every job is done.
"""
import json
import os

from tests.helpers.rank_main import run_main
from tests.helpers.tiny_llama import TOKENS, config, probe


def main(jobs_path, results_path):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        train_and_save(job["out"], job["stage"], job["dtype"])
    if deepspeed.comm.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(jobs, f)


def train_and_save(out, stage, dtype):
    import gc

    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
                 "zero_optimization": {"stage": int(stage)}}
    if dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        ids = torch.randint(0, TOKENS, (2, 12), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(os.path.join(out, "checkpoint"))
    engine.module.eval()
    with torch.no_grad():
        logits = engine.module(input_ids=probe()).logits
    if rank == 0:
        engine.module.config.save_pretrained(os.path.join(out, "hf_config"))
        torch.save(logits.detach().cpu(), os.path.join(out, "logits.pt"))
    deepspeed.comm.barrier()
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model
    gc.collect()


if __name__ == "__main__":
    run_main(main, 2)
