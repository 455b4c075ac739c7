"""Reading safetensors files and their Hugging Face shard index, from the header alone.

A safetensors file is: u64 little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data;
offsets are relative to the first byte after the header. We parse the header ourselves (the
library would map the file) and check every claim it makes against the file's size.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct

from reshard import paths
from reshard.core.dtypes import itemsize
from reshard.core.storage_ref import StorageRef
from reshard.errors import CheckpointError
from reshard.formats.safetensors_file import DTYPE_CODES
from reshard.formats.torchsave_read import TensorRef
from reshard.storage import files as fs

DTYPES = {code: name for name, code in DTYPE_CODES.items()}
MAX_HEADER = 100 * 1024 * 1024      # the safetensors library's own limit


def read_header(path: str) -> tuple:
    """(tensors: {name: TensorRef} in header order, metadata: dict) of one safetensors file."""
    try:
        size = fs.getsize(path)
        with fs.open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path, f"not a safetensors file ({size} bytes, no header length)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CheckpointError(path, f"header length {length} is larger than the file ({size} bytes): "
                                      "truncated or not a safetensors file")
            if length > MAX_HEADER:
                raise CheckpointError(path, f"header length {length} exceeds {MAX_HEADER} bytes")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + length, size - 8 - length
    tensors, spans = {}, []
    for name, entry in header.items():
        ref = _tensor(path, name, entry, data_start, data_len)
        tensors[name] = ref
        spans.append((ref.storage.offset, ref.storage.offset + ref.storage.nbytes, name))
    spans.sort()
    for (_a0, a1, a), (b0, b1, b) in itertools.pairwise(spans):
        if b0 < a1:
            raise CheckpointError(path, f"tensors {a} and {b} overlap in the data (bytes {b0 - data_start} "
                                  f"to {min(a1, b1) - data_start})")
    return tensors, metadata


def _tensor(path, name, entry, data_start, data_len) -> TensorRef:
    try:
        code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(path, f"tensor {name!r}: malformed header entry {entry!r:.100}") from None
    if code not in DTYPES:
        raise CheckpointError(path, f"tensor {name!r}: dtype {code!r} is not supported")
    dtype = DTYPES[code]
    if any(d < 0 for d in shape):
        raise CheckpointError(path, f"tensor {name!r}: negative dimension in shape {list(shape)}")
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(path, f"tensor {name!r}: data_offsets [{begin}, {end}] lie outside the data "
                              f"({data_len} bytes): truncated or damaged")
    nbytes = math.prod(shape) * itemsize(dtype)
    if end - begin != nbytes:
        raise CheckpointError(path, f"tensor {name!r}: data_offsets span {end - begin} bytes, "
                              f"{dtype}{list(shape)} needs {nbytes}")
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorRef(StorageRef(path, data_start + begin, nbytes, dtype), 0, shape, stride)


def read_index(index_path: str) -> dict:
    """{name: shard path} of a Hugging Face shard index, every shard inside the index's folder."""
    folder = os.path.dirname(fs.abspath(index_path))
    try:
        with fs.open(index_path) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except OSError as e:
        raise CheckpointError(index_path, f"cannot read: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(index_path, "not a shard index (JSON with a 'weight_map' object)") from None
    out = {}
    for name, shard in weight_map.items():
        why = paths.escape(shard, folder)
        if why:
            raise CheckpointError(index_path, f"tensor {name!r}: shard path {shard!r} leaves the checkpoint folder "
                                              f"({why})")
        path = os.path.join(folder, shard)
        if not fs.isfile(path):
            raise CheckpointError(index_path, f"tensor {name!r}: shard {shard} is missing")
        out[name] = path
    return out


def read_sharded(index_path: str) -> dict:
    """{name: TensorRef} of every tensor the index names, in index order; each must be in its shard."""
    weight_map = read_index(index_path)
    headers = {}
    out = {}
    for name, path in weight_map.items():
        if path not in headers:
            headers[path] = read_header(path)[0]
        if name not in headers[path]:
            raise CheckpointError(path, f"tensor {name!r} named by {os.path.basename(index_path)} is not in this shard")
        out[name] = headers[path][name]
    return out
