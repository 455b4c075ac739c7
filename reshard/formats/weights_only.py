"""A checkpoint's weights-only form, as its framework writes it with its model-only option, and the record a
thinned checkpoint keeps of where it came from (`reshard thin`, reshard.lifecycle.thinning).

Each format's module (the registry's WEIGHTS_ONLY) says, from a full checkpoint's catalog and its file names,
which of its files the weights-only form keeps unchanged and which it drops: a Form. The thinned checkpoint holds
the kept files and PROVENANCE, a small JSON file naming when it was thinned, what was dropped and the bytes before
and after; readers take a checkpoint holding it as weights-only.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

from reshard.errors import ReshardError
from reshard.storage import files as fs

if TYPE_CHECKING:
    from reshard.core.catalog import Catalog

PROVENANCE = "reshard-thinned.json"
KIND = "reshard.thinned"


@dataclass(frozen=True)
class Form:
    """The weights-only form of one checkpoint: files relative to its folder (or the file itself, "")."""
    kept: tuple[str, ...]           # taken over unchanged
    dropped: tuple[str, ...]        # not written (the optimizer's state, the engine's), or written again
    what: str                       # what is dropped, in words: "the optimizer state (2 *_optim_states.pt files)"
    load: str                       # the framework's weights-only load that takes it
    # files written anew from the checkpoint's tensors (write requests: reshard.core.write_requests, paths relative
    # to its folder), where the form is no subset of its files (Megatron's .distcp files hold model and optimizer)
    written: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Trained:
    """How many of the full checkpoint's parameters its optimizer trained and how many it left frozen: the
    optimizer's param groups said so, and the weights-only form drops them, so the record keeps the counts."""
    trainable: int
    frozen: int

    @classmethod
    def of(cls, catalog: Catalog) -> Trained:
        """The counts of `catalog`'s params, by their kind."""
        kinds = [p.kind for p in catalog.params.values()]
        return cls(kinds.count("trainable"), kinds.count("frozen"))


def provenance_record(thinned_on: str, what: str, dropped: tuple[str, ...], bytes_before: int, bytes_after: int,
                      source_format: str, keep_masters: bool, trained: Trained) -> str:
    """PROVENANCE's text."""
    return json.dumps({"kind": KIND, "thinned_on": thinned_on, "from": f"a full {source_format} checkpoint",
                       "dropped": what, "dropped_files": list(dropped), "bytes_before": bytes_before,
                       "bytes_after": bytes_after, "keep_masters": keep_masters,
                       "trainable": trained.trainable, "frozen": trained.frozen}, indent=1) + "\n"


def trained(record: dict) -> Trained | None:
    """The counts a thinned checkpoint's record kept of its source (None: a record written before they were)."""
    trainable, frozen = record.get("trainable"), record.get("frozen")
    if _count(trainable) and _count(frozen):
        return Trained(trainable, frozen)
    return None


def _count(n: object) -> TypeGuard[int]:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def written_record(source: str, load: str, trained: Trained) -> str:
    """PROVENANCE's text for a weights-only form written from a source that holds no optimizer state (a model
    imported for training): nothing was dropped; `trained`, what the form's one param group holds."""
    return json.dumps({"kind": KIND, "from": source, "dropped": "nothing: the source holds no optimizer state",
                       "dropped_files": [], "load": load, "trainable": trained.trainable,
                       "frozen": trained.frozen}, indent=1) + "\n"


def provenance(folder: str) -> dict | None:
    """The record in a thinned checkpoint's folder, or None (not thinned, or not readable as one)."""
    path = os.path.join(folder, PROVENANCE)
    if not fs.isfile(path):
        return None
    try:
        with fs.open(path) as f:
            data = json.loads(f.read(1 << 16))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == KIND else None


def is_thinned(folder: str) -> bool:
    return fs.isfile(os.path.join(folder, PROVENANCE))


def needs_optimizer(catalog, output: str) -> None:
    """A writer whose `output` resumes training refuses a source without optimizer state (a weights-only
    checkpoint), in one line naming it."""
    if not catalog.param_groups:
        raise ReshardError.at(catalog.root, f"no optimizer state (weights only); {output} resumes training and needs "
                                            "the optimizer's state, so it is not written")
