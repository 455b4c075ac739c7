"""Catalog x target files -> Plan: every target byte tied to its source bytes. Pure: no I/O.

The target format's writer lists the files and, for each tensor in them, the pieces of source
logical tensors it holds. Intersecting each piece with the source fragments of that tensor gives
copy operations (source file and byte offset -> target storage and element offset). A Plan is data:
it can be printed, saved as JSON, or split among workers.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from reshard.core.catalog import Catalog, TensorKey
from reshard.core.container import Container
from reshard.core.dtypes import itemsize
from reshard.core.geometry import offset, span, strides
from reshard.core.layout import Layout
from reshard.core.locate import BoxHit, Locator
from reshard.core.placement import Index
from reshard.core.storage_ref import StorageRef
from reshard.core.write_requests import CopiedFile, Output, Piece, RawPiece, StageCut, TensorFile, TextFile
from reshard.errors import ReshardError


@dataclass(frozen=True)
class Copy:
    dst: int            # first target element (within its storage)
    count: int          # elements
    src_file: str
    src_offset: int     # byte offset of the first source element in src_file
    src_dtype: str


@dataclass(frozen=True)
class BoxCopy:
    """One box of a Gather: its first element and shape in the target shard, and in the source the byte
    offset of its first element and the strides (in elements) of the shard holding it."""
    local: Index
    shape: Index
    src_file: str
    src_offset: int
    src_strides: Index
    src_dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Gather:
    """Target elements [dst, dst + count) are the flat range [start, start + count) of a row-major shard of
    `shape`, assembled from boxes (tensor-parallel slices, DCP chunks, whatever cut the source)."""
    dst: int
    count: int
    shape: Index
    start: int
    copies: tuple[BoxCopy, ...]


@dataclass(frozen=True)
class Fill:
    dst: int
    count: int
    value: float


# One operation filling a run of a target storage's elements
Op = Copy | Gather | Fill


@dataclass(frozen=True)
class StoragePlan:
    key: str
    dtype: str
    shape: tuple[int, ...]
    ops: tuple[Op, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class FilePlan:
    path: str                    # relative to the target directory
    container: Container         # what lays the file out, with its options (reshard.core.container)
    header: bytes                # the bytes the container puts before the storages
    storages: tuple[StoragePlan, ...] = ()
    size: int = 0                # bytes of the file on disk: storages, header and the container's framing

    @property
    def nbytes(self) -> int:
        """Tensor bytes (what the copies fill; progress counts these)."""
        return sum(s.nbytes for s in self.storages)

    def source_files(self) -> set[str]:
        """The source files its copies read."""
        return {path for s in self.storages for op in s.ops for path, _, _ in _spans(op)}

    def source_reads(self) -> dict[str, list[tuple[int, int]]]:
        """{source file: the byte ranges [start, stop) its copies read, sorted}: what a storage that pays per
        request may fetch together where they meet."""
        out: dict[str, list[tuple[int, int]]] = {}
        for s in self.storages:
            for op in s.ops:
                for path, start, stop in _spans(op):
                    out.setdefault(path, []).append((start, stop))
        return {path: sorted(ranges) for path, ranges in out.items()}


@dataclass(frozen=True)
class Plan:
    source: str
    source_layout: Layout
    target: Layout
    tag: str
    files: tuple[FilePlan, ...] = ()
    texts: tuple[TextFile, ...] = ()
    copied: tuple[CopiedFile, ...] = ()
    save_dir: str | None = None                    # the source's save dir (None: source's parent)
    stage_cut: StageCut | None = None              # a pipeline target's stage boundaries
    output: Output | None = None                   # what the writer says it writes (None: its Layout's terms)
    checked: tuple[StorageRef, ...] = ()           # the checksummed source storages the copies read (checksums)

    @property
    def bytes_written(self) -> int:
        """Bytes of every file the output will hold (the manifest, written last, aside)."""
        return sum(f.size for f in self.files) + sum(t.size for t in self.texts) + sum(c.size for c in self.copied)

    @property
    def bytes_read(self) -> int:
        return sum(n * itemsize(dtype) for f in self.files for s in f.storages for n, dtype in _reads(s.ops))

    def reread(self) -> dict[str, list[tuple[int, int]]]:
        """{source file: sorted, merged byte ranges [start, stop) the plan reads more than once} — a replicated
        tensor every target rank copies, a sparse box's neighbours: the executor keeps those pages cached."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for f in self.files:
            for s in f.storages:
                for op in s.ops:
                    for path, start, stop in _spans(op):
                        spans.setdefault(path, []).append((start, stop))
        out = {}
        for path, ranges in spans.items():
            twice: list[tuple[int, int]] = []
            reach = 0
            for start, stop in sorted(ranges):
                if start < reach:
                    lo, hi = start, min(reach, stop)
                    if twice and lo <= twice[-1][1]:
                        twice[-1] = (twice[-1][0], max(twice[-1][1], hi))
                    else:
                        twice.append((lo, hi))
                reach = max(reach, stop)
            if twice:
                out[path] = twice
        return out

    def summary(self) -> PlanOutline:
        """What the plan writes and reads, in the writer's own terms (Output), for `plan` and the manifest."""
        output = self.output or Output("", self.target.topology(), self.tag)
        files = (*(PlannedFile(f.path, f.size, len(f.storages), sum(1 for s in f.storages for _ in _reads(s.ops)))
                   for f in self.files),
                 *(PlannedFile(t.path, t.size) for t in self.texts),
                 *(PlannedFile(c.path, c.size, copied_from=c.source) for c in self.copied))
        return PlanOutline(self.source, self.source_layout.topology(), output.format, output.topology, output.tag,
                           files, self.bytes_read, self.bytes_written, self.stage_cut)


