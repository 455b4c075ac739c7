"""Catalog x target Layout -> a DCP directory that `torch.distributed.checkpoint.load` reads.

Keys are those `get_state_dict(model, optimizer)` gives (keys.py). A tied name's chunks point at its
holder's bytes: torch loads both keys from them, and our reader recognises the tie (a real FSDP save
writes the bytes twice and the tie is lost). Every tensor is cut along dim 0 the way FSDP2 shards it
over the target's dp ranks, rank r's chunks in `__r_0.distcp`; values go to rank 0's file. `.metadata`,
DCP's commit marker, is written last by the executor (texts follow the data files).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

from reshard.core.catalog import Catalog, ScalarTensor
from reshard.core.dtypes import itemsize
from reshard.core.geometry import chunks
from reshard.core.layout import Layout
from reshard.core.write_requests import NewTensor, Output, Piece, TensorFile, TensorFileBuilder, TextFile
from reshard.errors import ReshardError
from reshard.formats.dcp import keys, metadata as md
from reshard.formats.dcp.chunks import METADATA
from reshard.formats.dcp.chunkzip import CHUNK, CHUNK_LIMIT, VALUE, Archive, Distcp, Item
from reshard.formats.torchsave_read import Size, TensorRef
from reshard.formats.torchsave_write import pickle_tree


@dataclass(frozen=True)
class DistcpFile(TensorFile):
    """A `.distcp` file: items (tensor chunks and pickled values) end to end, each a torch.save zip."""
    items: tuple[Item, ...] = ()
    fixed: tuple[bytes, ...] = ()                # each item's fixed bytes

    def header(self) -> bytes:
        return b"".join(self.fixed)

    def container(self) -> Distcp:
        return Distcp(tuple(self.items))


class DistcpFileBuilder(TensorFileBuilder):
    """A `.distcp` file's items added one by one, each at the offset the previous ones end at; `build()` gives
    the frozen DistcpFile."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.items: list[Item] = []
        self.fixed: list[bytes] = []
        self.end = 0                # where the last item ends: the next one's offset

    def add_chunk(self, dtype: str, shape: tuple, pieces: list) -> tuple:
        slot = self.slot(dtype, shape, pieces)
        data_pkl, length = _chunk_archive(dtype, tuple(shape))
        return self._append(CHUNK, slot.key, data_pkl, length)

    def add_value(self, value) -> tuple:
        blob = Archive(pickle_tree(value)).whole()
        return self._append(VALUE, None, blob, len(blob))

    def add_blob(self, blob: bytes) -> tuple:
        """A value item copied as it lies in a source file (a torch.save archive, never unpickled here)."""
        return self._append(VALUE, None, blob, len(blob))

    def _append(self, kind, key, fixed: bytes, length: int) -> tuple:
        self.items.append(Item(kind, key, len(fixed)))
        self.fixed.append(fixed)
        offset, self.end = self.end, self.end + length
        return offset, length

    def build(self) -> DistcpFile:
        return DistcpFile(self.path, None, tuple(self.slots), self.frozen_pieces(), tuple(self.items),
                          tuple(self.fixed))


@functools.lru_cache(maxsize=4096)
def _chunk_archive(dtype: str, shape: tuple) -> tuple[bytes, int]:
    """(data.pkl, archive length) of a chunk: the same for every chunk of one dtype and shape (a large save has
    thousands), so pickled once."""
    data_pkl = pickle_tree(NewTensor("0", dtype, shape))
    return data_pkl, Archive(data_pkl, math.prod(shape) * itemsize(dtype)).length


def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


PLACES_EXPERTS = False     # experts go in as one model's params only: convert --names (reshard.rules.module_names)
RESUMED_BY_FRAMEWORKS = False
SAVES_OWN_NAMES = False
OWN_RANK_STATE = False

def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    check_target(target)
    tensors = [(entry, keys.planner_path(entry.key)) for entry in keys.tensor_entries(catalog)]
    return folder_files(catalog, target.dp, tag, "", tensors, list(keys.value_entries(catalog)))


def check_target(target: Layout) -> None:
    if target.tp != 1 or target.pp != 1:
        raise ReshardError(f"target {target.topology()}: DCP output is written for data-parallel ranks only")


