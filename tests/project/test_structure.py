"""The package's import structure, read from the source with ast (nothing is imported):

- the format-free core (reshard.core) imports nothing of reshard.formats, at module level, inside a function or
  under TYPE_CHECKING alike;
- no import cycle among reshard's modules, counting package `__init__`s: importing `a.b.c` runs `a/__init__` and
  `a/b/__init__` first, so an import reaches every package above its module that is not above the importer too
  (those already run). Imports inside functions count as well: a lazy import is still a cycle, only a later one;
- no private name (`_x`) taken from another module: `from a import _x`, or `a._x` on a module the importer names;
- the storage layer is the one way to the filesystem: outside reshard/storage/ no raw filesystem call (`open`,
  the file operations of `os`, `os.path`'s questions to the disk, `shutil`, `tempfile`, pathlib's reads and writes)
  and no `is_url` branch on where a path lies, but for an explicit allow-list, each entry saying why; and of
  reshard.storage only its seams (files, names, protocol, routing) are imported from outside it;
- each room imports only itself and the rooms before it (ROOMS: the order data flows in), with no exception left;
- the leaves the formats share (the torch.save reader and writer, safetensors...) import no format's folder;
- no test module and no script of tools/ changes sys.path;
- of tests/, a test module, a helper or conftest imports only tests.helpers (never another test module, a
  script or conftest), and a script no test module.

Each rule is run on a small synthetic package that breaks it (the negative controls), and the few violations left
(RAW_ALLOWED, AGAINST_THE_FLOW) are listed exactly, so the test fails both when one is fixed and when a new one
appears.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import NamedTuple

from tests.helpers.repo import REPO


class Import(NamedTuple):
    module: str      # the importing module
    target: str      # the module (or package) it imports
    lazy: bool       # inside a function or under TYPE_CHECKING: not run when `module` is imported


def _modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of the package at root; a package is named by its __init__."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_package(mods: dict[str, Path], name: str) -> bool:
    return mods[name].name == "__init__.py"


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved against `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside a function or an `if TYPE_CHECKING:` block."""
    out: set[int] = set()
    for node in ast.walk(tree):
        checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or checking:
            out |= {id(inner) for inner in ast.walk(node) if isinstance(inner, (ast.Import, ast.ImportFrom))}
    return out


