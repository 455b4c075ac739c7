"""Reading tensor bytes in place: the only place that touches storage bytes when reading.

Fragments point at storages by byte offset; `MappedFiles` views each file once through the storage
(reshard.storage: a memory map, on POSIX) and hands out numpy views (no copy). `full_tensor` rebuilds one logical
tensor, for tests, export and checks.
"""
from __future__ import annotations

import mmap
from dataclasses import replace

import numpy as np

from reshard.core.catalog import Catalog, Fragment, LogicalTensor
from reshard.core.dtypes import cast_array, itemsize, numpy_carrier
from reshard.core.geometry import offset, span, strides
from reshard.core.locate import Locator
from reshard.core.placement import Shard, full_index, regions
from reshard.core.problems import REPLICA, Problem
from reshard.core.storage_ref import StorageRef
from reshard.errors import CheckpointError
from reshard.reading.checksums import Tally
from reshard.storage import files as fs
from reshard.storage.protocol import SourceStorage
from reshard.storage.routing import sources

# Fewer bytes than this are read with pread, not through the map: a fault on a mapped page reads ahead
# a whole window around it (read_ahead_kb), which for the small tensors read one by one when a catalog is
# opened (replicated norm weights, compared when read) costs ~100× the bytes wanted.
SMALL_READ = 1 << 20
# The most bytes of a fragment taken at once by a pass over all of it (validate --deep, replica checks): from
# storage that is not mapped (object storage) each is a read into memory, so memory stays bounded whatever the
# fragment's size
WINDOW_BYTES = 16 << 20


