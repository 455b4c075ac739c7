"""How a file of tensors is laid out around its storages: the one protocol every container implements.

A container (torch.save's zip, DCP's `.distcp`, safetensors: reshard.formats.containers lists them) is a
frozen dataclass whose fields are its typed options. The core knows it only through this protocol: a write
request (write_requests.TensorFile.container) hands one to the planner, the plan carries it to the executor.

Call order:
1. `file_size(header, storages)`: the exact bytes of the file on disk, known before any byte is written
   (the planner checks free space and DCP writes its `.metadata` from it);
2. the executor opens a stream for the file (reshard.storage: written front to back, never seeked), then
   `with container.writer(stream, header, storages) as w:`, and for each storage in `storages`' order
   `with w.storage(key, nbytes) as out:` writes exactly `nbytes` bytes into `out`;
3. leaving `w` writes the container's tail; the stream then holds exactly `file_size` bytes.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import BinaryIO, ClassVar, Protocol


class SizedStorage(Protocol):
    """A storage to be written: its key inside the file and its byte count (NewTensor, StoragePlan)."""

    @property
    def key(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


class StorageStream(Protocol):
    """Where one storage's bytes are streamed in."""

    def write(self, data: bytes | bytearray | memoryview) -> int: ...


class ContainerWriter(Protocol):
    """One open file of a container: its storages streamed in, in order (see the module's call order)."""

    def __enter__(self) -> ContainerWriter: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None: ...

    def storage(self, key: str, nbytes: int) -> AbstractContextManager[StorageStream]: ...


class Container(Protocol):
    """A file layout: `name` says which (reshard.formats.containers.CONTAINERS); its fields are its options."""
    name: ClassVar[str]

    def file_size(self, header: bytes, storages: Sequence[SizedStorage]) -> int: ...

    def writer(self, out: BinaryIO, header: bytes, storages: Sequence[SizedStorage]) -> ContainerWriter: ...
