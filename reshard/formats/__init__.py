"""File formats. Only this package knows file names, keys and byte layouts.

A reader module has `sniff(path, tag) -> bool` (is this checkpoint mine? from names and magic
bytes only) and `read(path, tag) -> Catalog`; one that can use tensor-parallel layout rules sets
`TAKES_LAYOUT_RULES = True` and takes `read(path, tag, layout_rules)`. A writer module has
`target_files(catalog, layout, tag, source_save_dir) -> [target files]`,
`batch_size_advice(catalog, layout) -> str | None` and `describe(layout, tag) -> targets.Output`
(what it writes, in its own terms).
"""
from __future__ import annotations

import importlib
import os

from reshard.errors import ReshardError, UsageError

# Tried in order; the first whose sniff() accepts the path reads it.
READERS = ["reshard.formats.deepspeed.universal_reader",   # latest_universal, zero/ trees
           "reshard.formats.deepspeed.reader",
           "reshard.formats.dcp.reader",                 # .metadata + *.distcp
           "reshard.formats.single.hf_trainer",          # checkpoint-N/ with trainer_state.json
           "reshard.formats.single.safetensors_reader",  # *.safetensors, index, save_pretrained folders
           "reshard.formats.single.lightning",           # *.ckpt
           "reshard.formats.single.torchfile"]           # *.pt, *.pth, *.bin
# Target formats of `convert --format`.
WRITERS = {"deepspeed": "reshard.formats.deepspeed.writer", "universal": "reshard.formats.deepspeed.universal_writer",
           "dcp": "reshard.formats.dcp.writer"}


def read(path: str, tag: str | None = None, layout_rules: str | None = None):
    """The Catalog of the checkpoint at `path`, whatever its format. `layout_rules`: a tensor-parallel
    rule file (layouts/*.json) for checkpoints that do not say how their tensors were cut."""
    if not os.path.exists(path):
        raise ReshardError.at(path, "no such file or directory")
    for name in READERS:
        module = importlib.import_module(name)
        if module.sniff(path, tag):
            if not layout_rules:
                return module.read(path, tag)
            if not getattr(module, "TAKES_LAYOUT_RULES", False):
                raise UsageError.at(path, "layout rules (--layout-rules) say how tensor parallelism cut a DeepSpeed "
                                          "checkpoint that does not record it; this checkpoint's format takes none")
            return module.read(path, tag, layout_rules)
    raise ReshardError.at(path, "not a checkpoint reshard can read (supported: DeepSpeed ZeRO, universal and "
                                "tag folders, PyTorch DCP directories, torch.save .pt/.pth/.bin, Lightning .ckpt, "
                                "Hugging Face Trainer checkpoint folders, safetensors)")


def writer(format_name: str):
    """The writer module of a target format."""
    if format_name not in WRITERS:
        raise ReshardError(f"no writer for format {format_name!r} (known: {', '.join(WRITERS)})")
    return importlib.import_module(WRITERS[format_name])


def container_writer(container: str):
    """The class that lays out a file of tensors: (path, header, storages, **options), storage(key, nbytes)."""
    if container == "torch":
        from reshard.formats.torchsave import TorchZipWriter
        return TorchZipWriter
    if container == "distcp":
        from reshard.formats.dcp.chunkzip import DistcpWriter
        return DistcpWriter
    if container == "safetensors":
        from reshard.formats.safetensors_file import SafetensorsWriter
        return SafetensorsWriter
    raise ReshardError(f"no writer for {container!r} files")
