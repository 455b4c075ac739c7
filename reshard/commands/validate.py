"""Is a checkpoint whole? Proven on the Catalog by interval arithmetic, never element by element.

Problems come from two places: what the reader noticed while opening files (missing, unreadable,
disagreeing rank files, partitions of the wrong size) and the checks here: every element of every
logical tensor covered exactly once, every trainable parameter with its master copy and every
optimizer state, fragments inside their storages. `deep=True` also reads the bytes for NaN/Inf.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from reshard.core.catalog import MASTER, Catalog
from reshard.core.dtypes import is_floating, itemsize
from reshard.core.geometry import coverage, total_length
from reshard.core.placement import Shard, flat_runs, regions, tiles
from reshard.core.problems import CHECKSUM, DUPLICATE, MISSING, NO_STATE, NON_FINITE, OUTSIDE, REPLICA, Problem
from reshard.errors import ReshardError
from reshard.execution import manifest
from reshard.execution.progress import bar as progress_bar
from reshard.reading import commit_state
from reshard.storage import files as fs
from reshard.text import counted

MAX_RANGES_SHOWN = 3


@dataclass(frozen=True)
class ValidationReport:
    """What `validate` found: its problems (none: the checkpoint is whole) and what it counted."""
    problems: tuple[Problem, ...] = ()
    tensors: int = 0
    elements: int = 0
    missing_elements: int = 0
    duplicate_elements: int = 0
    files: int = 0
    deep: bool = False
    manifest: str | None = None     # the manifest checked, if any
    checksums: bool = False         # whether its digests were verified (sizes always are)
    # digests asked for but not verifiable: the manifest that is not there (every training save has none).
    # It says nothing about the checkpoint's coverage, which stands: not a problem.
    unverified: str | None = None
    crc_members: int = 0            # --deep: zip members whose CRC-32 was verified
    no_checksum: tuple[str, ...] = ()    # --deep: files of a format that carries no checksum

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def missing_fraction(self) -> float:
        return self.missing_elements / self.elements if self.elements else 0.0

    def summary(self) -> str:
        head = "complete" if self.ok else f"NOT complete: {counted(len(self.problems), 'problem')}"
        text = (f"{head}; {counted(self.tensors, 'logical tensor')}, {counted(self.elements, 'element')} in "
                f"{counted(self.files, 'file')}")
        if self.missing_elements:
            text += f"; {self.missing_elements:,} elements missing ({100 * self.missing_fraction:.1f}%)"
        if self.duplicate_elements:
            text += f"; {self.duplicate_elements:,} elements held twice"
        if self.deep:
            text += f"; bytes checked for NaN/Inf, {counted(self.crc_members, 'zip member')} against their CRC-32"
        if self.no_checksum:
            names = ", ".join(os.path.basename(f) for f in self.no_checksum[:MAX_RANGES_SHOWN])
            more = " …" if len(self.no_checksum) > MAX_RANGES_SHOWN else ""
            text += (f"; {counted(len(self.no_checksum), 'file')} ({names}{more}) carry no checksum: "
                     "corruption in them cannot be detected")
        if self.manifest:
            what = "sizes and digests" if self.checksums else "sizes (digests with --checksums)"
            text += f"; files checked against {os.path.basename(self.manifest)}: {what}"
        return text

    def checksum_line(self) -> str | None:
        """The line `--checksums` adds when there was no manifest to verify against (None otherwise)."""
        return f"checksums: not verified (no manifest: {self.unverified})" if self.unverified else None

    def to_dict(self) -> dict:
        """Plain data: what `reshard validate --json` prints."""
        return {"ok": self.ok, "problems": [str(p) for p in self.problems], "tensors": self.tensors,
                "elements": self.elements,
                "missing_elements": self.missing_elements, "missing_fraction": self.missing_fraction,
                "duplicate_elements": self.duplicate_elements, "files": self.files, "deep": self.deep,
                "manifest": self.manifest, "checksums_verified": self.checksums,
                "checksums_unverified": self.unverified, "crc_members": self.crc_members,
                "no_checksum": list(self.no_checksum)}


@dataclass
class _Found:
    """What the checks find, as they go; frozen into a ValidationReport at the end."""
    problems: list = field(default_factory=list)       # Problem
    tensors: int = 0
    elements: int = 0
    missing_elements: int = 0
    duplicate_elements: int = 0
    files: int = 0
    deep: bool = False
    manifest: str | None = None
    checksums: bool = False
    unverified: str | None = None
    crc_members: int = 0
    no_checksum: list = field(default_factory=list)

    def report(self) -> ValidationReport:
        return ValidationReport(**{**vars(self), "problems": tuple(self.problems),
                                   "no_checksum": tuple(self.no_checksum)})


@dataclass(frozen=True)
class Complete:
    """The proof that a catalog is whole (every element of every tensor present once, every state there): what
    planning a conversion or an export takes. Made by `prove_complete`; one is never made of a report with
    problems."""
    catalog: Catalog
    report: ValidationReport

    def __post_init__(self):
        if not self.report.ok:
            raise ValueError("a Complete needs a report without problems")


def validate(catalog: Catalog, deep: bool = False, checksums: bool = False,
             progress: bool = False) -> ValidationReport:
    """`deep` reads every byte for NaN/Inf; `checksums` verifies the digest (by its algorithm) of every file against the
    reshard manifest (sizes are checked whenever a manifest is there). `progress`: bars of the bytes read
    and hashed on stderr, when it is a terminal."""
    report = _Found(deep=deep)
    _check_model(catalog, report, deep, progress)
    _check_manifest(catalog, report, checksums, progress)
    return report.report()


def _check_model(catalog: Catalog, report: _Found, deep: bool, progress: bool) -> None:
    """The checks of one model and of each other model of the checkpoint (Catalog.companions), whose files the
    checkpoint's manifest covers."""
    report.problems += catalog.problems
    report.files += len(catalog.files)
    _check_coverage(catalog, report)
    _check_states_present(catalog, report)
    if deep:
        _check_values(catalog, report, progress)
    for companion in catalog.companions:
        _check_model(companion, report, deep, progress)


