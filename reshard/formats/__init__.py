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
