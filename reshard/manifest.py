"""The integrity manifest every convert and export writes, and its verification.

`reshard-manifest.json` at the top of the output lists each file's size and sha256 (computed as
the bytes were written), the reshard version, where the data came from (the source's files with
their sizes and modification times) and a summary of the plan. `verify` re-reads the files:
sizes always, hashes when asked (`reshard validate --checksums`).
"""
from __future__ import annotations

import hashlib
import json
import os

from reshard import paths
from reshard.progress import bar as progress_bar
from reshard.storage import files as fs, names
from reshard.version import __version__

NAME = names.MANIFEST
KIND = "reshard.manifest"
UNFINISHED = names.UNFINISHED      # an output written in place and not finished (reshard.storage.names)


def build(plan, digests: dict) -> dict:
    source_files = sorted({op.src_file for f in plan.files for s in f.storages for op in s.ops
                           if hasattr(op, "src_file")})
    summary = plan.summary()
    return {
        "kind": KIND, "version": 1, "reshard_version": __version__,
        "source": {"path": plan.source, "topology": summary["source_topology"],
                   "files": [_identity(p) for p in source_files]},
        "target": {"format": summary["format"], "topology": summary["target_topology"], "tag": summary["tag"]},
        "bytes_read": summary["bytes_read"], "bytes_written": summary["bytes_written"],
        "files": {path: {"size": size, "sha256": sha} for path, (size, sha) in sorted(digests.items())},
    }


def _identity(path: str) -> dict:
    return {"path": path, "size": fs.getsize(path), "mtime_ns": fs.mtime_ns(path)}


def file_digest(path: str, report=None) -> tuple:
    """(size, sha256 hex) of a file; `report(n)` is told of every block read."""
    sha = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
            size += len(block)
            if report:
                report(len(block))
    return size, sha.hexdigest()


def find(root: str) -> str | None:
    """The manifest governing a checkpoint directory (its own, or its save dir's for a tag folder)."""
    for path in places(root):
        if fs.isfile(path):
            return path
    return None


def unfinished(root: str) -> str | None:
    """The marker of an output written in place whose manifest is not there yet, in the folder `root` or the
    folder holding it (a tag folder of such an output): the marker's path, or None."""
    for path in places(root):
        folder = os.path.dirname(path)
        if fs.isfile(os.path.join(folder, UNFINISHED)) and not fs.isfile(path):
            return os.path.join(folder, UNFINISHED)
    return None


def places(root: str) -> list:
    """Where `find` looks for the manifest of the checkpoint at `root` (a folder, or a file: its folder's)."""
    folders = [root, os.path.dirname(root)] if fs.isdir(root) else [os.path.dirname(root)]
    return [os.path.join(folder, NAME) for folder in folders]


def verify(path: str, checksums: bool, within: str | None = None, progress: bool = False) -> list:
    """Problems, one line each: unreadable manifest, missing files, size or sha256 mismatches.

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
            problems.append(f"{target}: missing (listed in {NAME})")
            continue
        size = fs.getsize(target)
        if size != entry.get("size"):
            problems.append(f"{target}: {size} bytes, the manifest says {entry.get('size')}")
        elif checksums:
            to_hash.append((target, entry.get("sha256"), size))
    with progress_bar(sum(size for _, _, size in to_hash), "hashing", progress) as bar:
        for target, sha, _ in to_hash:
            if file_digest(target, bar.update)[1] != sha:
                problems.append(f"{target}: sha256 differs from the manifest (changed after it was written)")
    return problems
