"""The rule language both `--names` files are written in (module_names: the modules a live load fills;
export_names: an exported file's tensors, which import_names reads backwards): a JSON object of its kind holding
"rules", each a regular expression "match" over a name (re.fullmatch, the first rule deciding) beside the keys its
language adds, mostly a "name" template rewriting the name with the match's groups (\\1, \\g<1>); and how such a
rename is undone. Each mistake is one line naming the file and the rule.
"""
from __future__ import annotations

import re

from reshard.errors import ReshardError
from reshard.rules import files as rule_files

REFERENCE = re.compile(r"\\(?:(\d+)|g<(\d+)>)")     # a template's reference to a numbered group: \1, \g<1>


def rules_of(given: str, kind: str, top_keys: set[str] | None = None) -> tuple[str, dict, list]:
    """(path, the file's JSON object, its "rules") of the rule file `given` names (rule_files.load: a path, or a
    shipped file's name), a version 1 file of `kind` whose "rules" is a list; with `top_keys`, a key beside them is
    refused."""
    path, spec = rule_files.load(given, kind)
    rules = spec.get("rules")
    if not isinstance(rules, list):
        raise ReshardError.at(path, '"rules" must be a list')
    unknown = set(spec) - top_keys if top_keys is not None else set()
    if unknown:
        raise ReshardError.at(path, f"unknown keys {', '.join(sorted(unknown))}")
    return path, spec, rules


def pattern(path: str, i: int, rule: object, keys: set[str]) -> re.Pattern:
    """Rule `i` of the rule file at `path`: a JSON object of `keys` with "match", a regular expression, compiled;
    anything else a one-line error naming the file and the rule."""
    where = f"rule {i}"
    if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
        raise ReshardError.at(path, f'{where}: needs "match", a regular expression')
    try:
        compiled = re.compile(rule["match"])
    except re.error as e:
        raise ReshardError.at(path, f"{where}: bad regular expression: {e}") from None
    unknown = set(rule) - keys
    if unknown:
        raise ReshardError.at(path, f"{where}: unknown keys {', '.join(sorted(unknown))}")
    return compiled


def _literal(text: str, path: str, i: int) -> str:
    """The text a run of a pattern outside its groups stands for: escaped or plain characters only."""
    out, at = [], 0
    while at < len(text):
        char = text[at]
        if char == "\\" and at + 1 < len(text) and not text[at + 1].isalnum():
            out.append(text[at + 1])
            at += 2
        elif char in ".^$*+?{}[]|()\\":
            raise ReshardError.at(path, f"rule {i}: its match has {text[at:at + 2]!r} outside a group: not a literal "
                                        "text around groups, so it cannot be undone")
        else:
            out.append(char)
            at += 1
    return "".join(out)


def _groups(pattern: str, path: str, i: int) -> list[tuple[str, str]]:
    """[(literal text, ""), ("", group's own pattern), ...] of a match: its top-level capturing groups and the text
    around them (a group holding another capturing group cannot be undone)."""
    parts: list[tuple[str, str]] = []
    depth, start, outside, at, in_class = 0, 0, 0, 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            capturing = not pattern.startswith("(?", at) or pattern.startswith("(?P<", at)
            if depth == 0:
                if not capturing:
                    raise ReshardError.at(path, f"rule {i}: a group that does not capture outside any other: it "
                                                "cannot be undone")
                parts.append((_literal(pattern[outside:at], path, i), ""))
                start = at + 1 if not pattern.startswith("(?P<", at) else pattern.index(">", at) + 1
            elif capturing:
                raise ReshardError.at(path, f"rule {i}: a capturing group inside another: it cannot be undone")
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                parts.append(("", pattern[start:at]))
                outside = at + 1
        at += 1
    parts.append((_literal(pattern[outside:], path, i), ""))
    return parts


def undone(path: str, i: int, match: re.Pattern, template: str) -> tuple[re.Pattern, str]:
    """Rule `i`'s rename undone: (the template as a pattern, each reference its group's pattern, named g<n>; the
    match as a template, each group a reference to it). A match that is not literal text around top-level capturing
    groups, or a template leaving one out, cannot be undone: one line naming the file and the rule."""
    parts = _groups(match.pattern, path, i)
    groups = [g for text, g in parts if not text and g]
    regex, seen, at = [], set(), 0
    for found in REFERENCE.finditer(template):
        regex.append(re.escape(template[at:found.start()]))
        number = int(found.group(1) or found.group(2))
        if not 1 <= number <= len(groups):
            raise ReshardError.at(path, f"rule {i}: its template refers to group {number}, which is not one of its "
                                        "match's groups outside any other: it cannot be undone")
        regex.append(f"(?P=g{number})" if number in seen else f"(?P<g{number}>{groups[number - 1]})")
        seen.add(number)
        at = found.end()
    regex.append(re.escape(template[at:]))
    if seen != set(range(1, len(groups) + 1)):
        raise ReshardError.at(path, f"rule {i}: its template leaves out a group of its match: it cannot be undone")
    back, number = [], 0
    for text, group in parts:
        if group:
            number += 1
            back.append(f"\\g<g{number}>")
        else:
            back.append(text.replace("\\", "\\\\"))
    return re.compile("".join(regex)), "".join(back)
