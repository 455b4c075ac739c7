"""The digest of every output file: what the manifest and the --resume journal record, and what
`reshard validate --checksums` compares.

BLAKE3 is the default: a cryptographic hash like sha256 (a changed file cannot be made to match), at about three
times its speed per core on this project's machines (3.7 against 1.3 GB/s, with SHA extensions), which on fast
storage is the difference between hashing dominating a conversion and not (docs/performance.md); `b3sum` checks
it from a shell. sha256 stays available (`--digest sha256`) for those who verify with `sha256sum`, and manifests
written with it before BLAKE3 was the default verify as they are: an entry names its algorithm by its key.

XXH3-128 (`--digest xxh3-128`; `xxh128sum` checks it) is for storage faster than one core hashes: about 0.04
CPU-seconds per GB here against BLAKE3's 0.23 and sha256's 0.56. It finds every accidental change (a flipped bit, a
torn or truncated write) as surely as the others, but it is no cryptographic hash: a manifest kept apart from the
files (a registry, a signed record) cannot prove them unchanged against someone who meant to change them, so it is
not the default.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import blake3
import xxhash

BLAKE3 = "blake3"
SHA256 = "sha256"
XXH3_128 = "xxh3-128"
ALGORITHMS = (BLAKE3, SHA256, XXH3_128)
DEFAULT = BLAKE3
READ_BYTES = 4 << 20        # bytes per read when hashing a file already written


class Hasher(Protocol):
    def update(self, data) -> object: ...

    def hexdigest(self) -> str: ...


def new(algorithm: str) -> Hasher:
    """A hasher of `algorithm` (one of ALGORITHMS); a ValueError names the ones there are."""
    if algorithm == BLAKE3:
        return blake3.blake3()
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3_128:
        return xxhash.xxh3_128()
    raise ValueError(f"unknown digest {algorithm!r} (one of {', '.join(ALGORITHMS)})")


def of_entry(entry: dict) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a manifest or journal entry, whichever known algorithm it names; None if none."""
    for algorithm in ALGORITHMS:
        if isinstance(entry.get(algorithm), str):
            return algorithm, entry[algorithm]
    return None


def of_stream(read: Callable[[int], bytes], algorithm: str, report: Callable[[int], object] | None = None
              ) -> tuple[int, str]:
    """(size, hex digest) of what `read(n)` gives until it gives nothing; `report(n)` told of every block."""
    hasher, size = new(algorithm), 0
    for block in iter(lambda: read(READ_BYTES), b""):
        hasher.update(block)
        size += len(block)
        if report:
            report(len(block))
    return size, hasher.hexdigest()
