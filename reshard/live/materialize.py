"""A planned file built in memory instead of on disk: the object loading the written file would give,
its storages read from the source straight into the tensors' memory. No file, no archive framing, no
checksum: reshard.deepspeed_engine.load_checkpoint hands these to DeepSpeed's loader.
"""
from __future__ import annotations

from reshard.core.planner import FilePlan
from reshard.execution.target_bytes import SourceFiles, fill
from reshard.formats import container_loader


def materialize(file: FilePlan, sources: SourceFiles, place=None):
    """The contents of `file` (a FilePlan whose container a process can load in memory), built now.
    `place`: storage -> storage, what torch.load's map_location does (None: left in CPU memory)."""
    import torch

    by_key = {s.key: s for s in file.storages}
    made = {}

    def storage_of(key: str):
        if key not in made:     # a storage two tensors share (tied weights) is made once
            storage = by_key[key]
            memory = torch.empty(storage.nbytes, dtype=torch.uint8)
            fill(storage, memory.numpy(), sources)
            made[key] = memory.untyped_storage() if place is None else place(memory.untyped_storage())
        return made[key]

    return container_loader(file.container)(file.header, storage_of)
