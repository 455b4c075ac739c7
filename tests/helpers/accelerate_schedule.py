"""The lr the Accelerate runs' scheduler gives (tests/scripts/accelerate_deepspeed.py, accelerate_strategies.py:
transformers' linear schedule with 2 warm-up steps), computed here with the same schedule."""
from __future__ import annotations


def scheduled_lr(steps: int, training_steps: int = 10) -> float:
    """The lr of the run's scheduler (linear over `training_steps`) after `steps` steps (Accelerate steps it once
    per process per step)."""
    import torch
    from transformers import get_linear_schedule_with_warmup
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=training_steps)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]
