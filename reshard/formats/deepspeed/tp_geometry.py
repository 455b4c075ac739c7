"""How tensor parallelism cut each parameter: boxes of the full tensor held by each TP rank.

The checkpoint itself says nothing about it unless the model published `universal_checkpoint_info`.
The geometry comes, in this order, from
1. its `affine_map` (DeepSpeed's affine IR: per rank, blocks given as `as_strided` arguments in the
   full tensor ("source") and in the shard ("dest"), with the ranks holding each block);
2. its pattern lists (replicated, row parallel, vocabulary, fused sub-params; anything else is cut
   along dim 0, which is what those lists mean to DeepSpeed's own converter);
3. a rule file (`--layout-rules`: a path, or one shipped with reshard, reshard/layouts/tp-rules/*.json, by name), whose
   format is documented in reshard/layouts/README.md.
Name patterns live only in those inputs; they are turned into `Split`s (geometry) here and nothing
else looks at a name. A parameter no source describes is refused, never guessed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from reshard.core.geometry import strides
from reshard.core.placement import Block, Shard
from reshard.errors import ReshardError, UsageError
from reshard.rules import files as rule_files
from reshard.storage import files as fs

RULES_KIND = rule_files.TP_RULES
RULES_VERSION = 1


@dataclass(frozen=True)
class Piece:
    """A box of the full tensor held by one rank: where it starts in the full tensor and in the shard."""
    full_start: tuple
    shard_start: tuple
    shape: tuple
    holders: tuple        # the ranks holding this very block (replicas); the first one is read


@dataclass
class Split:
    full_shape: tuple
    pieces: dict          # tp rank -> [Piece]
    source: str           # where the geometry came from (for messages)

    def shard(self, rank: int, shard_shape: tuple, held: str = "primary") -> Shard | None:
        """Rank's shard of the full tensor (None: the full tensor itself) with the blocks it is read for:
        `held` "primary" (blocks it is the first holder of), "copies" (blocks another rank holds first)
        or "all"."""
        blocks = tuple(Block(p.full_start, p.shard_start, p.shape) for p in self.pieces.get(rank, [])
                       if held == "all" or (p.holders[0] == rank) == (held == "primary"))
        shard = Shard(tuple(shard_shape), blocks)
        return None if shard == Shard.whole(self.full_shape) else shard

    def describe(self) -> str:
        """How tensor parallelism cut the tensor, in words: replicated, split along dim d, or n boxes."""
        pieces = [p for ps in self.pieces.values() for p in ps]
        if pieces and all(len(p.holders) == len(self.pieces) for p in pieces):
            return "replicated"
        dims = {d for p in pieces
                for d, (n, full) in enumerate(zip(p.shape, self.full_shape, strict=True)) if n != full}
        if all(len(ps) == 1 for ps in self.pieces.values()) and len(dims) == 1:
            return f"split dim {dims.pop()}"
        return f"{len(pieces)} boxes"


@dataclass(frozen=True)
class Rule:
    """One way of cutting: replicated, along `dim`, or fused sub-params; `vocab`: padding rows get dropped."""
    pattern: str
    kind: str                     # "replicated", "split", "sub_params", "refuse"
    dim: int = 0
    vocab: bool = False           # rows past the original vocabulary size are padding, dropped
    sub_params: tuple = ()        # full sizes of the fused sub-params along dim, or (count,) with count_only
    count_only: bool = False
    shard_widths: tuple = ()      # per sub-param, per rank widths (uneven AutoTP splits)
    reason: str = ""
    recut: str = ""               # how AutoTP sizes the blocks at any degree: "heads" or "even" (tp_recut)
    fallback: bool = False        # the pattern lists' catch-all for params no list names (not for buffers)


class Geometry:
    """Turns a parameter name and its shard shapes into a Split, from one of the three sources."""

    def __init__(self, affine: dict, rules: list, source: str, prefix_match: bool = False,
                 vocab_patterns=(), vocab_size: int | None = None, counts_error=ReshardError):
        self.affine = [(re.compile(p), entry) for p, entry in affine.items()]
        self.rules = [(re.compile(r.pattern), r) for r in rules]
        self.source = source
        # DeepSpeed's converter matches its pattern lists with re.match (a prefix); rule files match whole names
        self.prefix_match = prefix_match
        # ...and strips vocabulary padding after any cut: rows past original_vocab_size are dropped
        self.vocab = [re.compile(p) for p in vocab_patterns]
        self.vocab_size = vocab_size
        # a count that cannot describe the tensors (sub-params, vocabulary rows): the checkpoint's fault when it
        # states it, a usage error when the user's rule file does (exit 2)
        self.counts_error = counts_error

    @classmethod
    def from_checkpoint(cls, info: dict, where: str) -> Geometry:
        affine = ((info.get("affine_map") or {}).get("params")) or {}
        vocab = info.get("original_vocab_size")
        return cls(affine, _rules_from_uc_info(info), f"universal_checkpoint_info of {where}", prefix_match=True,
                   vocab_patterns=info.get("vocabulary_parameter_patterns") or [],
                   vocab_size=int(vocab) if vocab else None)

    @classmethod
    def from_rule_file(cls, path: str) -> Geometry:
        try:
            with fs.open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ReshardError.at(path, f"cannot read layout rules: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ReshardError.at(path, f"layout rules are not valid JSON ({e})") from None
        vocab = data.get("original_vocab_size") if isinstance(data, dict) else None
        if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
            raise ReshardError.at(path, "original_vocab_size must be a positive integer or null")
        return cls({}, _rules_from_file(data, path), path, vocab_size=vocab, counts_error=UsageError)

    def _matches(self, pattern, name) -> bool:
        return bool(pattern.match(name) if self.prefix_match else pattern.fullmatch(name))

    def rule_for(self, name: str):
        """The first rule matching `name` (None when none does); the affine map is not consulted."""
        return next((rule for pattern, rule in self.rules if self._matches(pattern, name)), None)

    def split(self, name: str, shard_shapes: dict, tp: int, fallback: bool = True) -> Split:
        """`fallback`: may the pattern lists' catch-all (every other param cut along dim 0) decide?"""
        for pattern, entry in self.affine:       # a map states the geometry itself: no trimming on top
            if self._matches(pattern, name):
                return from_affine(name, entry, shard_shapes, self.source)
        for pattern, rule in self.rules:
            if self._matches(pattern, name) and (fallback or not rule.fallback):
                split = from_rule(name, rule, shard_shapes, tp, self.source, self.counts_error)
                if self.vocab_size and (rule.vocab or any(self._matches(p, name) for p in self.vocab)):
                    if split.full_shape and self.vocab_size > split.full_shape[0]:
                        raise self.counts_error(f"{self.source}: original_vocab_size {self.vocab_size} cannot describe "
                                                f"{name}: it has {split.full_shape[0]} rows")
                    split = trim_rows(split, self.vocab_size)
                return split
        raise ReshardError(f"{self.source}: no rule says how tensor parallelism cut {name}; "
                           "give one in a --layout-rules file (its format: reshard/layouts/README.md)")