def imports(root: Path) -> tuple[dict[str, Path], list[Import], set[tuple[str, str, str]]]:
    """(modules, every import of one of them by another, {(module, other module, private name)}) of the package."""
    mods = _modules(root)
    found: list[Import] = []
    private: set[tuple[str, str, str]] = set()
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        lazy = _lazy_nodes(tree)
        names: dict[str, str] = {}           # local name -> the module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        found.append(Import(module, a.name, id(node) in lazy))
                        names[a.asname or a.name] = a.name
                    elif a.name.split(".")[0] in {m.split(".")[0] for m in mods}:
                        found.append(Import(module, a.name, id(node) in lazy))   # a missing module: still named
                    if not a.asname:         # `import a.b.c` binds `a`: `a.b.c._x` is read through it
                        names.setdefault(a.name.split(".")[0], a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, _is_package(mods, module), node)
                if source not in mods:
                    continue
                found.append(Import(module, source, id(node) in lazy))
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    if sub in mods:          # a submodule: it runs too
                        found.append(Import(module, sub, id(node) in lazy))
                        names[a.asname or a.name] = sub
                    if a.name.startswith("_") and not a.name.startswith("__") and source != module:
                        private.add((module, source, a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = _dotted(node.value, names)
                if owner in mods and owner != module:
                    private.add((module, owner, node.attr))
    return mods, found, private


def _dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    """The module an expression such as `b` or `pkg.sub.b` names, through the importer's bound names."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, names)
        return f"{owner}.{node.attr}" if owner else None
    return None


def graph(mods: dict[str, Path], found: list[Import]) -> dict[str, set[str]]:
    """{module: modules its imports run}: the target and each package above it that is not above the importer."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for imp in found:
        parts = imp.target.split(".")
        above_importer = {".".join(imp.module.split(".")[:i]) for i in range(1, imp.module.count(".") + 1)}
        for i in range(1, len(parts) + 1):
            reached = ".".join(parts[:i])
            if reached in mods and reached not in above_importer and reached != imp.module:
                edges[imp.module].add(reached)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """One cycle path (a, b, ..., a) through each strongly connected set of more than one module (Tarjan, then the
    shortest way back to the set's first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: set[str] = set()
            while v not in group:
                group.add(stack.pop())
            on.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return {_path_back(edges, group) for group in groups}


def _path_back(edges: dict[str, set[str]], group: set[str]) -> tuple[str, ...]:
    start = min(group)
    came: dict[str, str] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(edges[v] & group):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return (*reversed(path), start)
            if w not in came:
                came[w] = v
                todo.append(w)
    raise AssertionError(f"no way back to {start} in {sorted(group)}")


def format_imports_in(package: str, formats: str, found: list[Import]) -> set[tuple[str, str]]:
    """{(module of `package`, the formats module it imports)}, lazy imports and TYPE_CHECKING ones alike."""
    return {(imp.module, imp.target) for imp in found
            if (imp.module + ".").startswith(package + ".")
            and (imp.target + ".").startswith(formats + ".")}


# os's calls that touch the filesystem (the path arithmetic of os.path, os.fspath, os.getpid... do not)
OS_FILE_CALLS = {"stat", "lstat", "listdir", "scandir", "walk", "fwalk", "rename", "renames", "replace", "unlink",
                 "remove", "rmdir", "removedirs", "makedirs", "mkdir", "fsync", "fdatasync", "open", "link", "symlink",
                 "readlink", "utime", "truncate", "chmod", "chown", "access", "statvfs", "posix_fadvise", "pread",
                 "preadv", "pwrite", "pwritev", "sendfile", "copy_file_range"}
OS_PATH_FILE_CALLS = {"exists", "lexists", "isdir", "isfile", "islink", "ismount", "getsize", "getmtime", "getatime",
                      "getctime", "realpath", "samefile"}
WHOLE_MODULES = {"shutil", "tempfile"}      # every call of theirs touches the filesystem
PATH_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "iterdir", "touch", "rmdir", "symlink_to"}
# Raw calls outside reshard/storage/ that stay, each for its reason: {(module, call): why}
RAW_ALLOWED = {
    ("reshard.cli", "os.open"): "a broken pipe: stdout pointed at os.devnull, the process's own stream, no file "
                                "of a checkpoint",
    ("reshard.rules.files", ".iterdir"): "the rule files shipped in the package (importlib.resources: package data, "
                                        "wherever the package is installed), not a checkpoint's",
    ("reshard.rules.files", ".read_text"): "as .iterdir: a shipped rule file's kind, read from the package",
}


def raw_filesystem_calls(root: Path, storage: str) -> set[tuple[str, str]]:
    """{(module, call)} of every raw filesystem call and every `is_url` named in the package at root outside its
    package `storage`: `open(...)`, `os.X(...)` / `os.path.X(...)` for the X above (also imported by name),
    any `shutil.` or `tempfile.` call, a pathlib read or write method, `is_url` as a name or an attribute."""
    found: set[tuple[str, str]] = set()
    for module, path in _modules(root).items():
        if (module + ".").startswith(storage + "."):
            continue
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}        # a local name bound to a raw call: `from os import rename as r`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", *WHOLE_MODULES):
                allowed = {"os": OS_FILE_CALLS, "os.path": OS_PATH_FILE_CALLS}.get(node.module)
                for a in node.names:
                    if allowed is None or a.name in allowed:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "is_url" or \
                    isinstance(node, ast.Attribute) and node.attr == "is_url":
                found.add((module, "is_url"))
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                if func.id == "open":
                    found.add((module, "open"))
                elif func.id in aliases:
                    found.add((module, aliases[func.id]))
            elif isinstance(func, ast.Attribute):
                owner = ast.unparse(func.value)
                if owner == "os" and func.attr in OS_FILE_CALLS or \
                        owner == "os.path" and func.attr in OS_PATH_FILE_CALLS or \
                        owner in WHOLE_MODULES or owner in ("builtins", "io") and func.attr == "open":
                    found.add((module, f"{owner}.{func.attr}"))
                elif func.attr in PATH_METHODS:
                    found.add((module, f".{func.attr}"))
    return found


def test_nothing_outside_storage_touches_the_filesystem_itself():
    """Every read, write, listing and rename of a file goes through reshard.storage (what a path holds:
    storage.files; writing: an OutputStorage), so a checkpoint in an object store is served as one on disk; the
    few raw calls left are listed, each with its reason (RAW_ALLOWED)."""
    assert raw_filesystem_calls(REPO / "reshard", "reshard.storage") == set(RAW_ALLOWED)


def test_the_check_finds_raw_filesystem_calls_outside_storage(tmp_path):
    """Negative control: each kind of raw call, imported by name too, and an is_url branch, found outside the
    storage package and not inside it; path arithmetic and the storage's own calls are not."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/storage/__init__.py": "", "pkg/storage/files.py": "import os\n\ndef is_url(p):\n    return open(p)\n"
                                                                  "os.rename('a', 'b')\n",
        "pkg/a.py": "import os\nimport shutil\n\ndef f(p):\n    os.rename(p, p + '~')\n    shutil.rmtree(p)\n"
                    "    return os.path.isdir(p) or os.path.join(p, 'x')\n",
        "pkg/b.py": "from os import unlink as gone\nfrom os.path import exists, join\n\ndef g(p):\n"
                    "    gone(join(p, 'x'))\n    return exists(p)\n",
        "pkg/c.py": "from pkg.storage import files as fs\n\ndef h(p):\n    if fs.is_url(p):\n"
                    "        return fs.open(p)\n    with open(p) as f:\n        return f.read()\n",
        "pkg/d.py": "import tempfile\nfrom pathlib import Path\n\ndef k(p):\n    Path(p).write_text('x')\n"
                    "    return tempfile.mkdtemp()\n",
        "pkg/fine.py": "import os\nfrom pkg.storage import files as fs\n\ndef m(p):\n"
                       "    return fs.exists(os.path.join(p, 'x')), os.getpid(), os.fspath(p)\n",
    })
    assert raw_filesystem_calls(pkg, "pkg.storage") == {
        ("pkg.a", "os.rename"), ("pkg.a", "shutil.rmtree"), ("pkg.a", "os.path.isdir"),
        ("pkg.b", "os.unlink"), ("pkg.b", "os.path.exists"),
        ("pkg.c", "is_url"), ("pkg.c", "open"),
        ("pkg.d", ".write_text"), ("pkg.d", "tempfile.mkdtemp")}


