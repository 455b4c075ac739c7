"""What a checkpoint's bytes are: the model's weights, optimizer state, or other — and what they cost a month.

One size everywhere: the files' bytes (their apparent size, the sum of the file sizes), what a copy moves and
what object storage bills; not the blocks a file system allocates, which vary with the file system.

The split is read from the Catalog alone, so it means the same for every format a reader reads: each fragment
points at a byte range of a file, and each range is counted once, under the richest kind that points at it.
- weights: one copy of the model's state_dict (parameters and buffers) in the dtype the model holds — the
  `module` tensors (the 16-bit copy in mixed precision), or a parameter's fp32 master where it is its only copy
  (an fp32 run, a ZeRO-3 save, whose module files hold no weights);
- optimizer: every other state of a parameter — its moments, and the fp32 master beside a 16-bit copy;
- other: the rest of the files — headers and pickles, padding of flat buffers, RNG, scheduler, config,
  tokenizer, metrics, a second copy of something (a tensor-parallel replica, a buffer saved by every rank), and
  scalars a reader keeps as numbers rather than byte ranges (optimizer step counters).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from reshard.core.catalog import MASTER, MODULE, Catalog
from reshard.core.dtypes import itemsize

WEIGHTS, OPTIMIZER, OTHER, UNKNOWN = "weights", "optimizer", "other", "unknown"
GB = 10 ** 9        # what `--price` is per: the decimal gigabyte


@dataclass(frozen=True)
class BytesByKind:
    """A checkpoint's files' bytes by what they hold; adds up to the files' bytes exactly."""
    weights: int
    optimizer: int
    other: int

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.other

    def to_dict(self) -> dict[str, int]:
        return {WEIGHTS: self.weights, OPTIMIZER: self.optimizer, OTHER: self.other, "total": self.total}


@dataclass(frozen=True)
class RunBytes:
    """A run's checkpoints added up; `unknown`: the bytes of those whose kinds no reader could say (not read whole)."""
    weights: int = 0
    optimizer: int = 0
    other: int = 0
    unknown: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.other + self.unknown

    def to_dict(self) -> dict[str, int]:
        return {WEIGHTS: self.weights, OPTIMIZER: self.optimizer, OTHER: self.other, UNKNOWN: self.unknown,
                "total": self.total}


def split(catalog: Catalog, files_bytes: int, within: str) -> BytesByKind | None:
    """`files_bytes`, the bytes of the files under `within` (a checkpoint's folder or file), by kind as the
    catalog read from them says; None where the catalog points outside `within` or at more bytes than there are
    (then the two do not describe the same files, and no split is guessed)."""
    spans: dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}    # file -> (weights, optimizer)
    for model in (catalog, *catalog.companions):     # every model of the checkpoint (a verl step's critic too)
        copied = {key.name for key in model.tensors if key.state == MODULE}
        for tensor in model.tensors.values():
            # a master is the weights where nothing else holds them; beside a module copy it is optimizer state
            weights = tensor.state == MODULE or (tensor.state == MASTER and tensor.name not in copied)
            for fragment in tensor.fragments:
                storage = fragment.storage
                if not _inside(storage.file, within):
                    return None
                size = itemsize(storage.dtype)
                start = storage.offset + fragment.elem_offset * size
                spans.setdefault(storage.file, ([], []))[0 if weights else 1].append(
                    (start, start + fragment.numel * size))
    weights_bytes = optimizer_bytes = 0
    for held, moved in spans.values():
        held, moved = _merged(held), _merged(moved)
        weights_bytes += _length(held)
        optimizer_bytes += _length(moved) - _overlap(held, moved)
    if weights_bytes + optimizer_bytes > files_bytes:
        return None
    return BytesByKind(weights_bytes, optimizer_bytes, files_bytes - weights_bytes - optimizer_bytes)


def added_up(rows: Iterable[tuple[int, BytesByKind | None]]) -> RunBytes:
    """The run's bytes from its rows' (files' bytes, kinds or None)."""
    weights = optimizer = other = unknown = 0
    for files_bytes, kinds in rows:
        if kinds is None:
            unknown += files_bytes
        else:
            weights, optimizer, other = weights + kinds.weights, optimizer + kinds.optimizer, other + kinds.other
    return RunBytes(weights, optimizer, other, unknown)


def cost_per_month(nbytes: dict[str, int], price: float) -> dict[str, float]:
    """{kind: USD a month} of {kind: bytes} at `price` USD per GB (10^9 bytes) and month."""
    return {kind: n / GB * price for kind, n in nbytes.items()}


def _inside(file: str, within: str) -> bool:
    # "/" in a local path and an s3:// URL alike
    return file == within or file.startswith(within.rstrip("/") + "/")


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching spans joined: a byte pointed at twice is counted once."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _length(spans: list[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in spans)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Bytes in both of two merged span lists."""
    i = j = common = 0
    while i < len(a) and j < len(b):
        common += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return common
