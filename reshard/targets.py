"""What a writer asks for: target files, and for every tensor in them, where its elements come from.

A writer (in reshard/formats/) describes each target file as an object tree holding `NewTensor`
slots, plus, per slot, a list of `Piece`s laid end to end: a run of elements of one source
logical tensor, or a constant (padding zeros, a step counter). The planner turns pieces into
byte copies; the executor performs them. Nothing here reads or writes a file.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reshard.formats.torchsave import NewTensor


@dataclass(frozen=True)
class Piece:
    count: int                    # elements
    source: tuple | None = None   # (name, state) of a logical tensor; None for a constant
    start: int = 0                # first element taken from the source tensor (flat, row-major)
    value: float = 0              # the constant, when source is None

    @staticmethod
    def zeros(count: int) -> "Piece":
        return Piece(count)


@dataclass
class TensorFile:
    """A torch.save file: pickle `tree`; storage bytes of each slot from its pieces."""
    path: str                                    # relative to the target directory
    archive: str                                 # the zip's top folder (torch uses the file stem)
    tree: object
    slots: list = field(default_factory=list)    # NewTensor, in storage order
    pieces: dict = field(default_factory=dict)   # slot key -> [Piece]

    def slot(self, dtype: str, shape: tuple, pieces: list) -> NewTensor:
        """A new tensor of this file filled from `pieces` (which must add up to its size)."""
        tensor = NewTensor(str(len(self.slots)), dtype, tuple(shape))
        total = sum(p.count for p in pieces)
        if total != tensor.numel:
            raise AssertionError(f"{self.path}: pieces hold {total} elements for a tensor of {tensor.numel}")
        self.slots.append(tensor)
        self.pieces[tensor.key] = pieces
        return tensor


@dataclass
class TextFile:
    path: str
    text: str


@dataclass
class CopiedFile:
    """A file taken over unchanged (DeepSpeed's zero_to_fp32.py script)."""
    path: str
    source: str