# What the rest of the package may import of reshard.storage: the interface and the ways to it. The implementations
# (posix, posix_sink, s3) are reached through routing and files, by path, never named from outside.
STORAGE_SEAMS = {"files", "names", "protocol", "routing"}


def storage_layer_breaches(package: str, storage: str, found: list[Import]) -> set[tuple[str, str]]:
    """{(module outside `storage`, the storage module it imports that is not a seam)}, lazy imports alike."""
    seams = {f"{storage}.{name}" for name in STORAGE_SEAMS} | {storage}
    return {(imp.module, imp.target) for imp in found
            if (imp.module + ".").startswith(package + ".") and not (imp.module + ".").startswith(storage + ".")
            and (imp.target + ".").startswith(storage + ".") and imp.target not in seams}


def test_only_the_storage_seams_are_imported_from_outside_storage():
    _, found, _ = imports(REPO / "reshard")
    assert storage_layer_breaches("reshard", "reshard.storage", found) == set()


def test_the_check_finds_a_storage_implementation_imported_from_outside(tmp_path):
    """Negative control: a module-level and a lazy import of an implementation found; the seams and the storage's
    own imports of its implementations not."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/storage/__init__.py": "", "pkg/storage/posix.py": "", "pkg/storage/s3.py": "",
        "pkg/storage/routing.py": "from pkg.storage import posix\n\ndef f():\n    from pkg.storage import s3\n",
        "pkg/storage/files.py": "", "pkg/storage/protocol.py": "",
        "pkg/a.py": "from pkg.storage.posix import X\n",
        "pkg/b.py": "def g():\n    from pkg.storage import s3\n",
        "pkg/fine.py": "from pkg.storage import files, routing\nfrom pkg.storage.protocol import P\n",
    })
    _, found, _ = imports(pkg)
    assert storage_layer_breaches("pkg", "pkg.storage", found) == {("pkg.a", "pkg.storage.posix"),
                                                                   ("pkg.b", "pkg.storage.s3")}


# The modules directly under reshard/formats/ that list the formats and so name their folders: the package (read,
# reader_for), the registry, the Reader/Writer protocols and the containers. Every other module there is a leaf
# the formats share (the torch.save reader and writer, safetensors, the zip directory...), and knows none of them.
FORMAT_INDEXES = {"reshard.formats", "reshard.formats.registry", "reshard.formats.protocol",
                  "reshard.formats.containers"}


def shared_leaf_breaches(mods: dict[str, Path], found: list[Import], formats: str,
                         indexes: set[str]) -> set[tuple[str, str]]:
    """{(shared leaf, the format folder module it imports)}: a module directly under `formats` (not one of its
    `indexes`) importing anything inside one of its sub-packages, lazily or not."""
    depth = formats.count(".") + 1

    def in_a_folder(target: str) -> bool:
        parts = target.split(".")
        folder = ".".join(parts[:depth + 1])
        return target.startswith(formats + ".") and len(parts) > depth and folder in mods and \
            _is_package(mods, folder)

    return {(imp.module, imp.target) for imp in found
            if imp.module.startswith(formats + ".") and imp.module.count(".") == depth
            and not _is_package(mods, imp.module) and imp.module not in indexes and in_a_folder(imp.target)}


def test_the_formats_shared_leaves_know_no_format():
    """The torch.save writer pickles DeepSpeed's stand-ins through their own `stands_for` (torchsave_write.StandIn),
    not by importing DeepSpeed's folder; no other shared leaf names a format either."""
    mods, found, _ = imports(REPO / "reshard")
    assert shared_leaf_breaches(mods, found, "reshard.formats", FORMAT_INDEXES) == set()