def prove_complete(catalog: Catalog) -> Complete:
    """The proof that `catalog` is whole, which planning takes; one line raised when it is not: nothing is
    converted or exported from it."""
    report = validate(catalog)
    if not report.ok:
        problems = counted(len(report.problems), "problem")
        raise ReshardError.at(catalog.root, f"the checkpoint is not complete ({problems}, "
                                            f"first: {report.problems[0]}); run `reshard validate`")
    return Complete(catalog, report)


def _check_manifest(catalog, report, checksums, progress):
    found = commit_state.find_manifest(catalog.root)
    if found:
        report.problems += [Problem.from_line(line, catalog.root, CHECKSUM)
                            for line in manifest.verify(found, checksums, within=catalog.root, progress=progress)]
        report.manifest, report.checksums = found, checksums
    elif checksums:
        report.unverified = " or ".join(commit_state.manifest_places(catalog.root))


def _where(catalog, tensor) -> str:
    files = sorted({os.path.basename(f.storage.file) for f in tensor.fragments})
    folder = catalog.root if fs.isdir(catalog.root) else os.path.dirname(catalog.root)
    return os.path.join(folder, files[0]) if len(files) == 1 else catalog.root


def _check_coverage(catalog, report):
    for tensor in catalog.tensors.values():
        report.tensors += 1
        report.elements += tensor.numel
        for frag in tensor.fragments:
            if frag.elem_offset < 0 or frag.elem_offset + frag.numel > frag.storage.numel:
                report.problems.append(Problem(frag.storage.file, _named(tensor), OUTSIDE,
                                               f"{tensor.name} ({tensor.state}) reaches outside its storage"))
        ranges = _flat_ranges(tensor)
        if ranges is None:
            continue
        gaps, overlaps, outside = coverage(ranges, tensor.numel)
        missing, doubled = total_length(gaps), total_length(overlaps)
        report.missing_elements += missing
        report.duplicate_elements += doubled
        label = f"{tensor.name} ({tensor.state}, {tensor.numel} elements)"
        if missing:         # from the checkpoint, not from the file(s) holding the rest
            report.problems.append(Problem(catalog.root, _named(tensor), MISSING,
                                           f"{label}: {missing} elements missing, at {_ranges(gaps)}"))
        if doubled:
            report.problems.append(Problem(_where(catalog, tensor), _named(tensor), DUPLICATE,
                                           f"{label}: {doubled} elements held more than once, at {_ranges(overlaps)}"))
        if outside:
            report.problems.append(Problem(_where(catalog, tensor), _named(tensor), OUTSIDE,
                                           f"{label}: fragments outside the tensor at {_ranges(outside)}"))


def _flat_ranges(tensor):
    """The flat ranges of the logical tensor its fragments hold; None when they are shards (tensor-parallel
    slices, DCP chunks) whose boxes tile it exactly, which is checked box by box without listing rows."""
    if all(f.shard is None for f in tensor.fragments):
        return [(f.start, f.stop) for f in tensor.fragments]
    boxes = [(r.at, r.shape) for f in tensor.fragments
             for r in regions(f.shard or Shard.whole(tensor.shape), f.start, f.stop)]
    if tiles(tensor.shape, boxes):
        return None
    outside = [(at, size) for at, size in boxes
               if any(a + n > d for a, n, d in zip(at, size, tensor.shape, strict=True))]
    if outside:      # a box past the tensor's end (readers refuse those): reported as outside, by its size
        return [(tensor.numel, tensor.numel + math.prod(size)) for _, size in outside]
    return [run for at, size in boxes for run in flat_runs(tensor.shape, at, size)]