def trim_rows(split: Split, rows: int) -> Split:
    """The split of the tensor's first `rows` rows (vocabulary padding dropped): boxes clipped along dim 0."""
    if not split.full_shape or rows >= split.full_shape[0]:
        return split
    pieces: dict[int, list[Piece]] = {}
    for rank, ps in split.pieces.items():
        pieces[rank] = []
        for p in ps:
            keep = min(p.shape[0], rows - p.full_start[0])
            if keep > 0:
                pieces[rank].append(Piece(p.full_start, p.shard_start, (keep,) + p.shape[1:], p.holders))
    return Split((rows,) + split.full_shape[1:], pieces, split.source)


def replicated(name: str, shard_shapes: dict, tp: int, source: str) -> Split:
    """Every rank holds the whole tensor."""
    return from_rule(name, Rule(name, "replicated"), shard_shapes, tp, source)


def _unravel(offset: int, shape) -> tuple:
    coords = []
    for n, stride in zip(shape, strides(shape), strict=True):
        coords.append(offset // stride if n else 0)
        offset -= coords[-1] * stride
    return tuple(coords)


def _row_major(box_strides, box, shape) -> bool:
    """Do `box_strides` walk a box of `shape`'s row-major layout (dims of the box of size 1 do not matter)?"""
    return all(n == 1 or s == e for n, s, e in zip(box, box_strides, strides(shape), strict=True))


def from_affine(name, entry, shard_shapes, source) -> Split:
    full = tuple(int(n) for n in entry["logical_shape"])
    pieces: dict[int, list[Piece]] = {}
    for rank_key, value in entry["ranks"].items():
        rank = int(rank_key)
        shard = tuple(int(n) for n in value["shard_shape"])
        if rank in shard_shapes and tuple(shard_shapes[rank]) != shard:
            raise ReshardError(f"{source}: {name}: the affine map gives tensor-parallel rank {rank} a shard of "
                               f"shape {list(shard)}, the checkpoint holds {list(shard_shapes[rank])}")
        pieces[rank] = []
        for p in value["pieces"]:
            shape = tuple(int(n) for n in p["shape"])
            (f_off, f_strides), (s_off, s_strides) = p["source"], p["dest"]
            if float(p.get("scale", 1.0)) != 1.0:
                raise ReshardError(f"{source}: {name}: a scaled block (scale {p['scale']}) is not a byte copy; "
                                   "not supported")
            if len(shape) != len(full) or len(shard) != len(full) or \
                    not (_row_major(f_strides, shape, full) and _row_major(s_strides, shape, shard)):
                raise ReshardError(f"{source}: {name}: an affine block that is not an axis-aligned box of "
                                   "row-major tensors; not supported")
            holders = tuple(sorted(int(r) for r in p.get("locations", [rank])))
            pieces[rank].append(Piece(_unravel(f_off, full), _unravel(s_off, shard), shape, holders))
    return Split(full, pieces, source)


def from_rule(name, rule, shard_shapes, tp, source, counts_error=ReshardError) -> Split:
    if rule.kind == "refuse":
        raise ReshardError(f"{source}: {name}: {rule.reason}")
    shapes = {r: tuple(s) for r, s in shard_shapes.items()}
    if not shapes:
        raise ReshardError(f"{source}: {name}: no tensor-parallel rank holds it")
    any_shape = next(iter(shapes.values()))
    if rule.kind == "replicated":
        if len(set(shapes.values())) > 1:
            raise ReshardError(f"{source}: {name} is replicated but its shapes differ across tensor-parallel ranks "
                               f"({sorted(set(shapes.values()))})")
        zeros = (0,) * len(any_shape)
        holders = tuple(range(tp))
        return Split(any_shape, {r: [Piece(zeros, zeros, any_shape, holders)] for r in range(tp)}, source)
    dim = rule.dim if rule.dim >= 0 else len(any_shape) + rule.dim
    if not 0 <= dim < len(any_shape):
        raise ReshardError(f"{source}: {name} has {len(any_shape)} dims, the rule cuts dim {rule.dim}")
    for s in shapes.values():
        if s[:dim] + s[dim + 1:] != any_shape[:dim] + any_shape[dim + 1:]:
            raise ReshardError(f"{source}: {name}: shard shapes {sorted(set(shapes.values()))} differ outside the "
                               f"split dim {dim}")
    missing = [r for r in range(tp) if r not in shapes]
    if missing:   # a rank's files are missing (reported elsewhere): assume its shard is like rank 0's
        shapes.update({r: any_shape for r in missing})
    if rule.kind == "split":
        return contiguous(shapes, dim, tp, source)
    return _sub_params(name, rule, shapes, dim, tp, source, counts_error)


Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]     # (full start, shard start, shape)


