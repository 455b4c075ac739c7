"""What a writer asks for: target files, and for every tensor in them, where its elements come from.

A writer (in reshard/formats/) describes each target file as an object tree holding `NewTensor`
slots, plus, per slot, a list of `Piece`s laid end to end: a run of elements of one shard of one
source logical tensor (a TP rank's slice, or the whole tensor), or a constant (padding zeros, a step counter). The
planner turns pieces into byte copies; the executor performs them. Nothing here reads or writes a file.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from reshard.core.catalog import TensorKey
from reshard.core.container import Container
from reshard.core.dtypes import itemsize
from reshard.core.placement import Index, Shard
from reshard.core.storage_ref import StorageRef


@dataclass(frozen=True)
class NewTensor:
    """A tensor to be written: its storage `key` inside the file, element type and shape."""
    key: str
    dtype: str
    shape: Index

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class Piece:
    count: int                    # elements
    source: TensorKey | tuple[str, str] | None = None   # (name, state) of a logical tensor; None for a constant
    start: int = 0                # first element taken, flat in `shard` (row-major)
    value: float = 0              # the constant, when source is None
    shard: Shard | None = None    # which shard of the source tensor (reshard.core.placement); None: the tensor itself

    @staticmethod
    def zeros(count: int) -> Piece:
        return Piece(count)


@dataclass(frozen=True)
class RawPiece:
    """A source storage (StorageRef) copied whole as it lies in its file: a storage that is no logical
    tensor's, carried (a tensor in the client state a writer takes over from the source's pickle)."""
    storage: StorageRef

    @property
    def count(self) -> int:
        return self.storage.numel


# what fills a slot: elements of a logical tensor or a constant, or a source storage as it lies
AnyPiece = Piece | RawPiece


@dataclass(frozen=True)
class TensorFile:
    """A file of tensors: a format-specific header, then each slot's bytes, filled from its pieces.

    Formats subclass it (torchsave_write.TorchFile, safetensors_file.SafetensorsFile): `container()` gives
    the container that lays the file out (reshard.core.container), `header()` the bytes before the storages. A
    writer makes the slots one by one on a TensorFileBuilder, whose `build` gives this record: its slots a tuple,
    its pieces a read-only mapping, so nothing changes a file once the planner may have read it.
    """
    path: str                                    # relative to the target directory
    tree: Any = None                             # what the header describes (a pickled tree, metadata)
    slots: tuple[NewTensor, ...] = ()            # in storage order
    pieces: Mapping[str, tuple[AnyPiece, ...]] = field(default_factory=lambda: MappingProxyType({}))  # by slot key

    def header(self) -> bytes:
        raise NotImplementedError

    def container(self) -> Container:
        raise NotImplementedError


class TensorFileBuilder:
    """A tensor file's slots, made one by one as a writer walks its tensors (the writer's tree holds the slots it
    gets back); a format's builder turns them into its frozen TensorFile (`build`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.slots: list[NewTensor] = []
        self.pieces: dict[str, tuple[AnyPiece, ...]] = {}

    def slot(self, dtype: str, shape: Sequence[int], pieces: Sequence[AnyPiece], key: str | None = None) -> NewTensor:
        """A new tensor of this file filled from `pieces` (which must add up to its size)."""
        tensor = NewTensor(key if key is not None else str(len(self.slots)), dtype, tuple(shape))
        total = sum(p.count for p in pieces)
        if total != tensor.numel:
            raise AssertionError(f"{self.path}: pieces hold {total} elements for a tensor of {tensor.numel}")
        self.slots.append(tensor)
        self.pieces[tensor.key] = tuple(pieces)
        return tensor

    def frozen_pieces(self) -> Mapping[str, tuple[AnyPiece, ...]]:
        """The pieces of the slots made so far, read-only (a copy: a later slot is not in it)."""
        return MappingProxyType(dict(self.pieces))


@dataclass(frozen=True)
class TextFile:
    """A small file written whole after every tensor file (a commit marker: `latest`, DCP's
    `.metadata`); `text` is str, or bytes for a binary one."""
    path: str
    text: str | bytes

    @property
    def size(self) -> int:
        """Bytes on disk (a str is written as UTF-8)."""
        return len(self.text.encode() if isinstance(self.text, str) else self.text)


@dataclass(frozen=True)
class CopiedFile:
    """A file taken over unchanged (DeepSpeed's zero_to_fp32.py script)."""
    path: str
    source: str
    size: int           # of the source, taken when the writer chose it


@dataclass(frozen=True)
class Output:
    """What a writer says it writes, in its format's own terms: `topology` as the format states one
    (None for a consolidated file), `tag` where the format has tags (None where it has none)."""
    format: str
    topology: str | None = None
    tag: str | None = None

    def words(self) -> str:
        """e.g. 'deepspeed dp=4,tp=1,pp=1,zero=2, tag global_step3', 'dcp dp=2', 'safetensors'."""
        head = f"{self.format} {self.topology}" if self.topology else self.format
        return f"{head}, tag {self.tag}" if self.tag else head


@dataclass(frozen=True)
class StageCut:
    """How a pipeline target's layers are cut into stages, for plan and convert to show: the partition
    `method`, each stage's layer range [first, stop), and `ambiguous`, when the source could not tell the
    method, the one line saying which was taken and that `partition=` decides it."""
    method: str
    stages: tuple[tuple[int, int], ...]   # (first, stop) per stage
    ambiguous: str | None = None

    def line(self) -> str:
        ranges = (f"layers {a}-{b - 1}" if b - a > 1 else f"layer {a}" if b > a else "no layers"
                  for a, b in self.stages)
        return f"{self.method!r} partition: " + ", ".join(f"stage {s} {r}" for s, r in enumerate(ranges))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "stages": [list(r) for r in self.stages], "ambiguous": self.ambiguous}


# What a writer's target_files lists: the output's files, and for a pipeline target how its stages are cut
WriteRequest = TensorFile | TextFile | CopiedFile | StageCut
