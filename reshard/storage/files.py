"""Files by path, wherever they live: what the readers, the destination checks and the manifest ask of a path
(does it exist, is it a folder, what it holds, its size, its bytes) answered by the local filesystem, or, for an
`s3://bucket/key` URL, by object storage (reshard.storage.s3, imported only when such a URL is used).

A reader joins names under its folder with os.path.join and asks here; it never learns where the folder is. An
object store has no folders: a key prefix holding objects is one, and it has no symlinks.
"""
from __future__ import annotations

import builtins
import io
import os
import posixpath
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from reshard.storage.protocol import FileTree, Found
from reshard.storage.settled import settled  # noqa: F401  (re-exported: fs.settled() around a read)

SCHEMES = ("s3://",)


def is_url(path) -> bool:
    """Does `path` name an object in object storage (s3://bucket/key) rather than a local file?"""
    return isinstance(path, str) and path.startswith(SCHEMES)


def tree(path) -> FileTree:
    """Where `path` lives: the local filesystem or the object store its URL names."""
    if is_url(path):
        from reshard.storage import s3  # here: boto3 is imported only once an s3:// URL is used
        return s3.TREE
    return LOCAL


class LocalTree:
    """The local filesystem, as os.path sees it."""

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def islink(self, path: str) -> bool:
        return os.path.islink(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def getsize(self, path: str) -> int:
        return os.path.getsize(path)

    def mtime_ns(self, path: str) -> int:
        return os.stat(path).st_mtime_ns

    def files_under(self, path: str) -> list[tuple[str, int, float]]:
        """(path, bytes, mtime) of `path`, a file, or of every file under the folder `path` (links not followed)."""
        if not os.path.isdir(path):
            st = os.stat(path)
            return [(path, st.st_size, st.st_mtime)]
        out = []
        for folder, _, names in os.walk(path):
            for name in names:
                st = os.lstat(os.path.join(folder, name))
                out.append((os.path.join(folder, name), st.st_size, st.st_mtime))
        return out

    def found_under(self, path: str) -> list[Found]:
        """`path` and every name under it, each link named with where it leads and never entered; a folder that
        cannot be listed is taken as empty."""
        found, walk = [], [(path, os.lstat(path))]
        while walk:
            p, st = walk.pop()
            if os.path.islink(p):
                found.append(Found(p, st.st_size, st.st_blocks * 512, st.st_mtime, False, os.path.realpath(p)))
                continue
            folder = os.path.isdir(p)
            found.append(Found(p, st.st_size, st.st_blocks * 512, st.st_mtime, folder))
            if folder:
                try:
                    names = os.listdir(p)
                except OSError:
                    continue
                walk += [(os.path.join(p, n), os.lstat(os.path.join(p, n))) for n in names]
        return found

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        return os.walk(path)

    def identity(self, path: str) -> tuple:
        """(inode, size, mtime in ns); () when there is none."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return ()
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def open(self, path: str, mode: str = "r", newline: str | None = None, buffering: int = -1,
             random_access: bool = False) -> IO[Any]:
        if "b" not in mode:
            return builtins.open(path, mode, newline=newline)
        f = builtins.open(path, mode, buffering=buffering)
        if random_access and hasattr(os, "posix_fadvise"):     # (not on macOS)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        return f


LOCAL = LocalTree()


def exists(path) -> bool:
    return tree(path).exists(os.fspath(path))


def isdir(path) -> bool:
    return tree(path).isdir(os.fspath(path))


def isfile(path) -> bool:
    return tree(path).isfile(os.fspath(path))


def islink(path) -> bool:
    return tree(path).islink(os.fspath(path))


def listdir(path) -> list[str]:
    return tree(path).listdir(os.fspath(path))


def getsize(path) -> int:
    return tree(path).getsize(os.fspath(path))


def mtime_ns(path) -> int:
    return tree(path).mtime_ns(os.fspath(path))


def found_under(path) -> list[Found]:
    return tree(path).found_under(os.fspath(path))


def walk(path) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk's (folder, folders, files) from `path` down, top first, links not entered: prune `folders` in place
    to keep the walk out of them."""
    return tree(path).walk(os.fspath(path))


def identity(path) -> tuple:
    """What changes when the file at `path` is replaced or edited (on disk its inode, size and time); () when
    there is none."""
    return tree(path).identity(os.fspath(path))


def is_store_root(path) -> bool:
    """Does `path` name a whole store (an object store's bucket), which holds checkpoints but cannot be one?"""
    path = os.fspath(path)
    return is_url(path) and "/" not in path.split("://", 1)[1].rstrip("/")


def open(path, mode: str = "r", newline: str | None = None, buffering: int = -1,
         random_access: bool = False) -> IO[Any]:
    """The file opened for reading (`mode` "r" or "rb"), as builtins.open opens it: a seekable binary file, or
    text (UTF-8) over it. `buffering=0` (binary): each read fetches exactly what it asks for, no read-ahead;
    `random_access`: no read-ahead past what is read either (a few headers of a big file), where the storage
    reads ahead by itself (a local file's page cache)."""
    if mode not in ("r", "rb"):
        raise ValueError(f"files.open reads only (mode {mode!r})")
    path = os.fspath(path)
    if not is_url(path):
        return LOCAL.open(path, mode, newline, buffering, random_access)
    binary = tree(path).open(path, "rb", buffering=buffering)
    return binary if mode == "rb" else io.TextIOWrapper(binary, encoding="utf-8", newline=newline)


def abspath(path) -> str:
    """os.path.abspath, a URL normalized as it is (it is absolute already)."""
    path = os.fspath(path)
    return normpath(path) if is_url(path) else os.path.abspath(path)


def realpath(path) -> str:
    """os.path.realpath (symlinks followed); a URL normalized (an object store has no links)."""
    path = os.fspath(path)
    return normpath(path) if is_url(path) else os.path.realpath(path)


def normpath(path) -> str:
    """os.path.normpath; for a URL, its key normalized the same way, its scheme and bucket kept
    (s3://b/a//c/./ → s3://b/a/c)."""
    path = os.fspath(path)
    if not is_url(path):
        return os.path.normpath(path)
    scheme, _, rest = path.partition("://")
    bucket, _, key = rest.partition("/")
    key = posixpath.normpath(key) if key else ""
    return f"{scheme}://{bucket}/{key}" if key not in ("", ".") else f"{scheme}://{bucket}"


# A scratch folder is local by nature: it holds files a library in this process opens by path (DeepSpeed's engine
# checks the files it is about to load exist), so it is on the local disk whatever the checkpoint's storage.

def scratch_parent(preferred: str) -> str:
    """Where a scratch folder goes: `preferred` where it is a folder this process may write in, else the system's
    temporary folder."""
    return preferred if os.path.isdir(preferred) and os.access(preferred, os.W_OK) else tempfile.gettempdir()


def make_scratch(prefix: str, parent: str) -> str:
    """A new private folder (only this user may enter it) in the local folder `parent`; OSError where it cannot
    be made."""
    return tempfile.mkdtemp(prefix=prefix, dir=parent)
