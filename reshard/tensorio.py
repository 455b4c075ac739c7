"""Reading tensor bytes through memory maps: the only place that touches storage bytes when reading.

Fragments point at storages by byte offset; `MappedFiles` maps each file once and hands out
numpy views (no copy). `full_tensor` rebuilds one logical tensor, for tests, export and checks.
"""
from __future__ import annotations

import bisect
import mmap
import os

import numpy as np

from reshard.catalog import Catalog, Fragment, LogicalTensor
from reshard.dtypes import itemsize, numpy_carrier
from reshard.errors import CheckpointError


class MappedFiles:
    """Read-only memory maps of checkpoint files, one per file, closed together."""

    def __init__(self):
        self._maps = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass   # a numpy view still uses it; the map goes when the last view does
        self._maps.clear()

    def _map(self, path: str) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            try:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(path, f"cannot map file: {e}") from None
            self._maps[path] = m
        return m

    def fragment(self, frag: Fragment, dtype: str) -> np.ndarray:
        """The fragment's elements as a 1-D numpy view (raw carrier dtype for bfloat16)."""
        size = itemsize(dtype)
        start = frag.storage.offset + frag.elem_offset * size
        stop = start + frag.numel * size
        if frag.elem_offset < 0 or stop > frag.storage.offset + frag.storage.nbytes:
            raise CheckpointError(frag.storage.file, "fragment reaches outside its storage")
        m = self._map(frag.storage.file)
        if stop > len(m):
            raise CheckpointError(frag.storage.file, f"truncated: needs byte {stop}, file has {len(m)}")
        return np.frombuffer(m, dtype=numpy_carrier(dtype), count=frag.numel, offset=start)


def read_flat(files: MappedFiles, tensor: LogicalTensor) -> np.ndarray:
    """All elements of a logical tensor, flat, in a new array (carrier dtype)."""
    out = np.zeros(tensor.numel, dtype=numpy_carrier(tensor.dtype))
    for frag in tensor.fragments:
        out[frag.start:frag.stop] = files.fragment(frag, tensor.dtype)
    return out


def sorted_fragments(tensor: LogicalTensor) -> list:
    return sorted(tensor.fragments, key=lambda f: f.start)


def read_range(files: MappedFiles, tensor: LogicalTensor, start: int, stop: int, fragments: list) -> np.ndarray:
    """Elements [start, stop) of a logical tensor (carrier dtype); `fragments` sorted by start."""
    out = np.zeros(stop - start, dtype=numpy_carrier(tensor.dtype))
    first = max(bisect.bisect_right(fragments, start, key=lambda f: f.start) - 1, 0)
    for frag in fragments[first:]:
        if frag.start >= stop:
            break
        lo, hi = max(start, frag.start), min(stop, frag.stop)
        if lo < hi:
            out[lo - start:hi - start] = files.fragment(frag, tensor.dtype)[lo - frag.start:hi - frag.start]
    return out


def full_tensor(catalog: Catalog, name: str, state: str, files: MappedFiles | None = None):
    """The whole logical tensor (name, state) as a torch tensor of its saved dtype and shape."""
    import torch
    from reshard.dtypes import torch_dtype

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
    """The value of a one-element tensor (a step counter); reads just its bytes."""
    size = itemsize(ref.dtype)
    start = ref.storage.offset + ref.storage_offset * size
    with open(ref.storage.file, "rb") as f:
        f.seek(start)
        raw = f.read(size)
    if len(raw) != size:
        raise CheckpointError(ref.storage.file, "truncated inside a scalar tensor")
    value = np.frombuffer(raw, dtype=numpy_carrier(ref.dtype))[0]
    if ref.dtype == "bfloat16":
        return float(np.frombuffer((int(value) << 16).to_bytes(4, "little"), dtype="<f4")[0])
    return value.item()


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
