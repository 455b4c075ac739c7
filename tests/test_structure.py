"""The package's import structure: no import cycle, no private name (`_x`) taken from another module.

Imports are read from the source (module level and inside functions alike: a lazy import is still a cycle).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

def _modules(root: Path) -> dict:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_structure(root: Path) -> tuple:
    """(edges {module: {imported module}}, {(module, other module, private name)}) of the package at root."""
    mods = _modules(root)
    edges, private = {m: set() for m in mods}, set()
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}                           # local name -> module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        edges[module].add(a.name)
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in mods:            # a submodule: the edge goes to it, not to its package
                        edges[module].add(sub)
                        aliases[a.asname or a.name] = sub
                    elif node.module in mods:
                        edges[module].add(node.module)
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            private.add((module, node.module, a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.add((module, aliases[node.value.id], node.attr))
    return edges, private


def cycles(edges: dict) -> set:
    """Every strongly connected set of more than one module, as a sorted tuple (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                found.add(tuple(sorted(group)))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_and_no_private_import_in_reshard():
    edges, private = import_structure(REPO / "reshard")
    assert cycles(edges) == set()
    assert private == set()


def test_the_check_finds_a_cycle_and_a_private_import(tmp_path):
    """Negative control: a lazy import closing a cycle, and a private name taken two ways, are found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n\ndef f():\n    return b._hidden()\n")
    (pkg / "b.py").write_text("def _hidden():\n    from pkg.a import f\n    return f\n")
    (pkg / "c.py").write_text("from pkg.b import _hidden\n")
    edges, private = import_structure(pkg)
    assert cycles(edges) == {("pkg.a", "pkg.b")}
    assert private == {("pkg.a", "pkg.b", "_hidden"), ("pkg.c", "pkg.b", "_hidden")}
