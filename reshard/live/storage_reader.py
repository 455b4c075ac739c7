"""Any checkpoint reshard reads, as a `torch.distributed.checkpoint` StorageReader (reshard.dcp_reader.Reader).

The metadata says every entry `get_state_dict(model, optimizer)` has (keys.py) is one chunk: the whole
logical tensor. DCP's planner then asks each rank for the boxes its own shards need, and `read_data`
reads exactly those elements from wherever the source holds them (flat ZeRO partitions, TP slices, DCP
chunks), through the catalog's placements: no rank reads a byte outside its boxes, and nothing is
unpickled but what the format reader's allow-list lets through. A model asking for another dtype than the
source holds (bf16 params from an fp32 master) gets torch's own cast.
"""
from __future__ import annotations

import io
import math
import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from reshard import formats
from reshard.commands.validate import prove_complete
from reshard.core.catalog import ScalarTensor, TensorKey
from reshard.core.dtypes import numpy_carrier, torch_dtype
from reshard.core.placement import Shard
from reshard.errors import ReshardError
from reshard.formats.dcp import keys
from reshard.formats.torchsave_read import TensorRef
from reshard.reading.source_bytes import MappedFiles, read_shard


class Reader(StorageReader):
    """`dcp.load(state_dict, storage_reader=Reader("ckpt/"))` loads the checkpoint at `path`, whatever its
    format and topology. `tag` and `layout_rules` are reshard's reading options (a DeepSpeed tag folder, a
    tensor-parallel rule file); `names`, a module-names rule file (reshard.rules.module_names: "mixtral-autoep-fsdp"
    serves an AutoEP Mixtral's experts as transformers' MixtralForCausalLM holds them)."""

    def __init__(self, path, tag: str | None = None, layout_rules: str | None = None, names: str | None = None):
        super().__init__()
        self.tag, self.layout_rules, self.names = tag, layout_rules, names
        self.reset(path)

    def reset(self, checkpoint_id=None) -> None:
        """Open the checkpoint (metadata only) and prove it whole: a bad one raises its one-line ReshardError
        here, on every rank alike, before dcp.load's first collective (which would wrap it)."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            catalog = prove_complete(formats.read(self.path, self.tag, self.layout_rules)).catalog
            if self.names:
                from reshard.rules import module_names
                catalog = prove_complete(module_names.load(self.names).apply(catalog)).catalog
            elif catalog.experts is not None:
                raise ReshardError.at(self.path, "a mixture-of-experts checkpoint is served as one model only under "
                                                 "a model's names (names=, e.g. mixtral-autoep-fsdp)")
            self.catalog = catalog
        self._sources: dict[dcp_md.MetadataIndex, Any] = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        try:
            formats.reader_for(os.fspath(checkpoint_id))
        except ReshardError:
            return False
        return True

    def read_metadata(self, *args, **kwargs) -> dcp_md.Metadata:
        entries: dict[str, dcp_md.TensorStorageMetadata | dcp_md.BytesStorageMetadata] = {}
        storage: dict[dcp_md.MetadataIndex, keys.TensorEntry | keys.ValueEntry] = {}
        planner: dict[str, object] = {}
        for entry in keys.tensor_entries(self.catalog):
            size = torch.Size(entry.shape)
            properties = dcp_md.TensorProperties(dtype=torch_dtype(entry.dtype))
            chunk = dcp_md.ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
            entries[entry.key] = dcp_md.TensorStorageMetadata(properties, size, [chunk])
            storage[dcp_md.MetadataIndex(entry.key, chunk.offsets, 0)] = entry
            planner[entry.key] = keys.planner_path(entry.key)
        for entry in keys.value_entries(self.catalog):
            entries[entry.key] = dcp_md.BytesStorageMetadata()
            storage[dcp_md.MetadataIndex(entry.key)] = entry
            planner[entry.key] = entry.path
        return dcp_md.Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage)

    def set_up_storage_reader(self, metadata: dcp_md.Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self._sources = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        with MappedFiles() as files:
            for item in plan.items:
                entry = self._sources[item.storage_index]
                if item.type == LoadItemType.BYTE_IO:
                    buffer = io.BytesIO()
                    torch.save(_torch_value(files, entry.value), buffer)
                    buffer.seek(0)
                    planner.load_bytes(item, buffer)
                    continue
                at, shape = tuple(item.storage_offsets), tuple(item.lengths)
                target = planner.resolve_tensor(item).detach()
                if tuple(target.size()) != shape:
                    raise ReshardError(f"{entry.key}: asked for a box of {list(shape)}, the destination is "
                                       f"{list(target.size())}")
                self._fill(files, entry, at, shape, target)
                planner.commit_tensor(item, target)
            files.verify()      # each source member read from, whole: a corrupt one fails the load
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _fill(self, files: MappedFiles, entry: keys.TensorEntry, at: tuple, shape: tuple, target) -> None:
        """Copy the entry's box (`at`, `shape`) into `target`: read straight into it where it is contiguous
        memory of the source's dtype, else read, then cast or scatter by torch's copy."""
        if isinstance(entry.source, ScalarTensor):
            target.copy_(torch.tensor(entry.source.value, dtype=torch_dtype(entry.source.dtype)))
            return
        tensor = self.catalog.tensors[TensorKey(*entry.source)]
        dtype = torch_dtype(tensor.dtype)
        if target.dtype == dtype and target.is_contiguous():
            _read_box(files, tensor, at, shape, target.view(-1).view(torch.uint8).numpy().view(
                numpy_carrier(tensor.dtype)))
        else:
            target.copy_(torch.from_numpy(_read_box(files, tensor, at, shape)).view(dtype).reshape(shape))


def _read_box(files: MappedFiles, tensor, at: tuple, shape: tuple, out=None):
    """The box (`at`, `shape`) of a logical tensor, flat, into `out` (carrier dtype) or a new array."""
    if not shape:
        return read_shard(files, tensor, None, 0, 1, out=out)
    if shape[1:] == tuple(tensor.shape[1:]):     # whole rows (FSDP's cut, the whole tensor): a flat range
        row = math.prod(shape[1:])
        return read_shard(files, tensor, None, at[0] * row, (at[0] + shape[0]) * row, out=out)
    return read_shard(files, tensor, Shard.box(at, shape), 0, math.prod(shape), out=out)


def _torch_value(files: MappedFiles, value):
    """`value` with each tensor in it (a tensor lr: TensorRef) made a torch tensor read from its storage."""
    if isinstance(value, TensorRef):
        storage = np.empty(value.storage.numel, dtype=numpy_carrier(value.dtype))
        files.read_into(value.storage, 0, storage, value.dtype)
        flat = torch.from_numpy(storage).view(torch_dtype(value.dtype))
        return flat.as_strided(value.shape, value.stride, value.storage_offset).clone()
    if isinstance(value, dict):
        return type(value)((k, _torch_value(files, v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_torch_value(files, v) for v in value)
    return value
