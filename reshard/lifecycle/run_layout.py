"""Where the checkpoints of a training run sit: the folder and file names frameworks save under.

A run directory holds checkpoints the way its framework saves them: DeepSpeed save dirs (`latest` naming one
of the tag folders `global_stepN/`), Hugging Face Trainer output dirs (`checkpoint-N/` with any backend;
`tmp-checkpoint-N/` while one is written), Accelerate's `checkpoint_N/`, Lightning ModelCheckpoint dirs (`*.ckpt`
files or folders), Megatron-LM `iter_N/`, DCP step dirs (`step-N/` whose `.metadata` is written last), universal
trees, and reshard's own `.X.reshard-tmp` staging. `scan` finds each checkpoint whole, as reshard.lifecycle.units
recognises it by its framework's markers, and never looks inside one; a folder of checkpoint-like files that no
layout accounts for is one unknown entry. No file is opened beyond a directory listing (and the pointer files);
`pointers` says which ones something names (`latest`, a link). Nothing here follows
a symbolic link: a link is reported, never entered.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from reshard.errors import ReshardError
from reshard.formats import POINTERS, pointed as pointed_by, reader_for
from reshard.formats.dcp.chunks import METADATA, RANK_FILE
from reshard.lifecycle import units
from reshard.reading import commit_state
from reshard.storage import files as fs

# reshard's own names in a run: a prune's trash, a conversion's staging, thin's hidden siblings and journal
from reshard.storage.names import (
    MANIFEST,
    STAGING_SUFFIX,
    THIN_JOURNAL_SUFFIX,
    THIN_SUFFIX,
    THIN_TRASH_SUFFIX,
    TRASH_SUFFIX,
    UNFINISHED,
)

MAX_DEPTH = 4       # lightning_logs/version_0/checkpoints/epoch=1-step=10.ckpt is three folders down
# a conversion written in place (object storage has no rename: reshard.execution.staging) before its manifest is there
IN_PLACE = f"reshard is writing it in place ({UNFINISHED}, no {MANIFEST} yet)"
HF_STAGING = units.HF_STAGING
# A step is the number that ends a name (its extension and Lightning's `-vN` version aside): `checkpoint-1-weights`
# carries none, it is no save of step 1
STEP_IN_NAME = re.compile(r"(?:global_step|step)[=_-]?(\d+)(?:-v\d+)?$")
LAST_NUMBER = re.compile(r"(?<![0-9])(\d+)(?:-v\d+)?$")
EPOCH_ONLY = re.compile(r"^epoch=\d+(-v\d+)?$")
STEM_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")
TORCH_FILES = (".pt", ".pth", ".bin")
LIGHTNING_SUFFIX = units.LIGHTNING_SUFFIX


@dataclass(frozen=True)
class Entry:
    """One checkpoint of a run, as its name and place say. `unfinished`: why its save is not done by the names
    alone (a staging name, a DCP folder without .metadata); None when nothing says so."""
    path: str               # absolute
    name: str               # relative to the run directory
    step: int | None        # from its name; None when the name carries none
    unfinished: str | None = None
    reader: str | None = None   # the format that sniffs it (None: none does)
    unit: units.Unit | None = None      # what it is whole (None: a staging folder, judged by its name)
    member: bool = True     # of its folder's series; False: named otherwise than the save loop beside it names its own


@dataclass(frozen=True)
class Link:
    """A symbolic link in the run directory: where it points, and whether that stays inside the run."""
    path: str
    target: str             # resolved
    inside: bool


@dataclass(frozen=True)
class Scan:
    entries: list           # [Entry], in the order found
    links: list             # [Link]
    trash: list             # paths of checkpoints an interrupted prune renamed and did not finish removing
    pointers: dict          # {entry path: why something names it} (`latest`, `latest_universal`)


def trash_path(path: str) -> str:
    """The hidden name a checkpoint is renamed to before it is removed: same folder, so the rename is atomic."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TRASH_SUFFIX}")


@dataclass(frozen=True)
class ThinNames:
    """Where `reshard thin` works beside checkpoint `path`: hidden siblings in its folder, so renames are atomic."""
    path: str
    staged: str
    journal: str
    trash: str