def folder_files(catalog: Catalog, dp: int, tag: str, folder: str, tensors: list, values: list,
                 blobs: tuple | list = ()) -> list:
    """The files of one DCP folder (`folder` under the output; "": the output itself) at `dp` ranks holding
    `tensors` ([(keys.TensorEntry, its planner_data path)]), `values` (keys.ValueEntry) and `blobs` ([(key, planner
    path, a value item's bytes as a source saved it)], copied as they are), under their keys."""
    files = [DistcpFileBuilder(os.path.join(folder, file_name(r))) for r in range(dp)]
    out = MetadataBuilder()
    # source (name, state) -> its chunks' locations, for a tied name to share
    written: dict[tuple[str, str], Any] = {}
    for entry, path in tensors:
        key, source, shape, dtype = entry.key, entry.source, entry.shape, entry.dtype
        if entry.name in catalog.aliases and source in written:
            for chunk in written[source]:        # the same bytes: the reader sees the tie again
                out.chunk(key, path, shape, dtype, *chunk)
            continue
        written[source] = []
        # FSDP2 replicates buffers and one-element steps, which DCP then saves once
        ranks = dp if entry.sharded else 1
        for rank, (rows, pieces, chunk_shape) in enumerate(_row_blocks(key, shape, dtype, source, ranks)):
            if pieces is None:
                continue
            offset, length = files[rank].add_chunk(dtype, chunk_shape, pieces)
            # .metadata names each file relative to its own folder
            chunk = ((rows,) + (0,) * (len(shape) - 1) if shape else (), chunk_shape, file_name(rank), offset, length)
            written[source].append(chunk)
            out.chunk(key, path, shape, dtype, *chunk)
    for entry in values:
        # dcp.load wants a tensor entry there, which this writer does not make yet
        if isinstance(entry.value, TensorRef):
            raise ReshardError.at(catalog.root, f"{entry.key} is a tensor; DCP output carries it only as a plain value "
                                                "(not supported yet)")
        offset, length = files[0].add_value(entry.value)
        out.value(entry.key, entry.path, file_name(0), offset, length)
    for key, path, blob in blobs:
        offset, length = files[0].add_blob(blob)
        out.value(key, path, file_name(0), offset, length)
    return [f.build() for f in files if f.items] + [TextFile(os.path.join(folder, METADATA), md.dumps(out.build(tag)))]


def output_tag(catalog, tag: str) -> str:
    return tag


def describe(target: Layout, tag: str) -> Output:
    """A DCP directory is one file per data-parallel rank; it has no ZeRO stage and no tag."""
    return Output("dcp", f"dp={target.dp}")


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    return None     # a DCP checkpoint says nothing about the batch size


def _row_blocks(key, shape, dtype, source, dp):
    """Per rank: (first row, pieces, chunk shape), FSDP2's dim-0 cut (torch.chunk); None when empty."""
    if isinstance(source, ScalarTensor):
        return [(0, [Piece(1, None, value=source.value)], ())]
    if not shape:
        return [(0, [Piece(1, source, 0)], ())]
    rows, row = shape[0], math.prod(shape[1:])
    blocks = chunks(rows, dp)
    per_rank = blocks[0][1] - blocks[0][0]
    if row * itemsize(dtype) * per_rank > CHUNK_LIMIT:
        raise ReshardError(f"{key}: a shard of {row * per_rank * itemsize(dtype)} bytes is larger than "
                           f"{CHUNK_LIMIT} bytes (ZIP64 chunks are not written yet); use more ranks")
    out: list[tuple[int, list[Piece] | None, tuple[int, ...] | None]] = []
    for first, last in blocks:
        if last <= first:
            out.append((first, None, None))
            continue
        count = (last - first) * row
        out.append((first, [Piece(count, source, first * row)], (last - first,) + tuple(shape[1:])))
    return out


class MetadataBuilder:
    """DCP's Metadata, built up chunk by chunk. `planner`: each key's planner path is recorded (DCP's default
    planner flattens nested state dicts by it); a writer of flat keys (Megatron's) records none, as its saver does."""

    def __init__(self, planner: bool = True):
        self.entries: dict[str, Any] = {}
        self.storage: dict[Any, Any] = {}
        self.planner: dict | None = {} if planner else None

    def chunk(self, key, planner_path, shape, dtype, offsets, sizes, path, offset, length):
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = md.TensorStorageMetadata(md.tensor_properties(dtype), Size(shape), [])
            if self.planner is not None:
                self.planner[key] = planner_path
        index = md.MetadataIndex(key, Size(offsets), len(entry.chunks))
        entry.chunks.append(md.ChunkStorageMetadata(Size(offsets), Size(sizes)))
        self.storage[index] = md.StorageInfo(path, offset, length)

    def value(self, key, planner_path, path, offset, length):
        self.entries[key] = md.BytesStorageMetadata()
        if self.planner is not None:
            self.planner[key] = planner_path
        self.storage[md.MetadataIndex(key, None, None)] = md.StorageInfo(path, offset, length)

    def blob(self, key, path, offset, length):
        """A value item under a flat key (no planner path)."""
        self.value(key, None, path, offset, length)

    def build(self, tag: str) -> md.Metadata:
        return md.Metadata(self.entries, self.planner, self.storage,
                           md.StorageMeta(None, f"reshard-{tag}", None, []), "1.0.0")
