"""The rule files that ship with reshard (reshard/layouts/<kind>/, package data: a pip-installed reshard has them),
found by name: `--layout-rules megatron-gpt` is the shipped tp-rules/megatron-gpt.json, `--names mixtral-autoep-hf`
an export-names file, `--to dp4-zero3` a topology descriptor. A path (anything that exists, holds a separator or ends
in .json) is taken as given, and its reader says what is wrong with it; it is read through reshard.storage, so a file
in object storage (`--to s3://bucket/dp4.json`) is read as one on disk. A shipped file lies in the folder of its kind
(FOLDER), and its own "kind" field must agree: load() checks every file, shipped or given, the same way.
"""
from __future__ import annotations

import importlib.resources
import json
import os

from reshard.errors import ReshardError, UsageError
from reshard.storage import files as fs

TP_RULES, EXPORT_NAMES, LAYOUT = "reshard.tp-rules", "reshard.export-names", "reshard.core.layout"
MEGATRON_BUFFERS, MODULE_NAMES = "reshard.megatron-buffers", "reshard.module-names"
WHAT = {TP_RULES: "tensor-parallel rule file", EXPORT_NAMES: "export-names file", LAYOUT: "topology descriptor",
        MEGATRON_BUFFERS: "Megatron parameter-order file", MODULE_NAMES: "module-names file"}
# The folder under SHIPPED holding the shipped files of each kind: a reader of the tree sees a file's kind in its path.
FOLDER = {TP_RULES: "tp-rules", EXPORT_NAMES: "export-names", LAYOUT: "topologies",
          MEGATRON_BUFFERS: "megatron-buffers", MODULE_NAMES: "module-names"}
SUFFIX = ".json"
# Installed as plain files (pip unpacks wheels), so the folder is a path the readers open like any other file.
SHIPPED = importlib.resources.files("reshard") / "layouts"


def shipped(kind: str, flag: str | None = None) -> dict:
    """{name: path} of the shipped files of `kind`, by name; with `flag`, those whose JSON sets that key true (a
    module-names file's "experts": its rules place a mixture-of-experts model's experts)."""
    folder = SHIPPED / FOLDER[kind]
    out = {}
    for entry in folder.iterdir() if folder.is_dir() else ():
        if entry.name.endswith(SUFFIX) and (flag is None or _flag_set(entry, flag)):
            # an installed package's files() is a pathlib.Path; typeshed's Traversable is not os.PathLike
            out[entry.name[:-len(SUFFIX)]] = os.fspath(entry)  # type: ignore[call-overload]
    return dict(sorted(out.items()))


def names(kind: str, flag: str | None = None) -> str:
    """The shipped names of `kind` (with `flag` set, as shipped), for help and messages: "llama-autotp,
    llama-autotp-tied, megatron-gpt"."""
    return ", ".join(shipped(kind, flag))


def find(given: str, kind: str) -> str:
    """The path `given` names: itself when it is a path, else the shipped file of `kind` of that name; an unknown
    name is a usage error listing the shipped ones."""
    if fs.exists(given) or os.sep in given or given.endswith(SUFFIX):
        return given
    found = shipped(kind)
    if given in found:
        return found[given]
    raise UsageError.at(given, f"no such file, nor a {WHAT[kind]} shipped with reshard ({', '.join(found)})")


def kind_of(given: str, kinds: tuple[str, ...]) -> str:
    """Which of `kinds` the rule file `given` is: a path's own "kind" (the first of `kinds` where it names none of
    them, for its reader to refuse), or the kind a shipped file of that name is."""
    if fs.exists(given) or os.sep in given or given.endswith(SUFFIX):
        try:
            with fs.open(given) as f:
                kind = json.load(f).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        return kind if kind in kinds else kinds[0]
    return next((kind for kind in kinds if given in shipped(kind)), kinds[0])


def load(given: str, kind: str) -> tuple[str, dict]:
    """(the path `given` names, as find; its JSON object), checked to be a version 1 file of `kind`: a file that
    cannot be read or is not one is a one-line error naming it."""
    path = find(given, kind)
    try:
        with fs.open(path) as f:
            spec = json.load(f)
    except OSError as e:
        raise ReshardError.at(path, f"cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ReshardError.at(path, f"not JSON: {e}") from None
    if not isinstance(spec, dict) or spec.get("kind") != kind or spec.get("version") != 1:
        article = "an" if WHAT[kind][0] in "aeiou" else "a"
        raise ReshardError.at(path, f'not {article} {WHAT[kind]} (needs "kind": "{kind}", "version": 1)')
    return path, spec


def _flag_set(entry, flag: str) -> bool:
    """Does the shipped file set `flag` true? (One that cannot be read sets nothing; load() names what is wrong.)"""
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get(flag) is True
