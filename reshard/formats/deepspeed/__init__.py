"""DeepSpeed checkpoints (save dir with `latest`, tag folders of per-rank torch.save files)."""