def _box(start_in_dim, shard_start_in_dim, size, dim, shape) -> Box:
    full_start = tuple(start_in_dim if d == dim else 0 for d in range(len(shape)))
    shard_start = tuple(shard_start_in_dim if d == dim else 0 for d in range(len(shape)))
    box = tuple(size if d == dim else n for d, n in enumerate(shape))
    return full_start, shard_start, box


def contiguous(shapes, dim, tp, source) -> Split:
    pieces, offset = {}, 0
    for r in range(tp):
        size = shapes[r][dim]
        pieces[r] = [Piece(*_box(offset, 0, size, dim, shapes[r]), (r,))] if size else []
        offset += size
    full = list(shapes[0])
    full[dim] = offset
    return Split(tuple(full), pieces, source)


def _sub_params(name, rule, shapes, dim, tp, source, counts_error) -> Split:
    local = shapes[0][dim]
    if rule.shard_widths:
        widths = [list(w) for w in rule.shard_widths]
        sizes = [sum(w) for w in widths]
    else:
        if rule.count_only:
            count = rule.sub_params[0]
            if (local * tp) % count:
                raise counts_error(f"{source}: {name}: {local * tp} rows along dim {dim} do not split into "
                                   f"{count} sub-params")
            sizes = [local * tp // count] * count
        else:
            sizes = list(rule.sub_params)
        if any(n % tp for n in sizes):
            raise counts_error(f"{source}: {name}: sub-param sizes {sizes} do not divide by tp={tp}; give "
                               "shard widths")
        widths = [[n // tp] * tp for n in sizes]
    pieces: dict[int, list[Piece]] = {r: [] for r in range(tp)}
    for r in range(tp):
        have = sum(w[r] for w in widths)
        if shapes[r][dim] != have:
            raise counts_error(f"{source}: {name}: tensor-parallel rank {r} holds {shapes[r][dim]} rows along dim "
                               f"{dim}, the sub-param rule gives it {have}")
        full_at, shard_at = 0, 0
        for size, w in zip(sizes, widths, strict=True):
            start = full_at + sum(w[:r])
            if w[r]:
                pieces[r].append(Piece(*_box(start, shard_at, w[r], dim, shapes[r]), (r,)))
            full_at += size
            shard_at += w[r]
    full = list(shapes[0])
    full[dim] = sum(sizes)
    return Split(tuple(full), pieces, source)


# ------------------------------------------------------------------------------------------ rule sources

def _rules_from_uc_info(info: dict) -> list:
    """DeepSpeed's pattern lists (deepspeed/checkpoint/constants.py) as rules, in ds_to_universal's order."""
    rules = []
    for pattern, reason in (info.get("autotp_unsupported_parameter_patterns") or {}).items():
        rules.append(Rule(pattern, "refuse", reason=f"AutoTP could not describe it ({reason})"))
    for pattern in info.get("tp_replicated_parameter_patterns") or []:
        rules.append(Rule(pattern, "replicated"))
    for pattern in info.get("parameter_to_average_patterns") or []:
        rules.append(Rule(pattern, "refuse", reason="its tensor-parallel copies are averaged by DeepSpeed's "
                                                    "converter, which is not a byte copy; not supported"))
    widths = info.get("sub_param_shard_widths") or {}
    for pattern in info.get("parameter_with_2_sub_params_cat_dim_0") or []:
        rules.append(Rule(pattern, "sub_params", dim=0, sub_params=(2,), count_only=True))
    for entry in info.get("parameter_with_sub_params") or []:
        dim = int(entry.get("partition_dim", 0))
        shape = entry.get("shape") or []
        sizes = shape[dim] if dim < len(shape) else None
        for pattern in entry.get("patterns") or []:
            w = tuple(tuple(x) for x in widths.get(pattern, ()))
            if w:                                          # UC 0.4: each sub-param's width on each rank
                rules.append(Rule(pattern, "sub_params", dim=dim, shard_widths=w))
            elif isinstance(sizes, (list, tuple)):         # their full sizes, split evenly
                rules.append(Rule(pattern, "sub_params", dim=dim, sub_params=tuple(int(n) for n in sizes)))
            elif isinstance(sizes, int) and sizes > 0:     # before UC 0.4: a count of equal sub-params
                rules.append(Rule(pattern, "sub_params", dim=dim, sub_params=(sizes,), count_only=True))
            else:
                rules.append(Rule(pattern, "refuse", reason="fused sub-params without their sizes; not supported"))
    for pattern in info.get("parameter_with_row_parallelism_patterns") or []:
        rules.append(Rule(pattern, "split", dim=1))
    if rules or info.get("vocabulary_parameter_patterns"):
        # the lists only name the exceptions: DeepSpeed's converter cuts every other param along dim 0
        rules.append(Rule(r".*", "split", dim=0, fallback=True))
    return rules


def _rules_from_file(data: dict, path: str) -> list:
    if not isinstance(data, dict) or data.get("kind") != RULES_KIND:
        raise ReshardError.at(path, f"not a reshard tensor-parallel rule file (kind must be {RULES_KIND!r})")
    if data.get("version") != RULES_VERSION:
        raise ReshardError.at(path, f"rule file version {data.get('version')!r} is not supported")
    rules = []
    for i, item in enumerate(data.get("rules") or []):
        where = f"{path}: rule {i}"
        try:
            pattern = item["match"]
            re.compile(pattern)
        except (KeyError, TypeError, re.error) as e:
            raise ReshardError(f"{where}: needs a valid regular expression under 'match' ({e})") from None
        unknown = set(item) - {"match", "replicated", "dim", "vocab", "sub_params", "refuse", "note", "recut"}
        if unknown:
            raise ReshardError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
        if item.get("refuse"):
            rules.append(Rule(pattern, "refuse", reason=str(item["refuse"])))
        elif item.get("replicated"):
            rules.append(Rule(pattern, "replicated"))
        elif isinstance(item.get("dim"), int):
            dim, sub = item["dim"], item.get("sub_params")
            recut = item.get("recut", "")
            if recut not in ("", "heads", "even"):
                raise ReshardError(f"{where}: recut must be 'heads' or 'even'")
            if sub is None:
                rules.append(Rule(pattern, "split", dim=dim, vocab=bool(item.get("vocab")), recut=recut))
            elif isinstance(sub, int) and sub > 0:
                rules.append(Rule(pattern, "sub_params", dim=dim, sub_params=(sub,), count_only=True))
            elif isinstance(sub, list) and sub and all(isinstance(n, int) and n > 0 for n in sub):
                rules.append(Rule(pattern, "sub_params", dim=dim, sub_params=tuple(sub)))
            else:
                raise ReshardError(f"{where}: sub_params must be a count or a list of sizes")
        else:
            raise ReshardError(f"{where}: say 'replicated': true, 'dim': N or 'refuse': REASON")
    return rules