def test_the_check_finds_a_shared_leaf_importing_a_format(tmp_path):
    """Negative control: a shared leaf importing a format's module at module level and lazily, a relative import of
    the folder itself; the registry, a format importing the leaf, and a leaf importing another leaf pass."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "", "pkg/formats/__init__.py": "from pkg.formats.ds import standins\n",
        "pkg/formats/ds/__init__.py": "", "pkg/formats/ds/standins.py": "from pkg.formats import writer\n",
        "pkg/formats/registry.py": "from pkg.formats.ds import standins\n",
        "pkg/formats/writer.py": "from pkg.formats.ds import standins\nfrom pkg.formats import reader\n",
        "pkg/formats/reader.py": "def f():\n    import pkg.formats.ds.standins\n",
        "pkg/formats/zips.py": "from . import ds\n",
    })
    mods, found, _ = imports(pkg)
    assert shared_leaf_breaches(mods, found, "pkg.formats", {"pkg.formats", "pkg.formats.registry"}) == {
        ("pkg.formats.writer", "pkg.formats.ds"), ("pkg.formats.writer", "pkg.formats.ds.standins"),
        ("pkg.formats.reader", "pkg.formats.ds.standins"), ("pkg.formats.zips", "pkg.formats.ds")}


def test_the_core_imports_no_format():
    _, found, _ = imports(REPO / "reshard")
    assert format_imports_in("reshard.core", "reshard.formats", found) == set()


def test_no_import_cycle_counting_package_inits():
    mods, found, _ = imports(REPO / "reshard")
    assert cycles(graph(mods, found)) == set()


def test_no_private_name_imported_across_modules():
    _, _, private = imports(REPO / "reshard")
    assert private == set()


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / next(iter(files)).split("/")[0]


def test_the_check_finds_a_format_import_in_the_core(tmp_path):
    """Negative control: a module-level, a lazy and a TYPE_CHECKING import of the formats, and a relative one."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "", "pkg/formats/__init__.py": "", "pkg/formats/x.py": "",
        "pkg/core/__init__.py": "",
        "pkg/core/a.py": "from pkg.formats import x\n",
        "pkg/core/b.py": "def f():\n    import pkg.formats.x\n",
        "pkg/core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.formats.x import Y\n",
        "pkg/core/d.py": "from ..formats import x\n",
        "pkg/core/fine.py": "from pkg.core import a\n",
    })
    _, found, _ = imports(pkg)
    assert format_imports_in("pkg.core", "pkg.formats", found) == {
        ("pkg.core.a", "pkg.formats"), ("pkg.core.a", "pkg.formats.x"), ("pkg.core.b", "pkg.formats.x"),
        ("pkg.core.c", "pkg.formats.x"), ("pkg.core.d", "pkg.formats"), ("pkg.core.d", "pkg.formats.x")}


