"""The integrity manifest every convert and export writes, and its verification.

`reshard-manifest.json` at the top of the output lists each file's size and digest (computed as the bytes were
written; reshard.digests: BLAKE3 by default, the entry's key naming which), the reshard version, where
the data came from (the source's files with their sizes and modification times) and a summary of the plan. `verify`
re-reads the files: sizes always, digests when asked (`reshard validate --checksums`).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from reshard import digests, paths
from reshard.execution.progress import bar as progress_bar
from reshard.storage import files as fs, names
from reshard.version import __version__

if TYPE_CHECKING:
    from reshard.core.planner import Plan

KIND = "reshard.execution.manifest"


def build(plan: Plan, written: dict[str, tuple[int, str]], algorithm: str = digests.DEFAULT) -> dict[str, Any]:
    """The manifest of a run: `written` is {path: (size, hex digest of `algorithm`)}."""
    source_files = sorted({op.src_file for f in plan.files for s in f.storages for op in s.ops
                           if hasattr(op, "src_file")})
    summary = plan.summary()
    return {
        "kind": KIND, "version": 1, "reshard_version": __version__,
        "source": {"path": plan.source, "topology": summary.source_topology,
                   "files": [_identity(p) for p in source_files]},
        "target": {"format": summary.format, "topology": summary.target_topology, "tag": summary.tag},
        "bytes_read": summary.bytes_read, "bytes_written": summary.bytes_written,
        "files": {path: {"size": size, algorithm: digest} for path, (size, digest) in sorted(written.items())},
    }


def _identity(path: str) -> dict:
    return {"path": path, "size": fs.getsize(path), "mtime_ns": fs.mtime_ns(path)}


def file_digest(path: str, algorithm: str = digests.DEFAULT, report=None) -> tuple:
    """(size, hex digest of `algorithm`) of a file; `report(n)` is told of every block read."""
    with fs.open(path, "rb", buffering=0) as f:
        return digests.of_stream(f.read, algorithm, report)


def verify(path: str, checksums: bool, within: str | None = None, progress: bool = False) -> list:
    """Problems, one line each: unreadable manifest, missing files, size or digest mismatches (each entry's own
    algorithm: a manifest written with sha256 verifies as one written with BLAKE3).

    `within` limits the check to the files under one folder (the tag being validated: a save dir
    that training later adds tags to, and rewrites `latest` in, is still whole for this tag).
    `progress`: a bar of the bytes hashed on stderr, when it is a terminal.
    """
    folder = os.path.dirname(path)
    try:
        with fs.open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [f"{path}: unreadable manifest ({e})"]
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND or not isinstance(manifest.get("files"), dict):
        return [f"{path}: not a reshard manifest"]
    problems, to_hash = [], []
    for rel, entry in manifest["files"].items():
        why = paths.escape(rel, folder)
        if why:
            problems.append(f"{path}: names a file outside its folder: {rel!r} ({why})")
            continue
        target = fs.normpath(os.path.join(folder, rel))
        if within and not target.startswith(fs.abspath(within) + os.sep):
            continue
        if not fs.isfile(target):
            problems.append(f"{target}: missing (listed in {names.MANIFEST})")
            continue
        size = fs.getsize(target)
        if size != entry.get("size"):
            problems.append(f"{target}: {size} bytes, the manifest says {entry.get('size')}")
        elif checksums:
            recorded = digests.of_entry(entry)
            if recorded is None:
                problems.append(f"{path}: no digest for {rel} (one of {', '.join(digests.ALGORITHMS)})")
                continue
            to_hash.append((target, recorded, size))
    with progress_bar(sum(size for _, _, size in to_hash), "hashing", progress) as bar:
        for target, (algorithm, digest), _ in to_hash:
            if file_digest(target, algorithm, bar.update)[1] != digest:
                problems.append(f"{target}: {algorithm} differs from the manifest (changed after it was written)")
    return problems
