"""The training frameworks that drive DeepSpeed and write files of their own around its save: which one a folder
is (detect), and the typed description of its files (files.py; one module per framework: hf_trainer, accelerate,
lightning).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from reshard.formats.framework.files import (  # noqa: F401
    CARRIED,
    COPIED,
    COPY_RANK0,
    DROPPED,
    FAIL,
    FRESH,
    NEW_RANK_POLICIES,
    NONE,
    REPRODUCIBILITY,
    REWRITTEN,
    Disposition,
    Framework,
    FrameworkFile,
    PerRank,
)
from reshard.storage import files as fs

if TYPE_CHECKING:
    from reshard.core.catalog import Catalog


def framework_of(catalog: Catalog) -> Framework | None:
    """The framework around the catalog's save, as this package describes it (the core carries it only as a
    catalog.TrainingFramework), or None."""
    return catalog.framework if isinstance(catalog.framework, Framework) else None


def detect(path: str) -> Framework | None:
    """The framework whose folder `path` is, or None (a plain DeepSpeed save dir, any other format). Lightning
    around DeepSpeed leaves no files of its own: the DeepSpeed reader finds it in the client state (lightning.py);
    around FSDP, the reader of its DCP folder (dcp/lightning_reader.py)."""
    # imported here, not at the top: they import other formats' modules, which import the catalog, which imports
    # reshard.formats (this package's parent) as it starts
    from reshard.formats.framework import accelerate, hf_trainer
    if not fs.isdir(path):
        return None
    for module in (hf_trainer, accelerate):
        found = module.detect(fs.abspath(path))
        if found is not None:
            return found
    return None
