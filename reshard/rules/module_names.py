"""Module names: a checkpoint's params under the names and shapes of the model a training script holds, for output
that loads into that model as it is (`convert --format dcp --names mixtral-autoep-fsdp`, `dcp_reader.Reader(...,
names=)`). DeepSpeed AutoEP packs a Mixtral layer's experts as `experts.w1/w2/w3`, where transformers 5.x's Mixtral
holds `experts.gate_up_proj` (w1 and w3 joined along dim 1) and `experts.down_proj`. A rule file
(reshard/layouts/module-names/ ships some, found by name: rule_files):

    {"kind": "reshard.module-names", "version": 1, "description": "...",
     "rules": [{"match": REGEX, "name": TEMPLATE},                      renamed (re's expand: \\1, \\g<x>)
               {"match": REGEX, "name": TEMPLATE, "join": [T0, T1], "dim": d},   the params T0, T1 (templates)
                                                                        end to end along dim d, as one param
               {"match": REGEX, "drop": true}]}                         left out (another name of a param kept)

A name is matched with re.fullmatch, the first rule deciding; a name no rule matches keeps its name. `inverted()`
undoes a file of renames, for output in a format that saves under the names the rules map from (a DeepSpeed save of
megatron-core's GPTModel, under the module's names, written as a Megatron torch_dist save: megatron-core-modules):
each rule's match must be literal text around capturing groups, every group used by its template, so the template
read as a pattern and the match read as a template undo it; every name undone is renamed forward again and must
come back, or the rule file is refused. A rule read backwards from an export-names file (reshard.rules.import_names)
may also reorder a param's dim 0 within blocks (`strided`: torchtitan's interleaved rotary rows), each row of each
fragment then a box of its own. The names only say which param goes where: where each part's elements lie in the
joined param (its box: an offset along `dim` of the sizes of the parts before it) is computed from the shapes, and
every fragment of a part becomes a fragment of the joined param shifted by that box, so reading and writing stay byte
copies. The result is a dense model's catalog:
every expert is already in its global place in the source's logical tensors, and no expert parallelism is left.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from types import MappingProxyType

from reshard.core.catalog import Catalog, Fragment, LogicalTensor, ParamInfo, PerParamScalar, TensorKey
from reshard.core.placement import Block, Shard
from reshard.errors import ReshardError
from reshard.rules import files as rule_files, name_rules

KIND = rule_files.MODULE_NAMES


@dataclass(frozen=True)
class ModuleRule:
    pattern: re.Pattern
    name: str | None                # the template; None: drop
    join: tuple[str, ...] = ()      # templates of the params joined, in order
    dim: int = 0
    # the joined param's `dim` is this many equal blocks, each holding every part's share of it in order (a fused
    # QKV laid out per query group [q; k; v]); 1: the parts end to end
    groups: int = 1
    # (block, stride): dim 0 viewed as blocks of `block` rows, each block's rows taken every `stride` from each
    # offset in turn (export_names' "strided" rule; its inverse is the same reordering with block / stride)
    strided: tuple[int, int] | None = None


@dataclass(frozen=True)
class Target:
    """One param of the model: its name and the source params making it, each at `offset` along `dim`."""
    name: str
    parts: tuple[str, ...]
    offsets: tuple[int, ...]
    dim: int
    shape: tuple[int, ...]
    groups: int = 1         # blocks along `dim`, each part's share in each (offsets: within a block)
    strided: tuple[int, int] | None = None     # a lone part's dim 0 reordered (ModuleRule.strided)


@dataclass(frozen=True)
class ModuleNames:
    path: str
    rules: tuple[ModuleRule, ...]

    def rename(self, name: str) -> str:
        """The name a rename rule gives `name` (itself where none matches)."""
        rule = next((r for r in self.rules if r.pattern.fullmatch(name)), None)
        match = rule.pattern.fullmatch(name) if rule is not None else None
        return match.expand(rule.name) if rule is not None and match is not None and rule.name else name

    def apply(self, catalog: Catalog) -> Catalog:
        """`catalog` under the model's names and shapes (see the module's doc); a name the rules cannot place is a
        one-line error naming the rule file."""
        targets, renamed, dropped = self._targets(catalog)
        tensors: dict[TensorKey, LogicalTensor] = {}
        for target in targets:
            states = [{key.state for key in catalog.tensors if key.name == part} for part in target.parts]
            if any(s != states[0] for s in states):
                raise ReshardError.at(self.path, f"{target.name}: its parts {', '.join(target.parts)} hold different "
                                                 "states")
            for state in sorted(states[0]):
                tensors[TensorKey(target.name, state)] = _joined(catalog, target, state, self.path)
        params = {}
        for target in targets:
            info = catalog.params[target.parts[0]]
            kinds = {(catalog.params[p].kind, catalog.params[p].group) for p in target.parts}
            if len(kinds) > 1:
                raise ReshardError.at(self.path, f"{target.name}: its parts {', '.join(target.parts)} are of "
                                                 "different kinds or param groups")
            params[target.name] = ParamInfo(target.name, target.shape, info.kind, info.group)
        aliases = {renamed[a]: renamed[h] for a, h in catalog.aliases.items() if a not in dropped}
        # (an order may name entries that are neither params nor aliases: a module state dict's extra states)
        order = [renamed.get(n) or self.rename(n) for n in catalog.order if n not in dropped]
        groups = tuple({**group, "params": list(dict.fromkeys(renamed[n] for n in group["params"]))}
                       for group in catalog.param_groups)
        scalars = tuple(MappingProxyType({key: _renamed_scalar(value, targets, self.path)
                                          for key, value in group.items()}) for group in catalog.group_scalars)
        if catalog.replicas and any(r.copy.name in renamed and renamed[r.copy.name] != r.copy.name
                                    for r in catalog.replicas):
            raise ReshardError.at(self.path, "renaming params with replicated copies is not supported")
        return replace(catalog, tensors=MappingProxyType(tensors), params=MappingProxyType(params),
                       aliases=MappingProxyType(aliases), order=tuple(dict.fromkeys(order)), param_groups=groups,
                       group_scalars=scalars, experts=None)

    def _targets(self, catalog: Catalog) -> tuple[list[Target], dict[str, str], set[str]]:
        """(the model's params in the source's order, source name -> model name, names left out)."""
        targets: list[Target] = []
        renamed: dict[str, str] = {}
        dropped: set[str] = set()
        joined: set[str] = set()
        names = list(catalog.params) + [a for a in catalog.aliases if a not in catalog.params]
        for name in names:
            if name in joined:
                continue
            rule = next((r for r in self.rules if r.pattern.fullmatch(name)), None)
            match = rule.pattern.fullmatch(name) if rule is not None else None
            if rule is None or match is None:
                renamed[name] = name
            elif rule.name is None:
                dropped.add(name)
                continue
            else:
                renamed[name] = match.expand(rule.name)
            if name not in catalog.params:
                continue            # an alias: its holder's data
            if rule is None or not rule.join:
                shape = tuple(catalog.params[name].shape)
                strided = rule.strided if rule is not None else None
                if strided is not None and (not shape or shape[0] % strided[0] or strided[0] % strided[1]):
                    raise ReshardError.at(self.path, f"{name}: its {list(shape)} rows are not blocks of "
                                                     f"{strided[0]} rows whose rows go by {strided[1]}")
                targets.append(Target(renamed[name], (name,), (0,), 0, shape, strided=strided))
                continue
            parts = tuple(match.expand(t) for t in rule.join) if match is not None else ()
            missing = [p for p in parts if p not in catalog.params]
            if missing or name not in parts:
                raise ReshardError.at(self.path, f"{name}: joins {', '.join(parts)}, but "
                                                 f"{', '.join(missing) or name + ' is not one of them'}")
            targets.append(_join(renamed[name], parts, [tuple(catalog.params[p].shape) for p in parts], rule.dim,
                                 self.path, rule.groups))
            for part in parts:
                renamed[part] = renamed[name]
                joined.add(part)
        seen: dict[str, str] = {}
        for target in targets:
            if target.name in seen:
                raise ReshardError.at(self.path, f"two params would be named {target.name} "
                                                 f"({seen[target.name]} and {target.parts[0]})")
            seen[target.name] = target.parts[0]
        experts = catalog.experts.layers if catalog.experts is not None else ()
        unnamed = [p for layer in experts for p in layer.params if not any(r.pattern.fullmatch(p) for r in self.rules)]
        if unnamed:     # (a model of its own names would hold one expert-parallel rank's experts, not all)
            raise ReshardError.at(self.path, f"{unnamed[0]}: an expert param no rule names")
        for alias, holder in catalog.aliases.items():
            if alias not in dropped and holder not in renamed:
                raise ReshardError.at(self.path, f"{alias} is tied to {holder}, which a rule drops")
        return targets, renamed, dropped


def inverted(rules: ModuleNames) -> ModuleNames:
    """The rules undone (see the module's doc): a one-line error naming the file for a rule that cannot be."""
    out = []
    for i, rule in enumerate(rules.rules):
        if rule.name is None or rule.join:
            raise ReshardError.at(rules.path, f"rule {i}: only renames can be undone, not a join or a drop")
        out.append(inverse(rules.path, i, rule))
    return InvertedNames(rules.path, tuple(out), rules)


@dataclass(frozen=True)
class InvertedNames(ModuleNames):
    """Rules undone, each name they rename checked by renaming it forward again (`forward`)."""
    forward: ModuleNames | None = None

    def apply(self, catalog: Catalog) -> Catalog:
        assert self.forward is not None
        out = super().apply(catalog)
        for name in catalog.params:
            back = self.rename(name)
            if self.forward.rename(back) != name:
                raise ReshardError.at(self.path, f"{name}: undone as {back}, which these rules name "
                                                 f"{self.forward.rename(back)}: they cannot be undone for it")
        return out


def inverse(path: str, i: int, rule: ModuleRule) -> ModuleRule:
    """The rename undone (name_rules.undone): the template as a pattern, the match as a template."""
    assert rule.name is not None
    return ModuleRule(*name_rules.undone(path, i, rule.pattern, rule.name))


def _join(name: str, parts: tuple[str, ...], shapes: list[tuple[int, ...]], dim: int, path: str,
          groups: int = 1) -> Target:
    """The target of `parts` of `shapes` end to end along `dim` (the same size on every other dim), or, in `groups`
    blocks, each part's share of each block after the shares of the parts before it (every part's size along `dim`
    a multiple of `groups`)."""
    first = shapes[0]
    joined = ", ".join(f"{p}{list(s)}" for p, s in zip(parts, shapes, strict=True))
    if not 0 <= dim < len(first) or any(len(s) != len(first) or s[:dim] + s[dim + 1:] != first[:dim] + first[dim + 1:]
                                        for s in shapes):
        raise ReshardError.at(path, f"{name}: cannot join {joined} along dim {dim}")
    if groups < 1 or any(s[dim] % groups for s in shapes):
        raise ReshardError.at(path, f"{name}: cannot join {joined} in {groups} equal groups along dim {dim}")
    offsets, at = [], 0
    for shape in shapes:
        offsets.append(at)
        at += shape[dim] // groups
    return Target(name, parts, tuple(offsets), dim, first[:dim] + (at * groups,) + first[dim + 1:], groups)


def _joined(catalog: Catalog, target: Target, state: str, path: str) -> LogicalTensor:
    """The (target, state) tensor: each part's fragments, their boxes shifted to the part's place."""
    tensors = [catalog.tensors[TensorKey(part, state)] for part in target.parts]
    if len({t.dtype for t in tensors}) > 1 or len({t.cast_from for t in tensors}) > 1:
        raise ReshardError.at(path, f"{target.name} ({state}): its parts are of different dtypes")
    if len(tensors) == 1 and target.strided is not None:
        reordered = tuple(_restrided(f, target.shape, *target.strided) for f in tensors[0].fragments)
        return replace(tensors[0], name=target.name, fragments=reordered)
    if len(tensors) == 1:
        return replace(tensors[0], name=target.name)
    block = target.shape[target.dim] // target.groups
    fragments = [_shifted(fragment, tensor.shape, target.dim, offset, target.groups, block)
                 for tensor, offset in zip(tensors, target.offsets, strict=True) for fragment in tensor.fragments]
    return LogicalTensor(target.name, state, target.shape, tensors[0].dtype, tuple(fragments), tensors[0].cast_from)


def _shifted(fragment: Fragment, shape: tuple[int, ...], dim: int, offset: int, groups: int = 1,
             block: int = 0) -> Fragment:
    """`fragment` of a part of `shape`, as a fragment of the joined tensor where the part starts at `offset`
    along `dim`; in `groups` blocks of `block` along `dim`: its g-th share (shape[dim] / groups) at `offset` in the
    g-th block. Each of the fragment's boxes is cut where it crosses a share: still boxes, still byte copies."""
    shard = fragment.shard or Shard.whole(shape)
    share = shape[dim] // groups
    blocks = []
    for b in shard.blocks:
        first, stop = b.at[dim], b.at[dim] + b.shape[dim]
        while first < stop:
            group = first // share
            end = min(stop, (group + 1) * share)
            at = tuple(group * block + offset + first - group * share if d == dim else a for d, a in enumerate(b.at))
            local = tuple(x + first - b.at[dim] if d == dim else x for d, x in enumerate(b.local))
            size = tuple(end - first if d == dim else n for d, n in enumerate(b.shape))
            blocks.append(Block(at, local, size))
            first = end
    return replace(fragment, shard=Shard(shard.shape, tuple(blocks)))


def _restrided(fragment: Fragment, shape: tuple[int, ...], block: int, stride: int) -> Fragment:
    """`fragment` of a tensor of `shape` whose dim 0 is reordered within blocks of `block` rows: row i·stride + j of
    a block goes to row j·(block / stride) + i of it. Each of the fragment's boxes is cut into its rows, each row a
    box of its own: still byte copies."""
    shard = fragment.shard or Shard.whole(shape)
    per = block // stride
    rows = []
    for b in shard.blocks:
        for r in range(b.shape[0]):
            first, q = divmod(b.at[0] + r, block)
            moved = first * block + (q % stride) * per + q // stride
            rows.append(Block((moved, *b.at[1:]), (b.local[0] + r, *b.local[1:]), (1, *b.shape[1:])))
    return replace(fragment, shard=Shard(shard.shape, tuple(rows)))


def _renamed_scalar(value, targets: list[Target], path: str):
    """A group's optimizer scalar under the new names: a param's own value (a step) is its parts', which must
    agree."""
    if not isinstance(value, PerParamScalar):
        return value
    values, files = {}, {}
    for target in targets:
        found = [(value.values[p], value.files.get(p)) for p in target.parts if p in value.values]
        if not found:
            continue
        if any(v != found[0][0] for v, _ in found):
            raise ReshardError.at(path, f"{target.name}: its parts {', '.join(target.parts)} have different optimizer "
                                        f"scalars ({', '.join(str(v) for v, _ in found)})")
        values[target.name] = found[0][0]
        if found[0][1] is not None:
            files[target.name] = found[0][1]
    return PerParamScalar(MappingProxyType(values), MappingProxyType(files))


def load(path: str) -> ModuleNames:
    """The rules of the file at `path` (or shipped with reshard under that name); a file that is not one is a
    one-line error naming it."""
    path, _, rules = name_rules.rules_of(path, KIND)
    return ModuleNames(path, tuple(_rule(path, i, r) for i, r in enumerate(rules)))


def _rule(path: str, i: int, rule) -> ModuleRule:
    where = f"rule {i}"
    pattern = name_rules.pattern(path, i, rule, {"match", "name", "join", "dim", "drop", "note"})
    if rule.get("drop") is True:
        if set(rule) - {"match", "drop", "note"}:
            raise ReshardError.at(path, f'{where}: "drop" goes alone')
        return ModuleRule(pattern, None)
    if not isinstance(rule.get("name"), str):
        raise ReshardError.at(path, f'{where}: needs "name" (a template) or "drop": true')
    join = rule.get("join", [])
    if not isinstance(join, list) or not all(isinstance(t, str) for t in join) or len(join) == 1:
        raise ReshardError.at(path, f'{where}: "join" is a list of two or more templates')
    dim = rule.get("dim", 0)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0 or ("dim" in rule and not join):
        raise ReshardError.at(path, f'{where}: "dim" is a dimension (0, 1, ...) of a "join"')
    return ModuleRule(pattern, rule["name"], tuple(join), dim)