@dataclass(frozen=True)
class PlannedFile:
    """One file the conversion writes: a tensor file (with its tensors and copy operations), a small text file, or
    a file copied whole from the source (`copied_from`)."""
    path: str
    bytes: int
    tensors: int | None = None
    copies: int | None = None
    copied_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "bytes": self.bytes}
        if self.tensors is not None:
            data.update(tensors=self.tensors, copies=self.copies)
        if self.copied_from is not None:
            data["copied_from"] = self.copied_from
        return data


@dataclass(frozen=True)
class PlanOutline:
    """A plan's files and totals, its output in the writer's own terms (Output: format, topology, tag)."""
    source: str
    source_topology: str
    format: str
    target_topology: str | None
    tag: str | None
    files: tuple[PlannedFile, ...]
    bytes_read: int
    bytes_written: int
    stage_cut: StageCut | None


def _spans(op: Op) -> Iterator[tuple[str, int, int]]:
    """(source file, first byte, byte past the last) of each read an op makes."""
    if isinstance(op, Copy):
        yield op.src_file, op.src_offset, op.src_offset + op.count * itemsize(op.src_dtype)
    elif isinstance(op, Gather):
        for box in op.copies:
            nbytes = span(box.shape, box.src_strides) * itemsize(box.src_dtype)
            yield box.src_file, box.src_offset, box.src_offset + nbytes


def _reads(ops: Iterable[Op]) -> Iterator[tuple[int, str]]:
    """(elements, source dtype) of each read the ops make."""
    for op in ops:
        if isinstance(op, Copy):
            yield op.count, op.src_dtype
        elif isinstance(op, Gather):
            for box in op.copies:
                yield box.numel, box.src_dtype


def plan(catalog: Catalog, target: Layout, targets: Iterable[TensorFile | TextFile | CopiedFile | StageCut], tag: str,
         output: Output | None = None) -> Plan:
    """`output`: how the writer names what it writes (reshard.formats writer modules' describe())."""
    index = _FragmentIndex(catalog)
    files: list[FilePlan] = []
    texts: list[TextFile] = []
    copied: list[CopiedFile] = []
    stage_cut: StageCut | None = None
    for item in targets:
        if isinstance(item, TensorFile):
            files.append(_plan_file(item, index))
        elif isinstance(item, TextFile):
            texts.append(item)
        elif isinstance(item, CopiedFile):
            copied.append(item)
        elif isinstance(item, StageCut):
            stage_cut = item
        else:
            raise TypeError(f"unknown target item {item!r}")
    return Plan(catalog.root, catalog.layout, target, tag, tuple(files), tuple(texts), tuple(copied),
                save_dir=catalog.save_dir, stage_cut=stage_cut, output=output,
                checked=tuple(s for s in index.read if s.crc is not None))


def joined(main: Plan, parts: Sequence[tuple[str, Plan]]) -> Plan:
    """`main` with each part's files under the part's folder: one output of several models (a verl step's actor and
    critic), one manifest. The parts' text files come before main's, whose own (a tracker naming the step) stay
    last: a pointer names the output only once every model of it is whole."""
    files, texts, copied, checked = list(main.files), [], list(main.copied), list(main.checked)
    for folder, part in parts:
        files += [replace(f, path=os.path.join(folder, f.path)) for f in part.files]
        texts += [replace(t, path=os.path.join(folder, t.path)) for t in part.texts]
        copied += [replace(c, path=os.path.join(folder, c.path)) for c in part.copied]
        checked += part.checked
    return replace(main, files=tuple(files), texts=(*texts, *main.texts), copied=tuple(copied),
                   checked=tuple(checked))


def _plan_file(file: TensorFile, index: _FragmentIndex) -> FilePlan:
    header, container = file.header(), file.container()
    size = container.file_size(header, file.slots)
    storages = []
    for slot in file.slots:
        ops: list[Op] = []
        cursor = 0
        for piece in file.pieces[slot.key]:
            if isinstance(piece, RawPiece):
                index.read[piece.storage] = None
                _append(ops, Copy(cursor, piece.count, piece.storage.file, piece.storage.offset, piece.storage.dtype))
            elif piece.source is None:
                _append(ops, Fill(cursor, piece.count, piece.value))
            else:
                for op in index.ops(piece, cursor, slot.dtype):
                    _append(ops, op)
            cursor += piece.count
        storages.append(StoragePlan(slot.key, slot.dtype, tuple(slot.shape), tuple(ops)))
    return FilePlan(file.path, container, header, tuple(storages), size)