def _ranges(ranges) -> str:
    shown = ", ".join(f"[{a}, {b})" for a, b in ranges[:MAX_RANGES_SHOWN])
    return shown + (f" and {len(ranges) - MAX_RANGES_SHOWN} more" if len(ranges) > MAX_RANGES_SHOWN else "")


def _check_states_present(catalog, report):
    if not catalog.param_groups:        # weights only (a thinned checkpoint): no optimizer, nothing to require
        return
    wanted = [MASTER] + catalog.optimizer_states()
    for p in catalog.params.values():
        if p.kind != "trainable":
            continue
        for state in wanted:
            if (p.name, state) not in catalog.tensors:
                report.problems.append(Problem(catalog.root, f"{p.name} ({state})", NO_STATE,
                                               f"trainable parameter {p.name} has no {state} state"))


def _check_values(catalog, report, progress):
    from reshard.reading.source_bytes import MappedFiles, replica_problem

    replicas = [r for r in catalog.replicas if not r.checked]   # second copies too big to compare at reading
    # a cast's bytes are those of the tensor it is cast from, checked there
    floating = [t for t in catalog.tensors.values() if is_floating(t.dtype) and not t.cast_from]
    total = sum(2 * _nbytes(r.copy) for r in replicas) + sum(_nbytes(t) for t in floating)
    with MappedFiles() as files, progress_bar(total, "checking", progress) as bar:
        for replica in replicas:        # read: the copy and the elements of the tensor it copies
            try:
                problem = replica_problem(files, catalog.tensor(replica.copy.name, replica.copy.state), replica)
            except Exception as e:  # a damaged file: already reported by the coverage checks
                problem = Problem.from_line(str(e), catalog.root, REPLICA, _named(replica.copy))
            if problem:
                report.problems.append(problem)
            bar.update(2 * _nbytes(replica.copy))
        for tensor in floating:
            for frag in tensor.fragments:
                try:    # in windows: a fragment in object storage is read into memory a window at a time
                    bad = sum(_count_non_finite(values, tensor.dtype, bar.update)
                              for _, values in files.windows(frag, tensor.dtype))
                except Exception as e:  # a damaged file: already reported by the coverage checks
                    report.problems.append(Problem.from_line(str(e), catalog.root, CHECKSUM, _named(tensor)))
                    break
                if bad:
                    report.problems.append(Problem(frag.storage.file, _named(tensor), NON_FINITE,
                                                   f"{tensor.name} ({tensor.state}): {bad} NaN/Inf values in elements "
                                                   f"[{frag.start}, {frag.stop})"))
        _check_crcs(catalog, files, report)


def _check_crcs(catalog, files, report) -> None:
    """The CRC-32 of every zip member a tensor lies in, whole: blocks read above hashed as they were read, the
    rest (integer tensors, padding, members no fragment reaches to the end) read now."""
    storages = {frag.storage for tensor in catalog.tensors.values() for frag in tensor.fragments}
    files.tally.expect(storages)
    report.crc_members = len({(s.file, s.offset) for s in storages if s.crc is not None})
    report.no_checksum = sorted({s.file for s in storages if s.crc is None})
    for problem in files.tally.problems():
        report.problems.append(Problem.from_line(str(problem), catalog.root, CHECKSUM))


def _named(tensor) -> str:
    """A logical tensor as a Problem names it: `name (state)`."""
    return f"{tensor.name} ({tensor.state})"


def _nbytes(tensor) -> int:
    return sum(f.numel for f in tensor.fragments) * itemsize(tensor.dtype)


def _count_non_finite(values, dtype, report, block: int = 1 << 18) -> int:
    """NaN and Inf among `values`, in blocks through buffers made once: a new temporary per block is fresh memory
    the kernel must fault in (3x the time of the test itself on 200 MB of bf16 weights)."""
    bad = 0
    n = min(block, values.size)
    bits, mask = np.empty(n, values.dtype), np.empty(n, np.bool_)
    for first in range(0, values.size, block):
        part = values[first:first + block]
        n = part.size
        if dtype == "bfloat16":     # numpy has no bfloat16: exponent bits all ones means NaN or Inf
            np.bitwise_and(part, 0x7F80, out=bits[:n])
            np.equal(bits[:n], 0x7F80, out=mask[:n])
            bad += int(np.count_nonzero(mask[:n]))
        else:
            np.isfinite(part, out=mask[:n])
            bad += n - int(np.count_nonzero(mask[:n]))
        report(part.nbytes)
    return bad
