"""Megatron-core checkpoints (Megatron-LM save dirs of the torch_dist format): reader.py."""
