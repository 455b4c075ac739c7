"""verl's FSDP checkpoints: global_step_N/<role>/ with one model, optimizer and extra-state torch.save file per rank."""
