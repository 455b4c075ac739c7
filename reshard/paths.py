"""Names that become paths under a folder, and whether they stay in it: one check for every reader and writer.

A tag (from `latest`, `--tag-out`), a shard a Hugging Face index names, a chunk DCP's `.metadata` names, a file a
manifest lists, a file a writer asks for: each is joined under a folder reshard reads or writes. A name from a file
can be anything its writer (or an attacker) put there; joined as it is, `../x` or `/abs` or a symlink planted inside
leads reshard outside that folder.
"""
from __future__ import annotations

import os

from reshard.storage import files as fs


def escape(rel, root: str | None = None, single: bool = False) -> str | None:
    """Why `rel` joined under a folder would lead outside it (None when it stays inside): not a string, empty,
    a NUL byte, an absolute path, a '..' part; with `single` (one entry of the folder: a tag, a file name) also
    a path separator or '.'; with the folder `root` on disk, a symlink whose target is outside it."""
    if not isinstance(rel, str) or not rel:
        return "it is empty" if rel == "" else f"it is a {type(rel).__name__}, not a name"
    if os.path.isabs(rel) or rel[0] in "/\\":
        return "it is an absolute path"
    if "\0" in rel:
        return "it holds a NUL byte"
    parts = rel.replace("\\", "/").split("/")
    if ".." in parts:
        return "'..' leads out of the folder"
    if single and (len(parts) > 1 or rel == "."):
        return "it is a path, not one name" if len(parts) > 1 else "it names the folder itself"
    if root is not None and not within(os.path.join(root, rel), root):
        return f"a symlink leads out of the folder (to {fs.realpath(os.path.join(root, rel))})"
    return None


def within(path: str, folder: str) -> bool:
    """Is `path` `folder` or under it, both resolved (symlinks followed, as the kernel will when writing)?"""
    path, folder = fs.realpath(path), fs.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def overlap(a: str, b: str) -> bool:
    """Is either of two paths, resolved, the other or under it?"""
    return within(a, b) or within(b, a)