class MappedFiles:
    """Checkpoint files viewed in place through `storage` (by default the local filesystem, mapped), one view per
    file, closed together; small reads are positioned reads. Every read is noted in `tally`
    (reshard.reading.checksums.Tally): `verify()` checks the CRC-32 of each member read."""

    def __init__(self, storage: SourceStorage | None = None):
        self._files = storage or sources()
        self.tally = Tally()

    def verify(self) -> None:
        """Raise the first checksummed member read whose CRC-32 does not match (a CheckpointError), if any."""
        self.tally.verify()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._files.close()     # a view a numpy array still uses goes when the last array does

    def _view(self, path: str):
        try:
            return self._files.view(path)
        except (OSError, ValueError) as e:
            raise CheckpointError(path, f"cannot map file: {e}") from None

    def fragment(self, frag: Fragment, dtype: str) -> np.ndarray:
        """The fragment's elements (its flat range of its shard) as a 1-D numpy view (raw carrier dtype for
        bfloat16)."""
        return self.elements(frag.storage, frag.elem_offset, frag.numel, dtype)

    def windows(self, frag: Fragment, dtype: str, window: int | None = None):
        """The fragment's elements in order, as (first element, relative to the fragment; 1-D numpy array) pieces
        of at most `window` bytes (default WINDOW_BYTES), each read into one buffer reused for the next (so a
        pass over a whole checkpoint holds one window, where views of a map would keep every page read in this
        process's resident memory: 3.4 GB for a 3.5 GB save)."""
        step = max(1, (window or WINDOW_BYTES) // itemsize(dtype))
        buffer = np.empty(min(step, frag.numel), dtype=numpy_carrier(dtype))
        for first in range(0, frag.numel, step):
            part = buffer[:min(step, frag.numel - first)]
            self.read_into(frag.storage, frag.elem_offset + first, part, dtype)
            yield first, part

    def elements(self, storage: StorageRef, first: int, count: int, dtype: str) -> np.ndarray:
        """Elements [first, first + count) of a storage as a 1-D numpy view."""
        size = itemsize(dtype)
        start = storage.offset + first * size
        stop = start + count * size
        if first < 0 or stop > storage.offset + storage.nbytes:
            raise CheckpointError(storage.file, "fragment reaches outside its storage")
        if stop - start < SMALL_READ or not self._files.mapped(storage.file):
            try:
                raw = self._files.read(storage.file, start, stop - start)
            except OSError as e:
                raise CheckpointError(storage.file, f"cannot read: {e.strerror}") from None
            if len(raw) != stop - start:
                raise CheckpointError(storage.file, f"truncated: needs byte {stop}, file has "
                                                    f"{start + len(raw)}")
            self.tally.note(storage, start, raw)
            return np.frombuffer(raw, dtype=numpy_carrier(dtype))
        m = self._view(storage.file)
        if stop > len(m):
            raise CheckpointError(storage.file, f"truncated: needs byte {stop}, file has {len(m)}")
        # hashed through the map: the pages are read now, once, and stay cached for the caller's use of them
        with memoryview(m) as whole, whole[start:stop] as part:
            self.tally.note(storage, start, part)
        return np.frombuffer(m, dtype=numpy_carrier(dtype), count=count, offset=start)


    def let_go(self, storage: StorageRef, first: int, count: int, dtype: str) -> None:
        """Done with elements [first, first + count) read through the map: their pages leave this process's
        resident memory (they stay in the page cache; a view still held reads them again). Without it a pass over
        a whole checkpoint through maps (diff) keeps every page it read resident: twice the checkpoint's size."""
        size = itemsize(dtype)
        start, stop = storage.offset + first * size, storage.offset + (first + count) * size
        if stop - start < SMALL_READ or not self._files.mapped(storage.file):
            return      # (read by pread into memory of its own, not mapped)
        m = self._view(storage.file)
        start -= start % mmap.PAGESIZE
        m.madvise(mmap.MADV_DONTNEED, start, min(stop, len(m)) - start)

    def read_into(self, storage: StorageRef, first: int, out: np.ndarray, dtype: str) -> None:
        """Elements [first, first + out.size) of a storage read into `out` (1-D, contiguous): the kernel copies
        from the page cache straight into the caller's memory, and no mapped page stays in this process."""
        size = itemsize(dtype)
        start, nbytes = storage.offset + first * size, out.size * size
        if first < 0 or start + nbytes > storage.offset + storage.nbytes:
            raise CheckpointError(storage.file, "fragment reaches outside its storage")
        view = out.data.cast("B")
        done = self._files.read_into(storage.file, start, view)
        if done != nbytes:
            raise CheckpointError(storage.file, f"truncated: needs byte {start + nbytes}, file has {start + done}")
        self.tally.note(storage, start, view)


def read_flat(files: MappedFiles, tensor: LogicalTensor) -> np.ndarray:
    """All elements of a logical tensor, flat, in a new array (carrier dtype)."""
    return read_range(files, tensor, 0, tensor.numel)


def read_range(files: MappedFiles, tensor: LogicalTensor, start: int, stop: int,
               where: Locator | None = None) -> np.ndarray:
    """Elements [start, stop) of a logical tensor (flat, row-major; carrier dtype). Elements no fragment holds
    are zero."""
    return read_shard(files, tensor, None, start, stop, where)


def read_shard(files: MappedFiles, tensor: LogicalTensor, shard: Shard | None, start: int, stop: int,
               where: Locator | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Elements [start, stop) of `shard` of a logical tensor (None: the tensor itself), in a new array or in
    `out` (1-D, contiguous, of the carrier dtype: a caller's own memory, read into with no copy between)."""
    where = where or Locator(tensor)
    if tensor.cast_from:        # the stored values, then the cast the tensor is
        stored = read_shard(files, replace(tensor, dtype=tensor.cast_from, cast_from=""), shard, start, stop, where)
        values = cast_array(stored, tensor.cast_from, tensor.dtype)
        if out is None:
            return values
        out[...] = values
        return out
    runs = where.runs(shard, start, stop) if where.holds_as(shard) else None
    if out is None:
        out = np.zeros(stop - start, dtype=numpy_carrier(tensor.dtype))
    elif runs is None or sum(run.count for run in runs) != stop - start:
        out[...] = 0        # the caller's memory: elements no fragment holds are zero, as in a new array
    if runs is not None:
        for run in runs:
            files.read_into(run.fragment.storage, run.elem, out[run.offset:run.offset + run.count], tensor.dtype)
        return out
    shard_strides = strides(shard.shape if shard else tensor.shape)
    byte_strides = tuple(s * out.itemsize for s in shard_strides)
    for hit in where.boxes(shard, start, stop):
        first = offset(hit.local, shard_strides) - start
        values = files.elements(hit.fragment.storage, hit.elem, span(hit.shape, hit.strides), tensor.dtype)
        np.lib.stride_tricks.as_strided(out[first:], hit.shape, byte_strides)[...] = \
            np.lib.stride_tricks.as_strided(values, hit.shape, tuple(s * out.itemsize for s in hit.strides))
        files.let_go(hit.fragment.storage, hit.elem, values.size, tensor.dtype)
    return out


def full_tensor(catalog: Catalog, name: str, state: str, files: MappedFiles | None = None):
    """The whole logical tensor (name, state) as a torch tensor of its saved dtype and shape."""
    import torch

    from reshard.core.dtypes import torch_dtype

    tensor = catalog.tensor(name, state)
    owned = files is None
    files = files or MappedFiles()
    try:
        flat = read_flat(files, tensor)
    finally:
        if owned:
            files.close()
    return torch.from_numpy(flat).view(torch_dtype(tensor.dtype)).reshape(tensor.shape)


def read_scalar(ref) -> float | int:
    """The value of a one-element tensor (a step counter); reads its storage (a few bytes), CRC-32 checked."""
    if ref.storage_offset < 0 or (ref.storage_offset + 1) * itemsize(ref.dtype) > ref.storage.nbytes:
        raise CheckpointError(ref.storage.file, "truncated inside a scalar tensor")
    with MappedFiles() as files:
        value = files.elements(ref.storage, ref.storage_offset, 1, ref.dtype)[0]
        files.verify()
    if ref.dtype == "bfloat16":
        return float(np.frombuffer((int(value) << 16).to_bytes(4, "little"), dtype="<f4")[0])
    return value.item()


def file_size(path: str) -> int:
    try:
        return fs.getsize(path)
    except OSError:
        return 0


def first_difference(files: MappedFiles, tensor: LogicalTensor, copy: LogicalTensor, block: int | None = None,
                     known: dict | None = None):
    """The first flat index of the tensor where `copy` (fragments over part of it) differs from it, or None.

    Compared in blocks of at most `block` elements: memory stays bounded whatever the tensor size. Elements
    of a copy's shard that it does not place (another rank's blocks) are not compared. `known`: the tensor's
    blocks read so far, kept there for the next copy of the same tensor (the other TP ranks' copies of a norm).
    `block` defaults to WINDOW_BYTES of the copy's elements."""
    where = Locator(tensor)
    block = block or max(1, WINDOW_BYTES // itemsize(copy.dtype))
    for frag in sorted(copy.fragments, key=lambda f: f.start):
        placed = frag.shard is None or len(frag.shard.blocks) == 1 and frag.shard.blocks[0].shape == frag.shard.shape
        for lo in range(frag.start, frag.stop, block):
            hi = min(frag.stop, lo + block)
            key = (frag.shard, lo, hi)
            mine = known.get(key) if known is not None else None
            if mine is None:
                mine = read_shard(files, tensor, frag.shard, lo, hi, where)
                if known is not None:
                    known[key] = mine
            theirs = files.elements(frag.storage, frag.elem_offset + lo - frag.start, hi - lo, copy.dtype)
            mine, theirs = (a.view(f"u{a.itemsize}") for a in (mine, theirs))    # bits: NaN equals NaN
            differs = mine != theirs
            if frag.shard is not None and not placed:      # (placed when it has no shard)
                differs &= _placed_mask(frag.shard, lo, hi)
            if differs.any():
                at = lo + int(np.flatnonzero(differs)[0])
                return at if frag.shard is None else full_index(frag.shard, tensor.shape, at)
    return None


def _placed_mask(shard: Shard, start: int, stop: int) -> np.ndarray:
    """Which elements of [start, stop) of `shard` its blocks place."""
    mask = np.zeros(stop - start, dtype=bool)
    shard_strides = strides(shard.shape)
    for region in regions(shard, start, stop):
        view = np.lib.stride_tricks.as_strided(mask[region.offset:], region.shape, shard_strides)
        view[...] = True
    return mask


def replica_problem(files: MappedFiles, tensor: LogicalTensor, replica, known: dict | None = None) -> Problem | None:
    """The problem when a replica (catalog.Replica) differs from the tensor it copies, else None. `known`: as
    for first_difference."""
    at = first_difference(files, tensor, replica.copy, known=known)
    if at is None:
        return None
    where = sorted({f.storage.file for f in replica.copy.fragments})
    return Problem(where[0] if where else "?", f"{tensor.name} ({tensor.state})", REPLICA,
                   f"{tensor.name} ({tensor.state}): replicated, but {replica.holder} differs from {replica.first} "
                   f"(first at element {at})")
