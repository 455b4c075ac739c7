"""The documented public path of reshard.live.deepspeed_engine: `reshard.deepspeed_engine.load_checkpoint(engine,
"ckpt/")` loads any checkpoint reshard reads into a live DeepSpeed engine at its own topology."""
from reshard.live.deepspeed_engine import load_checkpoint

__all__ = ["load_checkpoint"]
