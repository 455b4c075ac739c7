"""The format registry (reshard/formats/registry.py) is the one place a format is described: every reader module
under reshard/formats/ is registered, and what names formats elsewhere names every registered one — the lifecycle
(list/prune/watch: a run layout its catalogs' format resolves to), the command line's help, the refusal of a
checkpoint none reads, and the docs' format tables (docs/formats/index.md, docs/index.md). Each check is a function
of its inputs, run on the tree as it is (no problem) and on a copy with one thing taken away or added (the
negative controls: a reader module nobody registered, an entry the docs do not name, help built before an entry was
added, a reader whose catalogs the lifecycle cannot place)."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from reshard.cli import args
from reshard.formats import READERS, WRITERS, registry
from reshard.lifecycle import units
from tests.helpers.cli import run_cli
from tests.helpers.repo import REPO

TABLE = REPO / "docs" / "formats" / "index.md"
INDEX = REPO / "docs" / "index.md"


def reader_modules(root: Path) -> set[str]:
    """The dotted names of the modules under `root` (a copy of reshard/) that define a reader's members at module
    level: sniff, read and FORMAT (protocol.Reader), read from the source."""
    found = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        if {"sniff", "read"} <= defs and "FORMAT" in assigned:
            found.add(".".join(path.relative_to(root.parent).with_suffix("").parts))
    return found


def unregistered(root: Path, formats: tuple[registry.Format, ...]) -> list[str]:
    return [f"{m}: a reader no registry entry names" for m in sorted(reader_modules(root))
            if m not in {r for f in formats for r in f.readers}]


def unplaced(formats: tuple[registry.Format, ...]) -> list[str]:
    """Readers whose catalogs' format (FORMAT) is no entry's: the lifecycle (units.format_unit) could not name what
    they read."""
    names = {f.name for f in formats}
    return [f"{r}: FORMAT {importlib.import_module(r).FORMAT!r} is no registry entry's" for f in formats
            for r in f.readers if importlib.import_module(r).FORMAT not in names]


def _words(text: str) -> str:
    return " ".join(text.split())


def unnamed_in(text: str, where: str, formats: tuple[registry.Format, ...], of) -> list[str]:
    """Entries whose `of(entry)` does not appear in `text` (whitespace as wrapping leaves it)."""
    return [f"{where} does not name {f.name} ({of(f)!r})" for f in formats if of(f) and _words(of(f)) not in
            _words(text)]


def table_rows(page: Path) -> list[tuple[str, set[str]]]:
    """(first cell, the pages its row links) of each row of the page's markdown table."""
    rows = []
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) > 1 and not set(cells[0]) <= set("-: "):
            rows.append((cells[0], {m.split("#")[0] for m in re.findall(r"\]\(([^)]+)\)", line)}))
    return rows


def missing_from_table(page: Path, formats: tuple[registry.Format, ...]) -> list[str]:
    rows = table_rows(page)
    return [f"{page.name}: no row names {f.title!r} linking {f.page}" for f in formats
            if not any(f.title in first and f.page in linked for first, linked in rows)]


def unthinnable(help_text: str, formats: tuple[registry.Format, ...]) -> list[str]:
    return [f"thin --help does not name {form.what!r}" for f in formats for form in f.thin
            if _words(form.what) not in _words(help_text)]


def problems(root: Path, formats: tuple[registry.Format, ...], help_text: str) -> list[str]:
    """`help_text`: `convert --help` and `thin --help`."""
    return (unregistered(root, formats) + unplaced(formats)
            + unnamed_in(help_text, "convert --help", formats, lambda f: f.reads)
            + unnamed_in(help_text, "convert --help", formats, lambda f: f.writes)
            + unthinnable(help_text, formats)
            + missing_from_table(TABLE, formats)
            + unnamed_in(INDEX.read_text(), "docs/index.md", formats, lambda f: f.title))


def convert_help() -> str:
    """`convert --help` and `thin --help`: what the command line says of formats and of weights-only forms."""
    return run_cli("convert", "--help", check=0).stdout + run_cli("thin", "--help", check=0).stdout


def test_every_reader_is_registered_and_named_by_the_lifecycle_help_and_docs():
    assert problems(REPO / "reshard", registry.FORMATS, convert_help()) == []
    assert READERS == registry.readers() and list(WRITERS) == list(registry.writers())
    for f in registry.FORMATS:      # the lifecycle's name for what each reader sniffs: its entry's run layout
        for r in f.readers:
            assert units.format_unit("any", importlib.import_module(r).FORMAT).framework == f.run.unit