def thin_names(path: str) -> ThinNames:
    folder, name = os.path.split(path.rstrip("/"))
    return ThinNames(os.path.join(folder, name), *(os.path.join(folder, f".{name}{suffix}") for suffix in
                                                   (THIN_SUFFIX, THIN_JOURNAL_SUFFIX, THIN_TRASH_SUFFIX)))


def thin_journals(root: str) -> list[str]:
    """The journals of `reshard thin` swaps under run directory `root` (folders MAX_DEPTH deep, links not
    followed, hidden folders not entered)."""
    found = []
    for folder, dirs, files in fs.walk(root):
        depth = os.path.relpath(folder, root).count(os.sep) + (folder != root)
        dirs[:] = [] if depth >= MAX_DEPTH else [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(folder, n) for n in files if n.startswith(".") and n.endswith(THIN_JOURNAL_SUFFIX)]
    return sorted(found)


def step_of(name: str) -> int | None:
    """The training step a checkpoint's name carries: `global_step300`, `checkpoint-300`, `epoch=2-step=300.ckpt`,
    `step-300`, `ckpt_300.pt`; None for a name without one (`last.ckpt`), with an epoch only (`epoch=2.ckpt`), or
    whose number does not end it (`checkpoint-1-weights`)."""
    base = os.path.basename(name)
    stem = next((base[:-len(s)] for s in STEM_SUFFIXES if base.endswith(s)), base)
    found = STEP_IN_NAME.search(stem)
    if found:
        return int(found.group(1))
    if EPOCH_ONLY.match(stem):
        return None
    found = LAST_NUMBER.search(stem)
    return int(found.group(1)) if found else None


def scan(root: str) -> Scan:
    """Every checkpoint under run directory `root`: each one whole, as its framework wrote it (reshard.lifecycle.units);
    a folder recognised as one checkpoint is never looked into."""
    root = fs.realpath(root)
    if not fs.isdir(root):
        raise ReshardError.at(root, "not a directory")
    unit = units.framework_unit(os.path.basename(root), units.Listing.of(root), root)
    if unit is not None:
        raise ReshardError.at(root, f"one checkpoint ({unit.what}), not a run directory: `reshard list` the folder "
                                    "holding it, `reshard inspect` it")
    found = Scan([], [], [], {})
    if commit_state.unfinished_marker(root) is not None:   # the run prefix is itself written in place: one entry
        found.entries.append(Entry(root, os.path.basename(root), step_of(os.path.basename(root)), IN_PLACE))
        return found
    _walk(root, root, 0, found)
    return replace(found, entries=_members(found.entries))


def _members(entries: list) -> list:
    """The entries, each outside its folder's series where that folder holds a save loop's checkpoints
    (`checkpoint-N/`, `global_stepN/`, `iter_N/`) and its own name is not one of them: no rule of the series
    ranks or deletes a weights export or a copy kept beside them."""
    looped = {os.path.dirname(e.name) for e in entries if units.in_series(os.path.basename(e.name))}
    return [e if units.in_series(os.path.basename(e.name)) or os.path.dirname(e.name) not in looped
            else replace(e, member=False) for e in entries]


def _walk(root: str, folder: str, depth: int, found: Scan) -> int:
    """Scan `folder` into `found`; how many checkpoints it held."""
    try:
        names = sorted(fs.listdir(folder))
    except OSError as e:
        raise ReshardError.at(folder, f"cannot list ({e.strerror})") from None
    before = len(found.entries)
    save_dir = _pointed(folder, names, found)
    for name in names:
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, root)
        if name.endswith(TRASH_SUFFIX) and name.startswith("."):
            found.trash.append(path)
            continue
        if fs.islink(path):
            target = fs.realpath(path)
            found.links.append(Link(path, target, target == root or target.startswith(root + os.sep)))
            continue
        staging = _staging(path, rel, name)
        if staging is not None:
            found.entries.append(staging)
        elif name.startswith("."):
            continue
        elif fs.isdir(path):
            _folder(root, path, rel, name, depth, save_dir, found)
        else:
            entry = _file_entry(path, rel, name)
            if entry is not None:
                found.entries.append(entry)
    return len(found.entries) - before


