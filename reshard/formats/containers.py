"""The containers reshard writes files in, by name: the one registry for convert's writers and export.

Each one implements reshard.core.container.Container (exact file size, streaming writer) as a frozen dataclass
of its options; a write request (a TensorFile) says which by returning one from `container()`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reshard.core.container import Container
from reshard.formats.dcp.chunkzip import Distcp
from reshard.formats.safetensors_file import Safetensors, SafetensorsFile
from reshard.formats.torchsave_write import TorchFile, TorchZip, load_tree


@dataclass(frozen=True)
class Registered:
    """A container and what else reshard does with its files."""
    container: type[Container]          # the Container class
    # the TensorFile of a state dict export writes (reshard.export), if any
    exported_as: type[SafetensorsFile] | type[TorchFile] | None = None
    loader: Callable | None = None      # (header, storage_of) -> what loading the file gives (reshard.live.materialize)


CONTAINERS = {c.container.name: c for c in (Registered(TorchZip, TorchFile, load_tree), Registered(Distcp),
                                            Registered(Safetensors, SafetensorsFile))}
# export's formats: each one's file type (from_entries, STEM, EXTENSION, SUFFIXES), safetensors first (the default)


def _exported_as(name: str) -> type[SafetensorsFile] | type[TorchFile]:
    file_type = CONTAINERS[name].exported_as
    if file_type is None:
        raise AssertionError(f"container {name} has no export file type")
    return file_type


EXPORTS = {name: _exported_as(name) for name in ("safetensors", "torch")}
