"""How a conversion reads its source from disk: every page once.

A conversion reads the catalog's metadata (torchzip.load), then the tensors in the order the targets take them,
not the file's, dropping each big read from the page cache after it (blocks.SourceFiles). The kernel's
read-ahead past a read would bring back pages read and dropped already (reshard convert of a 0.44 GB AutoEP save
read 0.52 GB from disk, a dense one 0.48 GB), so neither asks for any. Measured here with the thread's block
reads (getrusage), on a file dropped from the page cache first (tmp_path must be on a disk, not tmpfs).
"""
import math
import os
import resource

import numpy as np
import torch

from reshard.blocks import SourceFiles
from reshard.formats import torchzip

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def _from_disk(path) -> int:
    """Bytes the thread reads from disk for: the catalog of the file, then its tensors b, a, c (out of file
    order; each read >= blocks.DROP_CACHE_BYTES, so dropped after it), the file dropped from the cache first."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_inblock
    tree = torchzip.load(path)
    sources = SourceFiles({})
    try:
        for key in ("b", "a", "c"):
            ref = tree[key]
            sources.read(path, ref.storage.offset + ref.storage_offset * 4, ref.numel * 4)
    finally:
        sources.close()
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_inblock - before) * 512


def test_each_page_of_the_source_is_read_from_disk_once(tmp_path, monkeypatch):
    path = tmp_path / "three.pt"
    rng = np.random.default_rng(0)
    torch.save({k: torch.from_numpy(rng.random(2 * MIB, dtype=np.float32)) for k in "abc"}, path)
    pages = math.ceil(os.path.getsize(path) / PAGE) * PAGE
    assert _from_disk(path) <= pages
    # negative control: the same reads with the kernel's read-ahead left on read pages twice
    advise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, n, advice: None if advice == os.POSIX_FADV_RANDOM
                        else advise(fd, offset, n, advice))
    assert _from_disk(path) > pages + 64 * 1024
