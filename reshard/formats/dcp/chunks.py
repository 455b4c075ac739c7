"""Where each item of a DCP checkpoint is: `.metadata`'s storage locations checked against the
`.distcp` files, and each chunk's torch.save archive parsed in place (torchsave_read with a span) to
find its storage. What is missing or out of range becomes a catalog problem, one line naming
the file; a hostile pickle anywhere is fatal (UnsafeCheckpointError).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

from reshard import paths
from reshard.core.catalog import CatalogBuilder, FileInfo, Fragment, ScalarTensor, TensorDraft
from reshard.core.placement import Shard
from reshard.errors import CheckpointError
from reshard.formats import torchsave_read
from reshard.formats.torchsave_read import DType, TensorRef
from reshard.reading.source_bytes import read_scalar
from reshard.storage import files as fs

METADATA = ".metadata"
RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")
MISSING = object()      # a value whose bytes could not be read (the reason is a catalog problem)
# What a source knew beyond the model and optimizer, saved as values `reshard.<key>` (so `dcp.load` of
# {"reshard": {...}} reads them and a load of {"model", "optim"} ignores them): {key: its type}.
CARRIED_PREFIX = "reshard"
CARRIED = {"optimizer": str, "global_steps": int, "global_samples": int, "skipped_steps": int}


class Chunks:
    """Locates every item of `.metadata` in its `.distcp` file, checking paths and ranges. `meta` may join the
    `.metadata` of several DCP folders under `root` (joined): `meta_paths` then says which file names each key."""

    def __init__(self, root: str, meta, catalog: CatalogBuilder, meta_paths: dict | None = None):
        self.root, self.catalog = root, catalog
        self.meta_path = os.path.join(root, METADATA)
        self.meta_paths = meta_paths or {}
        self.by_fqn: dict[str, list[tuple[Any, Any]]] = {}
        self._escapes: dict[str, str] = {}      # relative path -> why it escapes the checkpoint ("" if it does not)
        self.sizes: dict[str, int | None] = {}
        self._at: dict[tuple[str, tuple], Any] = {}     # (fqn, chunk offsets) -> its storage (the first named)
        for index, info in meta.storage_data.items():
            offset = getattr(index, "offset", None)
            self.by_fqn.setdefault(index.fqn, []).append((offset, info))
            self._at.setdefault((index.fqn, tuple(offset or ())), info)
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(self.meta_of(index.fqn), f"{index.fqn}: transformed (e.g. compressed) chunks "
                                      f"({info.transform_descriptors}) are not supported")
            self.sizes.setdefault(self._path(info), None)
        for path in self.sizes:
            try:
                self.sizes[path] = fs.getsize(path)
            except OSError:
                catalog.problem(path, "missing (named in .metadata)")

    def world(self) -> int:
        """How many ranks saved the checkpoint, from the `__<rank>_<n>.distcp` names."""
        ranks = [rank_of(path) for path in self.sizes]
        return max((r for r in ranks if r is not None), default=0) + 1

    def _path(self, info) -> str:
        rel = info.relative_path
        why = self._escapes.get(rel) if isinstance(rel, str) else None
        if why is None:     # (resolved once per file: a large save names each of its files thousands of times)
            why = paths.escape(rel, self.root) or ""
            if isinstance(rel, str):
                self._escapes[rel] = why
        if why or not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise CheckpointError(self.meta_path, f"chunk location {rel!r:.80} escapes the checkpoint directory "
                                  f"or is malformed ({why or 'its offset or length is not a number'})")
        return os.path.join(self.root, rel)

    def signature(self, key: str, entry) -> tuple | None:
        """Where every chunk of an entry is, with its dtype and box: equal only for shared bytes."""
        out = [dtype_of(entry, self.meta_of(key), key), tuple(entry.size)]
        for chunk in entry.chunks:
            path, info = self._located(key, chunk.offsets)
            if path is None:
                return None
            out.append((tuple(chunk.offsets), tuple(chunk.sizes), path, info.offset, info.length))
        return tuple(out) if len(out) > 2 else None

    def path_of(self, key: str) -> str | None:
        """The file holding (the first chunk of) item `key`, or None."""
        return self._located(key)[0]

    def _located(self, key: str, offset=None):
        if offset is None:
            info = next(iter(self.by_fqn.get(key, ())), (None, None))[1]
        else:
            info = self._at.get((key, tuple(offset)))
        return (None, None) if info is None else (self._path(info), info)

    def _span_problem(self, key, path, info) -> str | None:
        """What is wrong with the byte range of an item, if anything."""
        size = self.sizes.get(path)
        if size is None:
            return "missing (named in .metadata)"
        if info.offset < 0 or info.length <= 0 or info.offset + info.length > size:
            return (f"truncated or wrong offsets: {key} lies at bytes [{info.offset}, "
                    f"{info.offset + info.length}) of a {size}-byte file")
        return None

    def _span(self, key, path, info) -> bool:
        problem = self._span_problem(key, path, info)
        if problem and self.sizes.get(path) is not None:    # a missing file is already a problem
            self.catalog.problem(path, problem)
        return problem is None

    def _item(self, key):
        """(path, info) of a one-chunk item (a value, a step); None (a problem noted) if unreadable."""
        path, info = self._located(key)
        if path is None:
            self.catalog.problem(self.meta_of(key), f"{key}: no storage location")
            return None, None
        return (path, info) if self._span(key, path, info) else (None, None)

    def tensor(self, key: str, entry, name: str, state: str) -> TensorDraft:
        meta_path = self.meta_of(key)
        dtype = dtype_of(entry, meta_path, key)
        shape = tuple(int(d) for d in entry.size)
        tensor = self.catalog.add(TensorDraft(name, state, shape, dtype), meta_path)
        for chunk in entry.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            sizes = tuple(int(s) for s in chunk.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                    any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
                self.catalog.problem(meta_path, f"{key}: chunk at {offsets} of size {sizes} lies outside "
                                     f"the tensor's shape {shape}")
                continue
            if not math.prod(sizes):
                continue
            ref = self.chunk(key, dtype, offsets, sizes)
            if ref is None:
                continue
            # one fragment per chunk: the chunk is a box of the tensor, stored as a tensor of its own
            shard = None if sizes == shape else Shard.box(offsets, sizes)
            tensor.fragments.append(Fragment(0, math.prod(sizes), ref.storage, ref.storage_offset,
                                             rank_of(ref.storage.file), shard))
        return tensor

    def chunk(self, key: str, dtype: str, offsets: tuple, sizes: tuple) -> TensorRef | None:
        """The stored tensor of the chunk of `key` at `offsets` (a contiguous `dtype` tensor of `sizes`), located,
        range-checked and parsed in place; None, a problem noted, where it cannot be read."""
        path, info = self._located(key, offsets)
        if path is None:
            self.catalog.problem(self.meta_of(key), f"{key}: no storage location for the chunk at {offsets}")
            return None
        if not self._span(key, path, info):
            return None
        ref = self._ref(key, path, info)
        if ref is None:
            return None
        if ref.dtype != dtype or ref.shape != tuple(sizes) or not ref.is_contiguous():
            self.catalog.problem(path, f"{key}: the chunk at byte {info.offset} holds "
                                 f"{ref.dtype}{list(ref.shape)}, "
                                 f".metadata says {dtype}{list(sizes)} (contiguous)")
            return None
        return ref

    def _ref(self, key, path, info):
        try:
            ref = torchsave_read.load(path, span=(info.offset, info.length))
        except CheckpointError as e:
            if isinstance(e, torchsave_read.UnsafeCheckpointError):
                raise
            self.catalog.problem(path, f"{key}: damaged chunk at byte {info.offset} ({e.problem})")
            return None
        if not isinstance(ref, TensorRef):
            self.catalog.problem(path, f"{key}: the chunk at byte {info.offset} is not a tensor")
            return None
        return ref

    def scalar(self, key: str, entry) -> ScalarTensor | None:
        """A one-element tensor (an optimizer `step`): its value is read, 8 bytes at most."""
        dtype = dtype_of(entry, self.meta_of(key), key)
        path, info = self._item(key)
        if path is None:
            return None
        ref = torchsave_read.load(path, span=(info.offset, info.length))
        if not isinstance(ref, TensorRef) or ref.numel != 1 or ref.dtype != dtype:
            raise CheckpointError(path, f"{key}: the step counter is not a one-element {dtype} tensor")
        return ScalarTensor(float(read_scalar(ref)), ref.dtype)

    def value(self, key: str, allowed: dict | None = None):
        """The plain value saved as bytes under `key`, unpickled through `allowed` (torchsave_read.load); MISSING, a
        problem noted, where it cannot be read."""
        path, info = self._item(key)
        if path is None:
            return MISSING
        value = torchsave_read.load(path, span=(info.offset, info.length), allowed=allowed)
        if isinstance(value, TensorRef):
            raise CheckpointError(path, f"{key}: a tensor-valued hyper-parameter is not supported")
        return value

    def blob(self, key: str) -> bytes | object:
        """The bytes of value item `key` as they lie in its file (a torch.save archive, not unpickled: a writer copies
        it whole); MISSING, a problem noted, where it cannot be read."""
        path, info = self._item(key)
        if path is None:
            return MISSING
        with fs.open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            self.catalog.problem(path, f"{key}: {len(data)} of {info.length} bytes at byte {info.offset}")
            return MISSING
        return data

    def meta_of(self, key: str) -> str:
        """The `.metadata` file that names `key` (for a problem's line)."""
        return self.meta_paths.get(key, self.meta_path)

    def files(self) -> list:
        metas = sorted(set(self.meta_paths.values())) or [self.meta_path]
        out = [FileInfo(os.path.relpath(m, self.root), "metadata", None, fs.getsize(m)) for m in metas]
        for path, size in sorted(self.sizes.items()):
            out.append(FileInfo(os.path.relpath(path, self.root), "distcp", rank_of(path), size or 0))
        return out

def joined(root: str, parts: list) -> tuple:
    """The `.metadata` of several DCP folders under `root` ([(folder name, metadata)]) as one: each storage location
    relative to `root`, and {key: the `.metadata` path naming it} for Chunks. Keys are the folders' own: two folders
    naming one key are refused (neither could be told from the other)."""
    from reshard.formats.dcp import metadata as md
    entries: dict = {}
    planner: dict = {}
    storage: dict = {}
    meta_paths: dict = {}
    for folder, meta in parts:
        meta_path = os.path.join(root, folder, METADATA)
        for key, entry in meta.state_dict_metadata.items():
            if key in entries:
                raise CheckpointError(meta_path, f"{key} is also named by {meta_paths[key]}")
            entries[key], meta_paths[key] = entry, meta_path
        if isinstance(getattr(meta, "planner_data", None), dict):
            planner.update(meta.planner_data)
        for index, info in meta.storage_data.items():
            rel = getattr(info, "relative_path", None)
            why = paths.escape(rel)
            if why:
                raise CheckpointError(meta_path, f"chunk location {rel!r:.80} escapes its folder ({why})")
            moved = md.StorageInfo()
            # its range and any transform, as saved (Chunks checks them), under the joined root
            moved.__dict__.update({**info.__dict__, "relative_path": f"{folder}/{rel}"})
            storage[index] = moved
    return md.Metadata(entries, planner, storage, None, None), meta_paths


def rank_of(path: str):
    found = RANK_FILE.search(path)
    return int(found.group(1)) if found else None

def dtype_of(entry, meta_path, key) -> str:
    props = getattr(entry, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, DType):
        raise CheckpointError(meta_path, f"{key}: no dtype in its tensor properties")
    return dtype.name
