"""Export names: how an exported state dict names and cuts the checkpoint's tensors, for a consumer that
names them otherwise (Hugging Face's Mixtral takes one tensor per expert where DeepSpeed AutoEP packs them
into one; Hugging Face's Llama takes q, k and v where Megatron fuses them). A rule file
(reshard/layouts/export-names/ ships some, found by name: rule_files):

    {"kind": "reshard.export-names", "version": 1, "description": "...",
     "requires": {HYPERPARAMETER: VALUE},                        the save must record these values
     "config": {"file": "config.json", "values": {KEY: VALUE | {"from": VALUE-REF, "default": VALUE}}},
     "rules": [{"match": REGEX, "name": TEMPLATE},               renamed (TEMPLATE as re's expand: \\1, \\g<x>)
               {"match": REGEX, "name": TEMPLATE, "split": 0},   one tensor per index of dim 0, {index} in TEMPLATE
               {"match": REGEX, "rows": {"groups": N, "parts": [{"name": TEMPLATE, "rows": N}, ...]}},
                                                                 dim 0 cut into interleaved parts (below)
               {"match": REGEX, "name": TEMPLATE, "strided": {"block": N, "stride": S}},
                                                                 dim 0's rows reordered within blocks (below)
               {"match": REGEX, "drop": true},                   left out (another name of a tensor kept)
               {"match": REGEX, "refuse": REASON}]}              the export stops, naming the tensor

A name is matched with re.fullmatch, the first rule deciding; a name no rule matches keeps its name. A split
along dim 0 takes contiguous slabs of the tensor (an element offset each), so it stays a byte copy. A "rows" cut
views dim 0 as `groups` equal blocks (1 when not given), each block cut into the parts in order: a part's "rows"
is its share of each block, and the parts without "rows" share what is left equally; part i is its rows of every
block, blocks in order (a fused QKV laid out per query group [q; k; v]: groups = the query groups; SwiGLU's fused
[gate; up]: two parts, no groups). Each part is a shard of the tensor (one box per block), so the planner copies it
as boxes. A "strided" rule views dim 0 as blocks of N rows and reorders each block's rows by their stride S: first
rows 0, S, 2S, ..., then 1, S+1, ..., (a block viewed as (N/S, S) and transposed): rotary embeddings' interleaved
pairs, as torchtitan and Meta's Llama order a head's q and k rows, into the halves Hugging Face's Llama rotates (N =
the head size, S = 2). Each row is a box of the tensor, so it too is a copy of boxes. N is a whole number, or a
VALUE-REF: the name of a hyperparameter the save records, or the model config given to the export (a list of names:
the first one recorded and not null).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from reshard.core.placement import Block, Shard
from reshard.errors import ReshardError
from reshard.rules import files as rule_files, name_rules

KIND = rule_files.EXPORT_NAMES
INDEX = "{index}"
Count = int | str | tuple[str, ...]     # a whole number, or the hyperparameter(s) that give it


@runtime_checkable
class ModelFacts(Protocol):
    """A reader's notes (Catalog.notes) that know the model's hyperparameters as the save records them (Megatron's
    args): plain values by the save's own names."""

    def hyperparameters(self) -> Mapping[str, Any]:
        """{name: value} (numbers, strings, booleans, None)."""


@dataclass(frozen=True)
class Part:
    name: str               # the template of the part's name
    rows: Count | None      # its rows in each block; None: an equal share of what the sized parts leave


@dataclass(frozen=True)
class Rows:
    groups: Count           # equal blocks along dim 0
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Strided:
    block: Count            # rows per block of dim 0
    stride: int             # a block's rows taken every `stride`, from each offset in turn


@dataclass(frozen=True)
class NameRule:
    pattern: re.Pattern
    name: str | None        # the template; None: drop (or refuse, with `refuse`)
    split: bool             # one tensor per index of dim 0
    rows: Rows | None = None
    refuse: str | None = None
    strided: Strided | None = None


@dataclass(frozen=True)
class Config:
    file: str               # written beside the weights (config.json)
    values: tuple[tuple[str, Any], ...]     # (key, a literal, a From, or a nested Config of values, file "")


