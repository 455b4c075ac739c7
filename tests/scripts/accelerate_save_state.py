"""Accelerate's save_state with automatic checkpoint naming, one process on CPU (no DeepSpeed, no FSDP).

    python tests/scripts/accelerate_save_state.py PROJECT_DIR STEPS

A Linear layer, AdamW and a LambdaLR prepared by Accelerator(cpu=True); one save_state() after each of STEPS
steps: PROJECT_DIR/checkpoints/checkpoint_0 .. checkpoint_{STEPS-1}, each model.safetensors, optimizer.bin,
scheduler.bin and random_states_0.pkl. A process of its own: Accelerate's state is process-global.
"""
import sys


def main(project_dir: str, steps: int) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project_dir,
                                                                            automatic_checkpoint_naming=True))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for _ in range(steps):
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.save_state()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
