"""Hugging Face's sharded-checkpoint convention (huggingface_hub.split_state_dict_into_shards_factory), and its
model config file read as plain values (`model_config`).

Tensors are packed greedily in key order into shards of at most `max_shard_size` bytes (decimal
units: 5GB = 5e9); a tensor larger than that gets a shard of its own, placed where it was met.
One shard is `model.safetensors` with no index; several are `model-00001-of-0000N.safetensors`
plus `model.safetensors.index.json` = {"metadata": {"total_size": N}, "weight_map": {name: file}}.
"""
from __future__ import annotations

import json
import re

from reshard.errors import ReshardError, UsageError
from reshard.storage import files as fs

DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(size) -> int:
    """huggingface_hub's parse_size_to_int: "5GB" = 5e9 bytes; plain integers are bytes."""
    if isinstance(size, int):
        return size
    text = str(size).strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    unit = text[-2:].upper()
    try:
        return int(float(text[:-2].strip()) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ReshardError(f"bad shard size {size!r}: use a number with TB, GB, MB or KB (5GB = 5e9 bytes)") from None


def shard(entries: list, max_shard_size) -> list:
    """Group (name, nbytes) entries into shards (lists of names), as huggingface_hub does."""
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, nbytes in entries:
        if nbytes > limit:
            shards.append([name])
            continue
        if current_size + nbytes > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current:
        shards.append(current)
    return shards


def shard_names(stem: str, extension: str, count: int) -> list:
    if count == 1:
        return [f"{stem}.{extension}"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{extension}" for i in range(count)]


def index(total_size: int, weight_map: dict) -> str:
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"


def model_config(path: str) -> dict:
    """The values of a model config file (a JSON object: Hugging Face's config.json); a one-line error otherwise."""
    try:
        with fs.open(path, "rb") as f:
            values = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise UsageError.at(path, f"not a readable JSON model config ({e})") from None
    if not isinstance(values, dict):
        raise UsageError.at(path, "a model config is a JSON object")
    return values
