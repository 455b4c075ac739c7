"""What an object store answered about paths, remembered for one read: `settled()` and the answers it holds.

Its own module because both sides use it: the callers (through reshard.storage.files) open the block, and
reshard.storage.s3, which files imports when a URL is first used, keeps its answers in it.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# What an object store answered about paths within a `settled()` block: {(question, path): answer}
ANSWERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("reshard_settled_answers", default=None)


@contextlib.contextmanager
def settled() -> Iterator[None]:
    """Within the block, what an object store says a path is (a file and its size, a folder) is asked of it once.
    For reading one checkpoint, whose readers ask it of the same files again and again, each time a request (a
    run of 30 checkpoints in a bucket: 7,200 HEADs for 700 files); nothing is written within it, and a file that
    changes under a reader is caught by the bytes it reads, as without the block. A small object opened within it
    is fetched whole, once (reshard.storage.s3). The local filesystem is asked every time (no request to save)."""
    token = ANSWERS.set({})
    try:
        yield
    finally:
        ANSWERS.reset(token)
