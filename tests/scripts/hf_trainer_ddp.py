"""A 2-process DDP transformers.Trainer run (torchrun, CPU, gloo), given the tiny tokenizer of single_models: the
Trainer saves OUT/run/checkpoint-3/ (model.safetensors, optimizer.pt, rng_state_0.pth and rng_state_1.pth, config,
tokenizer), and rank 0 the live model's state dict at the end as OUT/truth.safetensors.

    torchrun --nproc_per_node 2 tests/scripts/hf_trainer_ddp.py OUT
"""
import os

from tests.helpers.rank_main import run_main


def main(out):
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from tests.helpers import single_models as sm
    torch.set_num_threads(1)
    model, trainer = sm.train_hf(os.path.join(out, "run"), tokenizer=sm.tiny_tokenizer())
    assert trainer.args.world_size == 2, trainer.args.world_size
    if dist.get_rank() == 0:
        # each a copy of its own: the tied head is saved as a tensor too
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                  os.path.join(out, "truth.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    run_main(main)