def _append(ops: list[Op], op: Op) -> None:
    """Add an op, merging it into the previous one when they continue each other."""
    if ops:
        last = ops[-1]
        if isinstance(op, Copy) and isinstance(last, Copy) and last.src_file == op.src_file \
                and last.src_dtype == op.src_dtype and last.dst + last.count == op.dst \
                and last.src_offset + last.count * itemsize(last.src_dtype) == op.src_offset:
            ops[-1] = Copy(last.dst, last.count + op.count, last.src_file, last.src_offset, last.src_dtype)
            return
        if isinstance(op, Fill) and isinstance(last, Fill) and last.value == op.value \
                and last.dst + last.count == op.dst:
            ops[-1] = Fill(last.dst, last.count + op.count, last.value)
            return
    ops.append(op)


def _as_runs(hits: Sequence[BoxHit], shape: Index, start: int, count: int) -> list[tuple[int, BoxHit]] | None:
    """The boxes as (position in the request, hit), when each is one run of consecutive elements both in the
    requested shard (of `shape`, the request its elements [start, start + count)) and in its storage, and in
    order they tile the request: then byte copies do what a gather would. Else None."""
    target = strides(shape)
    out = sorted(((offset(h.local, target) - start, h) for h in hits), key=lambda pair: pair[0])
    covered = 0
    for at, h in out:
        if at != covered or not (_one_run(h.shape, target) and _one_run(h.shape, h.strides)):
            return None
        covered += h.numel
    return out if covered == count else None


def _one_run(box: Index, element_strides: Index) -> bool:
    """Are a box's elements, in row-major order, consecutive in storage with these strides?"""
    step = 1
    for n, s in reversed(list(zip(box, element_strides, strict=True))):
        if n == 1:
            continue
        if s != step:
            return False
        step *= n
    return True


class _FragmentIndex:
    """A Locator per logical tensor, made when a target first asks for it."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self._locators: dict[TensorKey | tuple[str, str], Locator] = {}
        self.read: dict[StorageRef, None] = {}      # every source storage an op reads (a dict: in the order first read)

    def _locator(self, key: TensorKey | tuple[str, str]) -> Locator:
        found = self._locators.get(key)
        if found is None:
            tensor = self.catalog.tensors.get(TensorKey(*key))
            if tensor is None:
                raise ReshardError.at(self.catalog.root, f"the source has no {key[1]} for {key[0]}, "
                                                         "which the target needs")
            found = self._locators[key] = Locator(tensor)
        return found

    def ops(self, piece: Piece, dst: int, dtype: str) -> list[Op]:
        """Copy operations filling target elements [dst, dst + piece.count) (of a `dtype` storage) from the
        source: byte runs where the source holds the piece's shard itself, else one Gather of boxes."""
        assert piece.source is not None, "a constant piece has no source"
        locator = self._locator(piece.source)
        tensor = locator.tensor
        stored = tensor.stored_dtype
        if stored != tensor.dtype and dtype != tensor.dtype:
            # a copy casts its source bytes once: the cast to tensor.dtype and on to `dtype` would be two
            raise ReshardError.at(self.catalog.root, f"{piece.source[0]} ({piece.source[1]}) is its {stored} "
                                  f"values cast to {tensor.dtype}; writing it as {dtype} is not supported")
        size = itemsize(stored)
        stop = piece.start + piece.count
        if locator.holds_as(piece.shard):
            ops: list[Op] = []
            covered = 0
            for run in locator.runs(piece.shard, piece.start, stop):
                if run.offset != covered:
                    break
                ops.append(Copy(dst + run.offset, run.count, run.fragment.storage.file,
                                run.fragment.storage.offset + run.elem * size, stored))
                self.read[run.fragment.storage] = None
                covered += run.count
        else:
            hits = locator.boxes(piece.shard, piece.start, stop)
            covered = sum(h.numel for h in hits)
            self.read.update((h.fragment.storage, None) for h in hits)
            shape = piece.shard.shape if piece.shard else tensor.shape
            runs = _as_runs(hits, shape, piece.start, piece.count)
            if runs is not None:        # (a slab of whole rows: an expert of a packed weight, a dim-0 shard)
                ops = [Copy(dst + at, h.numel, h.fragment.storage.file, h.fragment.storage.offset + h.elem * size,
                            stored) for at, h in runs]
            else:
                ops = [Gather(dst, piece.count, shape, piece.start, tuple(
                    BoxCopy(h.local, h.shape, h.fragment.storage.file, h.fragment.storage.offset + h.elem * size,
                            h.strides, stored) for h in hits))]
        if covered != piece.count:
            raise ReshardError.at(self.catalog.root, f"{piece.source[0]} ({piece.source[1]}): "
                                  f"{piece.count - covered} of {piece.count} elements are missing from the source; "
                                  "run `reshard validate`")
        return ops
