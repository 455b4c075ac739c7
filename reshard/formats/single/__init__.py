"""Checkpoints saved by one process: torch.save state dicts, Lightning .ckpt, Hugging Face Trainer
folders and safetensors files. Each reader finds the model state dict (and the torch.optim state
dict, when there is one) and hands them to `model.build`, which turns them into a Catalog.
"""
