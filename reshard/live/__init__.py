"""Loading without converting: a live DeepSpeed engine's load_checkpoint at its own topology (deepspeed_engine), any
checkpoint served to PyTorch DCP as a StorageReader (storage_reader), and planned files built in memory
(materialize)."""