def test_the_check_finds_a_cycle_through_a_package_init(tmp_path):
    """Negative control: a.x imports b.y, which runs b/__init__, which imports a.x back; and a lazy cycle. A
    package's own __init__ importing its submodule (which runs under it) is no cycle."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "from pkg import top\n", "pkg/top.py": "import os\n",
        "pkg/a/__init__.py": "", "pkg/a/x.py": "from pkg.b.y import f\n",
        "pkg/b/__init__.py": "from pkg.b import z\n", "pkg/b/y.py": "def f():\n    pass\n",
        "pkg/b/z.py": "from pkg.a import x\n",
        "pkg/c.py": "def g():\n    from pkg import d\n", "pkg/d.py": "import pkg.c\n",
    })
    mods, found, _ = imports(pkg)
    assert cycles(graph(mods, found)) == {("pkg.a.x", "pkg.b", "pkg.b.z", "pkg.a.x"), ("pkg.c", "pkg.d", "pkg.c")}


def test_the_check_finds_a_private_import(tmp_path):
    """Negative control: a private name taken by `from`, through a module's name, and through a dotted path."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n\ndef f():\n    return b._hidden()\n",
        "pkg/b.py": "def _hidden():\n    return _own()\n\ndef _own():\n    return __name__\n",
        "pkg/c.py": "from pkg.b import _hidden\n",
        "pkg/d.py": "import pkg.b\n\nX = pkg.b._own\nY = pkg.b.__name__\n",
    })
    _, _, private = imports(pkg)
    assert private == {("pkg.a", "pkg.b", "_hidden"), ("pkg.c", "pkg.b", "_hidden"), ("pkg.d", "pkg.b", "_own")}


