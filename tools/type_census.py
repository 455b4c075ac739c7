"""How typed a package's seams are, read from its source with ast (nothing imported): functions not fully annotated
(a parameter other than self/cls, or the return, without one), `Any` written, and the fields of frozen dataclasses
annotated as a mutable container (list, dict, set: bare, or parameterized) — the issue's before/after table.

    python tools/type_census.py [PACKAGE_DIR ...]     # default: reshard/
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MUTABLE = {"list", "dict", "set"}
GENERIC = {"list", "dict", "set", "tuple", "frozenset", "Callable", "Mapping", "Sequence", "Iterable"}


@dataclass(frozen=True)
class Census:
    functions: int
    partly_annotated: int       # some annotation missing
    unannotated: int            # none at all
    any_uses: int
    bare_generics: int          # annotations naming list/dict/set/tuple/Callable with no element types: Any unsaid
    frozen_mutable_fields: int  # list/dict/set fields of frozen dataclasses
    frozen_bare_fields: int     # of those, unparameterized (`list`, `dict`)


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
    """(annotations missing, annotations possible) of a function."""
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
    params = [p for i, p in enumerate(params) if not (i == 0 and p.arg in ("self", "cls"))]
    missing = sum(p.annotation is None for p in params) + (fn.returns is None and fn.name != "__init__")
    return missing, len(params) + (fn.name != "__init__")


def _frozen(cls: ast.ClassDef) -> bool:
    return any(isinstance(d, ast.Call) and "dataclass" in ast.unparse(d.func)
               and any(k.arg == "frozen" and ast.unparse(k.value) == "True" for k in d.keywords)
               for d in cls.decorator_list)


def _container(annotation: ast.expr) -> tuple[bool, bool]:
    """(a mutable container, an unparameterized one)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.BinOp):       # `list | None`
        left, right = _container(annotation.left), _container(annotation.right)
        return left[0] or right[0], left[1] or right[1]
    if isinstance(annotation, ast.Name):
        return annotation.id in MUTABLE, annotation.id in MUTABLE
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        return annotation.value.id in MUTABLE, False
    return False, False


def _annotations(tree: ast.Module) -> list[ast.expr]:
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            out += [p.annotation for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                    if p is not None and p.annotation is not None]
            out += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            out.append(node.annotation)
    return out


def _bare(annotation: ast.expr) -> int:
    """Generic names used without element types inside one annotation."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    subscripted = {id(n.value) for n in ast.walk(annotation) if isinstance(n, ast.Subscript)}
    return sum(1 for n in ast.walk(annotation) if isinstance(n, ast.Name) and n.id in GENERIC
               and id(n) not in subscripted)


def census(root: Path) -> Census:
    functions = partly = none = anys = mutable = bare = generics = 0
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        generics += sum(_bare(a) for a in _annotations(tree))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                missing, possible = _missing(node)
                functions += 1
                partly += 0 < missing
                none += 0 < missing == possible
            elif isinstance(node, ast.Name) and node.id == "Any":
                anys += 1
            elif isinstance(node, ast.Attribute) and node.attr == "Any":
                anys += 1
            elif isinstance(node, ast.ClassDef) and _frozen(node):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign):
                        is_mutable, is_bare = _container(item.annotation)
                        mutable += is_mutable
                        bare += is_bare
    anys -= sum(1 for p in root.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.ImportFrom) for a in n.names if a.name == "Any")
    return Census(functions, partly, none, anys, generics, mutable, bare)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["reshard"]:
        print(arg, census(Path(arg)))
