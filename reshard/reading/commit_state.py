"""Whether a checkpoint folder is a committed output, asked of its path: where its manifest lies (its own folder,
or its save dir's for a tag folder) and the marker of an output written in place whose manifest is not there yet.
A reader refuses such an output before reading it; validate verifies the manifest found; the lifecycle lists an
unfinished one as in progress. The names are the commit protocol's (reshard.storage.names)."""
from __future__ import annotations

import os

from reshard.storage import files as fs
from reshard.storage.names import MANIFEST, UNFINISHED


def find_manifest(root: str) -> str | None:
    """The manifest governing a checkpoint directory (its own, or its save dir's for a tag folder)."""
    for path in manifest_places(root):
        if fs.isfile(path):
            return path
    return None


def unfinished_marker(root: str) -> str | None:
    """The marker of an output written in place whose manifest is not there yet, in the folder `root` or the
    folder holding it (a tag folder of such an output): the marker's path, or None."""
    for path in manifest_places(root):
        folder = os.path.dirname(path)
        if fs.isfile(os.path.join(folder, UNFINISHED)) and not fs.isfile(path):
            return os.path.join(folder, UNFINISHED)
    return None


def manifest_places(root: str) -> list[str]:
    """Where `find_manifest` looks for the manifest of the checkpoint at `root` (a folder, or a file: its folder's)."""
    folders = [root, os.path.dirname(root)] if fs.isdir(root) else [os.path.dirname(root)]
    return [os.path.join(folder, MANIFEST) for folder in folders]
