"""Export names undone: a model published under its consumer's names (a Hugging Face Llama folder) brought back to
the names and cuts of the checkpoint an export-names rule file (reshard.rules.export_names) maps from, so the same rule
file that exports a Megatron save to Hugging Face imports a Hugging Face model into a Megatron save.

Each rule is read backwards: a rename's template becomes the pattern and its match the template (module_names.inverse:
literal text around capturing groups, every group used); a "rows" cut becomes a join of its parts, in `groups`
blocks when the rule gives groups (a fused QKV per query group: each group's q rows, then its k, then its v), the
count answered by the hyperparameters; a "strided" reordering becomes its inverse (module_names.ModuleRule.strided:
torchtitan's interleaved rotary pairs of q and k put back from Hugging Face's halves); a split is refused; a name no
rule's parts or template produce is refused by the rule file's "refuse" rule where it has one, else kept. The config
section read backwards gives those hyperparameters from the model's config (config.json; a rule file without a config
section, torchtitan's, reads the config's own values by name, as export's --config does): each `{"from": NAME}`
value found (nested objects too; a `negated` one negated) is the hyperparameter NAME, `default` where the config says
nothing, and each literal value the config gives must be the rule file's (an activation, a bias, a RoPE type it does
not name is refused). `requires` is added as said. What results is a module_names.ModuleNames of renames, joins and
reorderings: each part's fragments become fragments of the joined param, their boxes cut where they cross a group
(a reordered param's: one box per row), so reading and writing stay byte copies.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError
from reshard.formats.hf import model as hf_model, sharding as hf
from reshard.rules import export_names, module_names, name_rules
from reshard.rules.export_names import Config, ExportNames, From, NameRule

MISSING = object()


@dataclass(frozen=True)
class ModelHyperparameters:
    """The notes of a catalog brought back to a checkpoint's names: the model's hyperparameters under the
    checkpoint's own names (Megatron's args: num_query_groups, kv_channels, ...), which its writer builds its
    arguments from (an export_names.ModelFacts)."""
    values: tuple[tuple[str, Any], ...]
    source: str         # the config file they were read from

    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.values)

    def param_details(self, name: str) -> dict[str, Any]:
        return {}

    def layout_scalar(self, key: str, value: object) -> bool:
        return False

    def scalars(self) -> dict[str, Any]:
        return {}


def hyperparameters(rules: ExportNames, config: Mapping[str, Any], config_path: str) -> dict[str, Any]:
    """The hyperparameters the rule file's config section maps to `config`'s values, with its `requires`; a
    literal value `config` contradicts, or two values of one hyperparameter that disagree, are refused in one line
    naming the config file."""
    if rules.config is None:    # the config's own values answer the counts by name, as export --config's do
        return {**config, **dict(rules.requires)}
    found: dict[str, tuple[str, Any]] = {}
    defaults: dict[str, tuple[str, Any]] = {}
    _read(rules, rules.config, config, "", config_path, found, defaults)
    out = {name: value for name, (_, value) in defaults.items() if name not in found}
    out.update({name: value for name, (_, value) in found.items()})
    out.update(dict(rules.requires))
    return out


def _read(rules: ExportNames, config: Config, given: Mapping[str, Any], prefix: str, path: str, found: dict,
          defaults: dict) -> None:
    for key, wanted in config.values:
        value = given.get(key, MISSING)
        where = f"{prefix}{key}"
        if isinstance(wanted, Config):
            nested = {} if value is MISSING else value
            if not isinstance(nested, Mapping):
                raise ReshardError.at(path, f"{where} = {value!r}: an object was expected")
            _read(rules, wanted, nested, f"{where}.", path, found, defaults)
        elif isinstance(wanted, From):
            name = wanted.names[0]
            if value is MISSING or value is None:
                if wanted.has_default:
                    defaults.setdefault(name, (where, (not wanted.default) if wanted.negated else wanted.default))
                continue
            value = (not value) if wanted.negated else value
            if name in found and found[name][1] != value:
                raise ReshardError.at(path, f"{where} and {found[name][0]} disagree ({name}: {value!r}, "
                                            f"{found[name][1]!r})")
            found[name] = (where, value)
        elif value is not MISSING and value != wanted:
            raise ReshardError.at(path, f"{where} = {value!r}: {rules.path} takes {wanted!r} only")


def undone(rules: ExportNames, facts: Mapping[str, Any]) -> module_names.ModuleNames:
    """The rule file read backwards (see the module's doc), its counts answered by `facts`."""
    out: list[module_names.ModuleRule] = []
    for i, rule in enumerate(rules.rules):
        if rule.refuse is not None or (rule.name is None and rule.rows is None):
            continue        # (a refusal or a drop names no tensor of the model)
        if rule.split:
            raise ReshardError.at(rules.path, f"rule {i}: a split rule is not undone yet")
        if rule.strided is not None:
            out.append(_unstrided(rules, i, rule, facts))
            continue
        if rule.rows is None:
            out.append(module_names.inverse(rules.path, i, module_names.ModuleRule(rule.pattern, rule.name)))
            continue
        out += _joins(rules, i, rule, facts)
    refusals = [r for r in rules.rules if r.refuse is not None]
    return RefusingNames(rules.path, tuple(out), tuple(refusals))


def _unstrided(rules: ExportNames, i: int, rule: NameRule, facts: Mapping[str, Any]) -> module_names.ModuleRule:
    """A strided rule read backwards: the rename undone, each block's rows put back. The rule takes row i·S + j of
    a block of N rows to row j·(N/S) + i; the same reordering by N/S takes it back, exactly, where S divides N (a
    block it does not divide is refused in one line)."""
    assert rule.strided is not None and rule.name is not None
    given = rule.strided.block
    names = (given,) if isinstance(given, str) else () if isinstance(given, int) else given
    if names and not any(isinstance(facts.get(n), int) and not isinstance(facts.get(n), bool) for n in names):
        raise ReshardError.at(rules.path, f"rule {i}: its block is {'/'.join(names)}, which the model's config does "
                                          "not give as a whole number")
    block = rules.count(given, facts, rule.pattern.pattern, "block")
    if block <= 0 or block % rule.strided.stride:
        raise ReshardError.at(rules.path, f"rule {i}: blocks of {block} rows do not go by {rule.strided.stride}: "
                                          "the reordering cannot be undone")
    back = module_names.inverse(rules.path, i, module_names.ModuleRule(rule.pattern, rule.name))
    return replace(back, strided=(block, block // rule.strided.stride))


def _joins(rules: ExportNames, i: int, rule: NameRule, facts: Mapping[str, Any]) -> list[module_names.ModuleRule]:
    """A rows rule read backwards: one join per part, each matching that part's name, all joining every part."""
    assert rule.rows is not None
    groups = rules.count(rule.rows.groups, facts, rule.pattern.pattern, "groups")
    backs = [module_names.inverse(rules.path, i, module_names.ModuleRule(rule.pattern, part.name))
             for part in rule.rows.parts]
    # each undone pattern names the match's groups g<N> (N: the rule's own numbers), so the parts' templates, their
    # references renamed so, name every part from whichever part matched, where all parts refer to the same groups
    references = [set(name_rules.REFERENCE.findall(part.name)) for part in rule.rows.parts]
    if any(r != references[0] for r in references):
        raise ReshardError.at(rules.path, f"rule {i}: its parts refer to different groups of its match: they "
                                          "cannot be joined back")
    joined = tuple(name_rules.REFERENCE.sub(lambda m: f"\\g<g{m.group(1) or m.group(2)}>", part.name)
                   for part in rule.rows.parts)
    return [module_names.ModuleRule(back.pattern, back.name, joined, 0, groups) for back in backs]



@dataclass(frozen=True)
class RefusingNames(module_names.ModuleNames):
    """Undone rules, with the rule file's refusals: a param that no undone rule names and a refusal matches is
    refused, naming it and the refusal's reason (a bias, a QK norm: what the checkpoint's model does not hold)."""
    refusals: tuple[NameRule, ...] = ()

    def apply(self, catalog: Catalog) -> Catalog:
        for name in catalog.params:
            if not any(r.pattern.fullmatch(name) for r in self.rules):
                refusal = next((r for r in self.refusals if r.pattern.fullmatch(name)), None)
                if refusal is not None:
                    raise ReshardError.at(self.path, f"{name}: {refusal.refuse}")
        return super().apply(catalog)


def apply(rules: ExportNames, catalog: Catalog, config: Mapping[str, Any], config_path: str) -> Catalog:
    """`catalog` (a model under its consumer's names, with its config) under the checkpoint's names, its notes the
    hyperparameters read back (ModelHyperparameters)."""
    facts = hyperparameters(rules, config, config_path)
    renamed = undone(rules, facts).apply(catalog)
    return replace(renamed, notes=ModelHyperparameters(tuple(sorted(facts.items())), config_path))


def load(names: str, catalog: Catalog) -> Catalog:
    """apply() of the export-names file `names` (a path, or a shipped file's name) to `catalog`, with the model's
    config the rule file's config section names, from the files beside the model's weights (a Hugging Face
    folder's config.json); refused in one line where there is none."""
    rules = export_names.load(names)
    wanted = rules.config.file if rules.config is not None else hf_model.CONFIG
    path = next((p for p in catalog.model_files if os.path.basename(p) == wanted), None)
    if path is None:
        raise ReshardError.at(catalog.root, f"no {wanted} beside the weights: {rules.path} reads the model's "
                                            "hyperparameters from it")
    return apply(rules, catalog, hf.model_config(path), path)
