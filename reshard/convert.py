"""convert: source checkpoint + target spec -> Plan -> files. The steps in order, nothing more."""
from __future__ import annotations

import os

from reshard.catalog import Catalog
from reshard.errors import ReshardError, UsageError
from reshard.layout import Layout
from reshard.planner import Plan, plan


def target_layout(catalog: Catalog, to: str) -> Layout:
    """`to` is a spec ("dp=4,zero=3") or a layout descriptor file; degrees either leaves out keep the source's."""
    source = catalog.layout
    if os.path.isfile(to):
        return source.with_descriptor(to)
    if to and "=" not in to:     # every key of a spec is key=value: this names a file
        raise ReshardError.at(to, "no such layout descriptor file (a topology spec is key=value, e.g. dp=4,zero=3)")
    return source.with_spec(to)


def make_plan(catalog: Catalog, to: str, tag_out: str | None = None, fmt: str | None = None) -> Plan:
    """The plan writing `catalog` at topology `to` in format `fmt` (default: the source's format)."""
    from reshard.validate import require_complete

    require_complete(catalog)
    return plan_for(catalog, target_layout(catalog, to), tag_out, fmt)


def plan_for(catalog: Catalog, target: Layout, tag_out: str | None = None, fmt: str | None = None) -> Plan:
    """The plan writing a whole `catalog` at layout `target` in format `fmt` (default: the source's format)."""
    tag = tag_out or catalog.tag or "converted"
    save_dir = os.path.dirname(catalog.root)
    target_format = _writer(catalog, fmt)
    targets = target_format.target_files(catalog, target, tag, save_dir)
    return plan(catalog, target, targets, tag, target_format.describe(target, tag))


def batch_size_advice(catalog: Catalog, target: Layout, fmt: str | None = None) -> str | None:
    """What happens to the global batch size when dp changes, and how to keep it (format-specific)."""
    return _writer(catalog, fmt).batch_size_advice(catalog, target)


def _writer(catalog: Catalog, fmt: str | None):
    """The writer of format `fmt`, by default the source's own; a source of a format no writer writes needs one."""
    from reshard.formats import WRITERS, writer
    if fmt is None and catalog.format not in WRITERS:
        raise UsageError.at(catalog.root, f"{catalog.format} checkpoints are read, not written: name the output's "
                                          f"format with --format ({', '.join(WRITERS)})")
    return writer(fmt or catalog.format)