@dataclass(frozen=True)
class From:
    names: tuple[str, ...]  # the hyperparameters, the first recorded and not null taken
    default: Any = None     # the config's value where the hyperparameter is not recorded
    has_default: bool = False
    negated: bool = False   # the config's value is the hyperparameter's negation (a boolean)


@dataclass(frozen=True)
class ExportNames:
    path: str
    rules: tuple            # NameRule
    requires: tuple[tuple[str, Any], ...] = ()
    config: Config | None = None

    def check(self, facts: Mapping[str, Any] | None) -> None:
        """Refused in one line where the save records another value than `requires` says (or none)."""
        for key, wanted in self.requires:
            if facts is None or key not in facts:
                raise ReshardError.at(self.path, f"needs {key} = {wanted!r}, and the checkpoint does not record "
                                                 f"{'hyperparameters' if facts is None else key}")
            if facts[key] != wanted:
                raise ReshardError.at(self.path, f"requires {key} = {wanted!r}; the checkpoint has {facts[key]!r}")

    def config_text(self, facts: Mapping[str, Any] | None) -> str:
        """The config file's JSON, its values taken from the save's hyperparameters where the rules say."""
        assert self.config is not None
        return json.dumps(self._config_values(self.config, facts), indent=2) + "\n"

    def _config_values(self, config: Config, facts: Mapping[str, Any] | None) -> dict[str, Any]:
        out = {}
        for key, value in config.values:
            if isinstance(value, Config):
                value = self._config_values(value, facts)
            elif isinstance(value, From):
                found = _lookup(facts, value.names)
                if found is None and not value.has_default:
                    raise ReshardError.at(self.path, f"config {key}: the checkpoint records none of "
                                                     f"{', '.join(value.names)}")
                value = value.default if found is None else (not found) if value.negated else found
            out[key] = value
        return out

    def apply(self, entries: list, aliases: dict, facts: Mapping[str, Any] | None = None) -> tuple:
        """(entries, aliases) under the rules: entries (export.Entry) renamed, split, cut into parts or dropped; a
        tie kept between the new names of tensors renamed whole. `facts`: the save's hyperparameters, for the
        counts rules give by name."""
        self.check(facts)
        out = [new for entry in entries for new in self._entries_of(entry, facts)]
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
        return rule is not None and (rule.split or rule.rows is not None or rule.strided is not None
                                     or rule.name is None)

    def _rule(self, name: str) -> NameRule | None:
        return next((r for r in self.rules if r.pattern.fullmatch(name)), None)

    def _whole(self, name: str) -> str:
        rule = self._rule(name)
        if rule is None:
            return name
        match = rule.pattern.fullmatch(name)
        assert match is not None and rule.name is not None     # (_rule matched it; callers drop dropped names)
        return match.expand(rule.name)

    def _entries_of(self, entry, facts) -> list:
        rule = self._rule(entry.key)
        if rule is None:
            return [entry]
        if rule.refuse is not None:
            raise ReshardError.at(self.path, f"{entry.key}: {rule.refuse}")
        match = rule.pattern.fullmatch(entry.key)
        if rule.rows is not None and match is not None:
            return self._parts(entry, match, rule.rows, facts)
        if rule.name is None or match is None:      # (_rule matched it)
            return []
        template = match.expand(rule.name)
        if rule.strided is not None:
            return [self._strided(entry, template, rule.strided, facts)]
        if not rule.split:
            return [replace(entry, key=template)]
        if not entry.shape:
            raise ReshardError.at(self.path, f"{entry.key} is a scalar: it has no dim 0 to split")
        slab = math.prod(entry.shape[1:])
        return [replace(entry, key=template.replace(INDEX, str(i)), shape=tuple(entry.shape[1:]),
                        start=entry.start + i * slab) for i in range(entry.shape[0])]


    def _parts(self, entry, match: re.Match, rows: Rows, facts) -> list:
        """The parts of a "rows" cut, each a shard of the entry's tensor: one box per block of dim 0."""
        if not entry.shape or entry.start or getattr(entry, "shard", None) is not None:
            raise ReshardError.at(self.path, f"{entry.key}: a rows cut takes a whole tensor with a dim 0")
        groups = self.count(rows.groups, facts, entry.key, "groups")
        if groups <= 0 or entry.shape[0] % groups:
            raise ReshardError.at(self.path, f"{entry.key}: {entry.shape[0]} rows are not {groups} equal groups")
        block = entry.shape[0] // groups
        sized = [None if p.rows is None else self.count(p.rows, facts, entry.key, "rows") for p in rows.parts]
        free = sum(n is None for n in sized)
        left = block - sum(n for n in sized if n is not None)
        if left < 0 or (free and left % free) or (not free and left):
            raise ReshardError.at(self.path, f"{entry.key}: the parts' rows do not fill a group of {block} rows")
        rest = tuple(entry.shape[1:])
        out, first = [], 0
        for part, n in zip(rows.parts, sized, strict=True):
            n = left // free if n is None else n
            zeros = (0,) * len(rest)
            blocks = tuple(Block((g * block + first, *zeros), (g * n, *zeros), (n, *rest)) for g in range(groups))
            shape = (groups * n, *rest)
            out.append(replace(entry, key=match.expand(part.name), shape=shape, shard=Shard(shape, blocks)))
            first += n
        return out

    def _strided(self, entry, key: str, strided: Strided, facts):
        """The entry under `key`, its dim 0 reordered within blocks: a shard of the tensor, one box per row."""
        if not entry.shape or entry.start or getattr(entry, "shard", None) is not None:
            raise ReshardError.at(self.path, f"{entry.key}: a strided rule takes a whole tensor with a dim 0")
        block, step, rows = self.count(strided.block, facts, entry.key, "block"), strided.stride, entry.shape[0]
        if block <= 0 or rows % block or block % step:
            raise ReshardError.at(self.path, f"{entry.key}: {rows} rows are not blocks of {block} rows whose rows "
                                             f"go by {step}")
        rest = tuple(entry.shape[1:])
        zeros, per = (0,) * len(rest), block // step
        boxes = tuple(Block((b * block + i * step + j, *zeros), (b * block + j * per + i, *zeros), (1, *rest))
                      for b in range(rows // block) for j in range(step) for i in range(per))
        return replace(entry, key=key, shard=Shard(tuple(entry.shape), boxes))

    def count(self, count: Count, facts, name: str, what: str) -> int:
        """A rule's count: a whole number, or the first of its hyperparameters `facts` records."""
        if isinstance(count, int):
            return count
        names = (count,) if isinstance(count, str) else count
        value = _lookup(facts, names)
        if not isinstance(value, int) or isinstance(value, bool):
            recorded = f"records as {value!r}" if value is not None else "does not record"
            raise ReshardError.at(self.path, f"{name}: {what} is {'/'.join(names)}, which the checkpoint {recorded}"
                                             ", not a whole number (export --config: a model config giving it)")
        return value


def _lookup(facts: Mapping[str, Any] | None, names: tuple[str, ...]) -> Any:
    """The first of `names` that `facts` records and is not None."""
    for name in names:
        if facts is not None and facts.get(name) is not None:
            return facts[name]
    return None


def load(path: str) -> ExportNames:
    """The rules of the file at `path` (or shipped with reshard under that name); a file that is not one is a
    one-line error naming it."""
    path, spec, rules = name_rules.rules_of(path, KIND, {"kind", "version", "description", "rules", "requires",
                                                         "config", "note"})
    requires = spec.get("requires", {})
    if not isinstance(requires, dict):
        raise ReshardError.at(path, '"requires" must be an object: {hyperparameter: value}')
    return ExportNames(path, tuple(_rule(path, i, r) for i, r in enumerate(rules)), tuple(requires.items()),
                       _config(path, spec.get("config")))


def _config(path: str, config) -> Config | None:
    if config is None:
        return None
    if (not isinstance(config, dict) or not isinstance(config.get("file"), str) or not config["file"]
            or "/" in config["file"] or not isinstance(config.get("values"), dict) or set(config) - {"file", "values"}):
        raise ReshardError.at(path, '"config" must be {"file": NAME, "values": {KEY: VALUE}}')
    return Config(config["file"], _config_entries(path, config["values"]))


def _config_entries(path: str, values: dict) -> tuple[tuple[str, Any], ...]:
    out = []
    for key, value in values.items():
        if isinstance(value, dict) and "from" in value:
            if set(value) - {"from", "default", "negated"} or not isinstance(value.get("negated", False), bool):
                raise ReshardError.at(path, f'config {key}: {{"from": NAME, "default": VALUE, "negated": BOOLEAN}} '
                                            "takes nothing else")
            value = From(_names(path, f"config {key}", value["from"]), value.get("default"), "default" in value,
                         value.get("negated", False))
        elif isinstance(value, dict):       # a nested object of the config (transformers' rope_parameters)
            value = Config("", _config_entries(path, value))
        out.append((key, value))
    return tuple(out)


def _names(path: str, where: str, given) -> tuple[str, ...]:
    if isinstance(given, str):
        return (given,)
    if isinstance(given, list) and given and all(isinstance(n, str) for n in given):
        return tuple(given)
    raise ReshardError.at(path, f"{where}: a hyperparameter's name, or a list of them")


def _count_spec(path: str, where: str, given) -> Count:
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    return _names(path, where, given)


def _rule(path: str, i: int, rule) -> NameRule:
    where = f"rule {i}"
    pattern = name_rules.pattern(path, i, rule, {"match", "name", "split", "drop", "rows", "refuse", "strided",
                                                      "note"})
    if "refuse" in rule:
        if not isinstance(rule["refuse"], str) or set(rule) - {"match", "refuse", "note"}:
            raise ReshardError.at(path, f'{where}: "refuse" (a reason) goes alone')
        return NameRule(pattern, None, False, refuse=rule["refuse"])
    if "rows" in rule:
        if set(rule) - {"match", "rows", "note"}:
            raise ReshardError.at(path, f'{where}: "rows" goes alone (its parts name the tensors)')
        return NameRule(pattern, None, False, rows=_rows(path, where, rule["rows"]))
    if rule.get("drop") is True:
        if "name" in rule or "split" in rule:
            raise ReshardError.at(path, f'{where}: "drop" goes alone')
        return NameRule(pattern, None, False)
    if not isinstance(rule.get("name"), str):
        raise ReshardError.at(path, f'{where}: needs "name" (a template) or "drop": true')
    if "strided" in rule:
        given = rule["strided"]
        if set(rule) - {"match", "name", "strided", "note"} or not isinstance(given, dict) \
                or set(given) != {"block", "stride"} or not isinstance(given["stride"], int) \
                or isinstance(given["stride"], bool) or given["stride"] < 2:
            raise ReshardError.at(path, f'{where}: "strided" is {{"block": N, "stride": S >= 2}} beside "name" alone')
        return NameRule(pattern, rule["name"], False,
                        strided=Strided(_count_spec(path, f"{where} block", given["block"]), given["stride"]))
    split = rule.get("split")
    if split not in (None, 0):
        raise ReshardError.at(path, f'{where}: "split" can only be 0 (slabs of dim 0 are contiguous; '
                                    "another dim's are not a byte copy)")
    if (split == 0) != (INDEX in rule["name"]):
        raise ReshardError.at(path, f'{where}: a split names each part with {INDEX}, and only a split does')
    return NameRule(pattern, rule["name"], split == 0)


def _rows(path: str, where: str, rows) -> Rows:
    if not isinstance(rows, dict) or set(rows) - {"groups", "parts"} or not isinstance(rows.get("parts"), list) \
            or len(rows["parts"]) < 2:
        raise ReshardError.at(path, f'{where}: "rows" must be {{"groups": N, "parts": [two or more parts]}}')
    parts = []
    for part in rows["parts"]:
        if not isinstance(part, dict) or not isinstance(part.get("name"), str) or set(part) - {"name", "rows"}:
            raise ReshardError.at(path, f'{where}: each part is {{"name": TEMPLATE, "rows": N}} ("rows" optional)')
        parts.append(Part(part["name"], _count_spec(path, f"{where} rows", part["rows"]) if "rows" in part else None))
    groups = _count_spec(path, f"{where} groups", rows["groups"]) if "groups" in rows else 1
    return Rows(groups, tuple(parts))