def _pointed(folder: str, names: list, found: Scan) -> bool:
    """Record what the registry's pointer files in `folder` name (DeepSpeed's `latest`, Megatron-LM's tracker);
    is `folder` a save dir?"""
    pointed = False
    for pointer in POINTERS:
        path = os.path.join(folder, pointer.file)
        if pointer.file in names and fs.isfile(path) and not fs.islink(path):
            pointed = True
            named = pointed_by(folder, pointer)
            if named is not None:
                found.pointers[named] = f"named by {os.path.join(os.path.basename(folder), pointer.file)}"
    return pointed


def _folder(root: str, path: str, rel: str, name: str, depth: int, save_dir: bool, found: Scan) -> None:
    """A sub-folder: a checkpoint (one row, not looked into), a folder of them (scanned), or something unknown."""
    listing = units.Listing.of(path)
    if UNFINISHED in listing.files and MANIFEST not in listing.files:
        found.entries.append(Entry(path, rel, step_of(name), IN_PLACE))
        return
    unit = units.framework_unit(name, listing, path)
    if unit is not None:
        found.entries.append(Entry(path, rel, step_of(name), None, None, unit))
        return
    holds_tags = any(p.file in listing.files for p in POINTERS)
    if not (holds_tags or units.holds_units(listing)):
        entry = _format_entry(path, rel, name, listing, save_dir)
        if entry is not None:
            found.entries.append(entry)
            return
        if any(units.is_member(n) for n in listing.files):     # a part of some checkpoint: left whole
            found.entries.append(_unknown(path, rel, name, "it holds a checkpoint's parts"))
            return
    held = _walk(root, path, depth + 1, found) if depth < MAX_DEPTH else 0
    if not held and not holds_tags and units.holds_data(listing):
        found.entries.append(_unknown(path, rel, name, "checkpoint-like files no framework's layout accounts for"))


def _staging(path: str, rel: str, name: str) -> Entry | None:
    if name.endswith(THIN_SUFFIX + STAGING_SUFFIX):     # reshard thin's (hidden): the full checkpoint is still there
        return None
    if name.startswith(".") and name.endswith(STAGING_SUFFIX):
        return Entry(path, rel, step_of(name[1:-len(STAGING_SUFFIX)]),
                     f"reshard's staging folder of {name[1:-len(STAGING_SUFFIX)]} (renamed when written)")
    staging = HF_STAGING.match(name)
    if staging and fs.isdir(path):
        return Entry(path, rel, int(staging.group(1)),
                     f"Hugging Face Trainer's staging folder (renamed checkpoint-{staging.group(1)} when saved)")
    return None


def _unknown(path: str, rel: str, name: str, what: str) -> Entry:
    return Entry(path, rel, step_of(name), None, None, units.unknown(units.UNKNOWN, what))


def _file_entry(path: str, rel: str, name: str) -> Entry | None:
    if name.endswith(LIGHTNING_SUFFIX) or (name.endswith(TORCH_FILES) and step_of(name) is not None
                                           and units.file_unit(name)):
        reader = _sniffed(path)
        return Entry(path, rel, step_of(name), None, reader, units.Unit(reader or "torch", units.READ))
    return None     # weights exports (*.safetensors), scripts, logs, training_args.bin, a checkpoint's parts


def _format_entry(path: str, rel: str, name: str, listing, save_dir: bool) -> Entry | None:
    """A folder the format registry reads whole: a DeepSpeed tag folder, a DCP folder, a universal tree."""
    if any(RANK_FILE.search(n) for n in listing.files) and METADATA not in listing.files:
        return Entry(path, rel, step_of(name), f"no {METADATA} (DCP writes it last)", "dcp",
                     units.format_unit(name, "dcp"))
    reader = _sniffed(path)
    if reader is not None:
        # a save_pretrained folder of weights alone is an export unless its name says it is a step's save
        if reader == "safetensors" and step_of(name) is None:
            return None
        return Entry(path, rel, step_of(name), None, reader, units.format_unit(name, reader))
    if save_dir and step_of(name) is not None:     # a tag folder of a save dir whose rank files are not there yet
        return Entry(path, rel, step_of(name), None, None, units.Unit("deepspeed", units.READ))
    return None


def _sniffed(path: str) -> str | None:
    try:
        reader = reader_for(path)
    except ReshardError:
        return None
    return reader.FORMAT
