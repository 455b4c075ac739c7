"""Hugging Face Trainer runs with FSDP or DDP (torchrun, CPU, gloo; tests/helpers/cpu_fsdp.py lets Accelerate use FSDP
on CPU).

    torchrun --nproc_per_node 2 tests/scripts/hf_trainer_fsdp.py JOB.json RESULT.json

JOB.json is {"runs": [{"out": dir, "state_dict_type": "SHARDED_STATE_DICT" | "FULL_STATE_DICT" | null (DDP),
                       "max_steps": N, "save_steps": K, "tokenizer": true (optional: the Trainer's
                       processing_class, single_models.tiny_tokenizer), "config": {LlamaConfig overrides}
                       (optional)}, ...]}: one Trainer run per entry, one
after the other in the same processes (Accelerate's state is reset between them), a tiny random Llama trained to
max_steps and saved every save_steps, each checkpoint-N/ as the Trainer writes it on GPUs. Rank 0 writes
{"runs": [{"out": dir, "distributed_type": ..., "global_step": ...}]} to RESULT.json.
"""
import json
import os

from tests.helpers.cpu_fsdp import fsdp_on_cpu
from tests.helpers.rank_main import run_main


def main(job_path, result_path):
    import torch
    from accelerate.state import AcceleratorState
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    fsdp_on_cpu()
    done = []
    for run in job["runs"]:
        AcceleratorState._reset_state()     # each run's Trainer gives its own FSDP plugin
        for name in [n for n in os.environ if n == "ACCELERATE_USE_FSDP" or n.startswith("FSDP_")]:
            del os.environ[name]            # what TrainingArguments exported for the run before
        torch.manual_seed(0)
        config = LlamaConfig(**{"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32,
                                **run.get("config", {})})
        model = LlamaForCausalLM(config)
        tokens = torch.randint(0, config.vocab_size, (16, 8), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": t, "labels": t} for t in tokens]
        fsdp = {} if run["state_dict_type"] is None else {
            "fsdp": True, "fsdp_config": {"state_dict_type": run["state_dict_type"],
                                          "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
        args = TrainingArguments(output_dir=run["out"], max_steps=run["max_steps"], save_steps=run["save_steps"],
                                 per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[],
                                 disable_tqdm=True, seed=0, **fsdp)
        tokenizer = None
        if run.get("tokenizer"):
            from tests.helpers.single_models import tiny_tokenizer
            tokenizer = tiny_tokenizer()
        trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        done.append({"out": run["out"], "distributed_type": str(trainer.accelerator.distributed_type),
                     "fsdp": trainer.is_fsdp_enabled, "global_step": trainer.state.global_step})
    if torch.distributed.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump({"runs": done}, f)


if __name__ == "__main__":
    run_main(main, 2)