# The rooms in the order data flows through them (docs/architecture.md): a module imports only its own room and
# those before it. Ranked by the longest prefix that names the module.
ROOMS = (("reshard.errors", "reshard.text", "reshard.version", "reshard.digests"),
         ("reshard.storage",),
         ("reshard.paths",),
         ("reshard.rules", "reshard.rules.files"),          # finding a rule file by name: the core's descriptors too
         ("reshard.core",),
         ("reshard.reading",),                              # a source's bytes, CRC-checked: what the readers read
         ("reshard.rules.module_names", "reshard.rules.export_names"),
         ("reshard.formats",),
         ("reshard.rules.import_names",),                   # reads a Hugging Face folder's config.json

         ("reshard.execution",),
         ("reshard.commands",),
         ("reshard.live", "reshard.lifecycle"),
         ("reshard", "reshard.api", "reshard.cli", "reshard.__main__", "reshard.dcp", "reshard.dcp_reader",
          "reshard.deepspeed_engine"))
# Imports against the flow that later work removes, listed exactly (the test fails when one goes or another comes)
AGAINST_THE_FLOW: set[tuple[str, str]] = set()


def rank(module: str, rooms: tuple[tuple[str, ...], ...]) -> int:
    """The room of `module`: that of the longest room prefix naming it."""
    best, at = "", -1
    for i, prefixes in enumerate(rooms):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, at = prefix, i
    return at


def against_the_flow(found: list[Import], rooms: tuple[tuple[str, ...], ...], top: str) -> set[tuple[str, str]]:
    """{(module, module of a later room it imports)}, lazy imports alike; the top package's __init__ (run by every
    import) is no target."""
    return {(imp.module, imp.target) for imp in found
            if imp.target != top and rank(imp.target, rooms) > rank(imp.module, rooms)}


def test_each_room_imports_only_the_rooms_before_it():
    _, found, _ = imports(REPO / "reshard")
    assert against_the_flow(found, ROOMS, "reshard") == AGAINST_THE_FLOW


def test_the_check_finds_an_import_against_the_flow(tmp_path):
    """Negative control: a low room importing a higher one, at module level and lazily; downward imports pass."""
    pkg = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.high import h\n", "pkg/low/__init__.py": "", "pkg/high/__init__.py": "",
        "pkg/low/a.py": "from pkg.high import h\n", "pkg/low/b.py": "def f():\n    import pkg.high.h\n",
        "pkg/high/h.py": "from pkg.low import a\n",
    })
    _, found, _ = imports(pkg)
    rooms = (("pkg.low",), ("pkg", "pkg.high"))
    assert against_the_flow(found, rooms, "pkg") == {("pkg.low.a", "pkg.high"), ("pkg.low.a", "pkg.high.h"),
                                                     ("pkg.low.b", "pkg.high.h")}


def misplaced_test_modules(tests: Path) -> set[str]:
    """What breaks tests/'s layout (folders mirroring the package): a module in a test folder that is not a test
    (helpers belong in tests/helpers/, scripts in tests/scripts/), or a test module that changes sys.path (pyproject's
    pytest `pythonpath` and the launchers' PYTHONPATH make tests/ and tools/ importable)."""
    found = set()
    for path in sorted(tests.rglob("*.py")):
        where = path.relative_to(tests)
        if where.parts[0] in ("helpers", "scripts"):
            continue
        if not (path.name.startswith("test_") or path.name in ("__init__.py", "conftest.py")):
            found.add(f"{where.as_posix()}: not a test module")
        elif path.name.startswith("test_") and patches_sys_path(path):
            found.add(f"{where.as_posix()}: patches sys.path")
    return found


def patches_sys_path(path: Path) -> bool:
    """Does the module insert into or append to sys.path (anywhere in it, a function included)?"""
    return any(isinstance(node, ast.Attribute) and ast.unparse(node) in ("sys.path.insert", "sys.path.append")
               for node in ast.walk(ast.parse(path.read_text())))


def tools_patching_sys_path(tools: Path) -> set[str]:
    """The scripts of tools/ that change sys.path: run as `python tools/x.py` a script's own folder is first on the
    path already (its sibling tools import as they are), the package is installed, and under pytest pyproject's
    `pythonpath` holds the repository and tools/; a worker that needs more is launched with PYTHONPATH."""
    return {path.name for path in sorted(tools.rglob("*.py")) if patches_sys_path(path)}


