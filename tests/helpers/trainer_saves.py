"""The HF Trainer's DeepSpeed ZeRO-2 run at 2 processes (tests/scripts/hf_trainer_strategies.py): one shared launch,
whose checkpoint and live-engine truth both the strategy moves (tests/formats/framework/test_hf_fsdp_deepspeed.py)
and the thin tests (tests/commands/test_thin_fsdp.py) come after."""
from __future__ import annotations

from tests.helpers.engine_launches import shares

SAVE = 3        # the step the run saves at


@shares("hf_trainer_strategies.py")
def deepspeed_trainer_saves(out):
    """The DeepSpeed ZeRO-2 run at 2 processes: (2, None, job)."""
    return [(2, None, {"mode": "save", "strategy": "deepspeed", "stage": 2, "out": str(out / "ds" / "run"),
                       "max_steps": SAVE, "save_steps": SAVE, "truth": str(out / "ds" / "truth.safetensors")})]