def test_a_reader_module_nobody_registered_is_caught(tmp_path):
    root = tmp_path / "reshard"
    (root / "formats" / "newfmt").mkdir(parents=True)
    (root / "formats" / "newfmt" / "reader.py").write_text(
        'FORMAT = "newfmt"\n\n\ndef sniff(path, tag):\n    return False\n\n\ndef read(path, options):\n    pass\n')
    assert problems(root, registry.FORMATS, convert_help()) == \
        ["reshard.formats.newfmt.reader: a reader no registry entry names"]


def test_an_entry_the_docs_and_an_older_help_do_not_name_is_caught(monkeypatch):
    """An entry added after --help was built (so not in it) and named in no docs table: each place says so."""
    new = registry.Format("newfmt", "NewFormat", "newfmt.md", "NewFormat folders", registry.RunLayout("newfmt"),
                          readers=("reshard.formats.dcp.reader",), writes="a NewFormat folder",
                          thin=(registry.ThinForm("reshard.formats.dcp.weights_only", "NewFormat step folders",
                                                  "newfmt"),))
    help_text = convert_help()
    found = problems(REPO / "reshard", (*registry.FORMATS, new), help_text)
    assert found == [
        "convert --help does not name newfmt ('NewFormat folders')",
        "convert --help does not name newfmt ('a NewFormat folder')",
        "thin --help does not name 'NewFormat step folders'",
        "index.md: no row names 'NewFormat' linking newfmt.md",
        "docs/index.md does not name newfmt ('NewFormat')"]
    monkeypatch.setattr(registry, "FORMATS", (*registry.FORMATS, new))
    assert "NewFormat folders" in _words(importlib.reload(args).SOURCE_HELP)     # help derives it: named once rebuilt
    monkeypatch.undo()
    importlib.reload(args)


def test_a_reader_whose_catalogs_no_entry_names_is_caught():
    renamed = dataclasses.replace(registry.entry("torch"), name="torchfile")
    formats = tuple(renamed if f.name == "torch" else f for f in registry.FORMATS)
    assert unplaced(formats) == ["reshard.formats.single.torchsave_checkpoint: FORMAT 'torch' is no registry "
                                 "entry's"]


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_a_checkpoint_none_reads_is_refused_naming_every_format(command, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a checkpoint")
    proc = run_cli(command, path)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert unnamed_in(proc.stderr, "the refusal", registry.FORMATS, lambda f: f.reads) == []
    assert "not a checkpoint reshard can read" in proc.stderr and str(path) in proc.stderr


def _sniff_order_kept(readers: tuple[str, ...], formats: tuple[registry.Format, ...]) -> bool:
    """Is every format's reader tried before the readers of the formats it says would take its checkpoints too?"""
    at = {module: i for i, module in enumerate(readers)}
    by_name = {f.name: f for f in formats}
    return all(at[mine] < at[theirs] for f in formats for other in f.tried_before for mine in f.readers
               for theirs in by_name[other].readers)


def test_a_format_whose_checkpoints_another_reader_takes_is_tried_first(monkeypatch):
    """A Megatron-LM iteration folder is a DCP folder too, Lightning's FSDPStrategy *.ckpt/ one as well: their
    readers are tried before DCP's, though the registry (and --format's list) names dcp first."""
    assert _sniff_order_kept(registry.readers(), registry.FORMATS)
    at = registry.readers().index
    assert at("reshard.formats.megatron.reader") < at("reshard.formats.dcp.reader")
    assert at("reshard.formats.dcp.lightning_reader") < at("reshard.formats.dcp.reader")
    # negative control: fsdp's entry without its tried_before is tried in the registry's order, after dcp's (a
    # Lightning FSDP folder would be read as a plain DCP folder), and the check sees what the real entry declares
    declared = registry.FORMATS
    loose = tuple(dataclasses.replace(f, tried_before=()) if f.name == "fsdp" else f for f in declared)
    monkeypatch.setattr(registry, "FORMATS", loose)
    at = registry.readers().index
    assert at("reshard.formats.dcp.lightning_reader") > at("reshard.formats.dcp.reader")
    assert not _sniff_order_kept(registry.readers(), declared)