def test_test_folders_hold_tests_only():
    assert misplaced_test_modules(REPO / "tests") == set()


def test_the_layout_check_finds_a_helper_and_a_path_patch(tmp_path):
    """Negative control: a helper beside the tests and a test inserting into sys.path are named; the same helper
    in helpers/ and a test that only reads sys.path pass."""
    for name, text in {"core/helper.py": "X = 1\n", "core/test_a.py": "import sys\nsys.path.insert(0, 'x')\n",
                       "helpers/ok.py": "X = 1\n", "core/test_b.py": "import sys\nprint(sys.path[0])\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert misplaced_test_modules(tmp_path) == {"core/helper.py: not a test module", "core/test_a.py: patches sys.path"}


def cross_test_imports(tests: Path) -> set[str]:
    """`file: module` for each import of tests/ that reaches into another test module: outside tests/scripts/ any
    module of tests/ but tests.helpers (a test module, a script, conftest), in a script a test module (`test_*`);
    lazy and relative imports alike. What tests share lives in tests/helpers/, so no test module is a library."""
    found = set()
    for path in sorted(tests.rglob("*.py")):
        where = path.relative_to(tests)
        parts = where.with_suffix("").parts
        module = ".".join(("tests",) + (parts[:-1] if parts[-1] == "__init__" else parts))
        in_scripts = parts[0] == "scripts"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, parts[-1] == "__init__", node)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                names = target.split(".")
                if in_scripts:
                    reaches = names[0] == "tests" and any(name.startswith("test_") for name in names)
                else:
                    reaches = names[0] == "conftest" or (names[0] == "tests" and names[1:2] != ["helpers"])
                if reaches:
                    found.add(f"{where.as_posix()}: {target}")
    return found


def test_no_test_module_imports_another():
    assert cross_test_imports(REPO / "tests") == set()


def test_the_check_finds_an_import_of_another_test_module(tmp_path):
    """Negative control: a test module taking a helper of another (at module level, lazily, relatively), a helper
    importing a test module, a test importing a script or conftest, and a script a test module are named; imports of
    tests.helpers, of third parties, and a script's of another script pass."""
    for name, text in {
            "core/test_a.py": "from tests.core.test_b import _x\nfrom tests.helpers.cli import run_cli\n"
                              "import pytest\n",
            "core/test_b.py": "from tests.helpers import repo\n\ndef f():\n    from tests.scripts.s import y\n",
            "core/test_c.py": "from .test_b import v\nimport conftest\n",
            "helpers/h.py": "import tests.core.test_b\nfrom tests.helpers.repo import REPO\n",
            "scripts/s.py": "from tests.scripts.t import z\nfrom tests.core.test_b import w\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cross_test_imports(tmp_path) == {
        "core/test_a.py: tests.core.test_b._x", "core/test_b.py: tests.scripts.s.y",
        "core/test_c.py: tests.core.test_b.v", "core/test_c.py: conftest", "helpers/h.py: tests.core.test_b",
        "scripts/s.py: tests.core.test_b.w"}


def test_no_tool_patches_sys_path():
    assert tools_patching_sys_path(REPO / "tools") == set()


def test_the_tools_check_finds_a_path_patch(tmp_path):
    """Negative control: an insert at module level and an append inside a function are named; a tool that only
    reads sys.path, or sets the path of a process it launches, passes."""
    for name, text in {"a.py": "import sys\nsys.path.insert(0, 'x')\n",
                       "b.py": "import sys\n\ndef f():\n    sys.path.append('y')\n",
                       "c.py": "import os, sys\nprint(sys.path[0])\nENV = {**os.environ, 'PYTHONPATH': 'z'}\n"}.items():
        (tmp_path / name).write_text(text)
    assert tools_patching_sys_path(tmp_path) == {"a.py", "b.py"}
