"""File formats. Only this package knows file names, keys and byte layouts."""
from __future__ import annotations

from reshard.errors import ReshardError


def read(path: str, tag: str | None = None):
    """The Catalog of the checkpoint at `path`, whatever its format."""
    from reshard.formats.deepspeed import files, reader

    import os
    if not os.path.exists(path):
        raise ReshardError(f"{path}: no such file or directory")
    if os.path.isdir(path) and (files.is_deepspeed_dir(path) or tag is not None):
        return reader.read(path, tag)
    raise ReshardError(f"{path}: not a checkpoint reshard can read (supported: DeepSpeed ZeRO save or tag folders)")


def writer(format_name: str):
    """The module that lays out target files for a format: `target_files(catalog, layout, tag, save_dir)`."""
    if format_name == "deepspeed":
        from reshard.formats.deepspeed import writer as deepspeed_writer
        return deepspeed_writer
    raise ReshardError(f"no writer for format {format_name!r}")


def container_writer(container: str):
    """The class that lays out a file of tensors: (path, header, storages, **options), storage(key, nbytes)."""
    if container == "torch":
        from reshard.formats.torchsave import TorchZipWriter
        return TorchZipWriter
    if container == "safetensors":
        from reshard.formats.safetensors_file import SafetensorsWriter
        return SafetensorsWriter
    raise ReshardError(f"no writer for {container!r} files")
