"""Export names: how an exported state dict names and cuts the checkpoint's tensors, for a consumer that
names them otherwise (Hugging Face's Mixtral takes one tensor per expert where DeepSpeed AutoEP packs them
into one). A rule file (reshard/layouts/ ships some, found by name: rule_files):

    {"kind": "reshard.export-names", "version": 1, "description": "...",
     "rules": [{"match": REGEX, "name": TEMPLATE},               renamed (TEMPLATE as re's expand: \\1, \\g<x>)
               {"match": REGEX, "name": TEMPLATE, "split": 0},   one tensor per index of dim 0, {index} in TEMPLATE
               {"match": REGEX, "drop": true}]}                  left out (another name of a tensor kept)

A name is matched with re.fullmatch, the first rule deciding; a name no rule matches keeps its name. A split
along dim 0 takes contiguous slabs of the tensor (an element offset each), so it stays a byte copy.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace

from reshard import rule_files
from reshard.errors import ReshardError

KIND = rule_files.EXPORT_NAMES
INDEX = "{index}"


@dataclass(frozen=True)
class NameRule:
    pattern: re.Pattern
    name: str | None        # the template; None: drop
    split: bool             # one tensor per index of dim 0


@dataclass(frozen=True)
class ExportNames:
    path: str
    rules: tuple            # NameRule

    def apply(self, entries: list, aliases: dict) -> tuple:
        """(entries, aliases) under the rules: entries (export.Entry) renamed, split or dropped; a tie kept
        between the new names of tensors renamed whole."""
        out = [new for entry in entries for new in self._entries_of(entry)]
        ties = {}
        for alias, holder in aliases.items():
            if self._drops(alias):
                continue                            # a second name left out
            if self._cuts(alias) or self._cuts(holder):
                raise ReshardError.at(self.path, f"{alias} is tied to {holder}: a rule may rename tied tensors, "
                                                 "not split them or drop the one holding the data")
            ties[self._whole(alias)] = self._whole(holder)
        seen: dict[str, str] = {}
        for entry in out:
            if entry.key in seen or entry.key in ties:
                raise ReshardError.at(self.path, f"two tensors would be exported as {entry.key} "
                                                 f"({seen.get(entry.key, entry.key)} and {entry.source[0]})")
            seen[entry.key] = entry.source[0]
        return out, ties

    def _drops(self, name: str) -> bool:
        rule = self._rule(name)
        return rule is not None and rule.name is None

    def _cuts(self, name: str) -> bool:
        rule = self._rule(name)
        return rule is not None and (rule.split or rule.name is None)

    def _rule(self, name: str) -> NameRule | None:
        return next((r for r in self.rules if r.pattern.fullmatch(name)), None)

    def _whole(self, name: str) -> str:
        rule = self._rule(name)
        if rule is None:
            return name
        match = rule.pattern.fullmatch(name)
        assert match is not None and rule.name is not None     # (_rule matched it; callers drop dropped names)
        return match.expand(rule.name)

    def _entries_of(self, entry) -> list:
        rule = self._rule(entry.key)
        if rule is None:
            return [entry]
        match = rule.pattern.fullmatch(entry.key)
        if rule.name is None or match is None:      # (_rule matched it)
            return []
        template = match.expand(rule.name)
        if not rule.split:
            return [replace(entry, key=template)]
        if not entry.shape:
            raise ReshardError.at(self.path, f"{entry.key} is a scalar: it has no dim 0 to split")
        slab = math.prod(entry.shape[1:])
        return [replace(entry, key=template.replace(INDEX, str(i)), shape=tuple(entry.shape[1:]),
                        start=entry.start + i * slab) for i in range(entry.shape[0])]


def load(path: str) -> ExportNames:
    """The rules of the file at `path` (or shipped with reshard under that name); a file that is not one is a
    one-line error naming it."""
    path = rule_files.find(path, KIND)
    try:
        with open(path) as f:
            spec = json.load(f)
    except OSError as e:
        raise ReshardError.at(path, f"cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ReshardError.at(path, f"not JSON: {e}") from None
    if not isinstance(spec, dict) or spec.get("kind") != KIND or spec.get("version") != 1:
        raise ReshardError.at(path, f'not an export-names file (needs "kind": "{KIND}", "version": 1)')
    rules = spec.get("rules")
    if not isinstance(rules, list):
        raise ReshardError.at(path, '"rules" must be a list')
    return ExportNames(path, tuple(_rule(path, i, r) for i, r in enumerate(rules)))


def _rule(path: str, i: int, rule) -> NameRule:
    where = f"rule {i}"
    if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
        raise ReshardError.at(path, f'{where}: needs "match", a regular expression')
    try:
        pattern = re.compile(rule["match"])
    except re.error as e:
        raise ReshardError.at(path, f"{where}: bad regular expression: {e}") from None
    unknown = set(rule) - {"match", "name", "split", "drop", "note"}
    if unknown:
        raise ReshardError.at(path, f"{where}: unknown keys {', '.join(sorted(unknown))}")
    if rule.get("drop") is True:
        if "name" in rule or "split" in rule:
            raise ReshardError.at(path, f'{where}: "drop" goes alone')
        return NameRule(pattern, None, False)
    if not isinstance(rule.get("name"), str):
        raise ReshardError.at(path, f'{where}: needs "name" (a template) or "drop": true')
    split = rule.get("split")
    if split not in (None, 0):
        raise ReshardError.at(path, f'{where}: "split" can only be 0 (slabs of dim 0 are contiguous; '
                                    "another dim's are not a byte copy)")
    if (split == 0) != (INDEX in rule["name"]):
        raise ReshardError.at(path, f'{where}: a split names each part with {INDEX}, and only a split does')
    return NameRule(pattern, rule["name"], split == 0)
