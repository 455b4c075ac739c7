"""Layout: the topology and precision a checkpoint was saved for (or should be written for).

A Layout is detected from a checkpoint, read from a descriptor file (JSON, the format of
reshard/layouts/topologies/), or derived from another Layout and a spec such as `dp=4,zero=3`.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace

from reshard import rule_files
from reshard.errors import ReshardError, UsageError

DESCRIPTOR_KIND = rule_files.LAYOUT
DESCRIPTOR_VERSION = 1
PARTITION_METHODS = ("uniform", "parameters", "type:REGEX")
# Facts of a checkpoint's contents that descriptors saved by earlier versions carry: not a topology, ignored
# (Catalog.contents computes them)
CONTENT_KEYS = ("optimizer", "states", "params", "elements", "step")


@dataclass(frozen=True)
class SpecKey:
    """One key of a target spec ("dp=4,zero=3"), with the values it takes: the parser accepts these keys and
    values and no other, and the CLI's help lists them, so the two cannot drift apart. Which output formats take
    a key is the writers' to say (reshard.formats.WRITER_SPEC_KEYS)."""
    name: str
    value: str          # what its value looks like
    meaning: str
    minimum: int | None = None      # a whole number, at least this
    choices: tuple = ()             # a whole number, one of these
    attr: str = ""                  # the Layout attribute it sets, or
    option: str = ""                # the key of Layout.options it sets

    def accepted(self) -> str:
        """The values it takes, in words (--help and the parser's messages say the same)."""
        if self.choices:
            *most, last = map(str, self.choices)
            return f"{', '.join(most)} or {last}" if most else last
        if self.minimum is not None:
            return f"{self.minimum} or more"
        return self.value

    def parse(self, text: str):
        """The value `text` stands for, or a UsageError saying what the key takes."""
        text = text.strip()
        if self.minimum is not None or self.choices:
            number = int(text) if re.fullmatch(r"[0-9]+", text) else None
            if number is None or (self.choices and number not in self.choices) or \
                    (self.minimum is not None and number < self.minimum):
                raise UsageError(f"{self.name} is {self.accepted()}, not {text!r}" if self.choices else
                                 f"{self.name} is a whole number, {self.accepted()}, not {text!r}")
            return number
        if self.name == "partition":
            if partition_method_problem(text):
                raise UsageError(partition_method_problem(text))
            return text
        types = [t.strip() for t in text.split("/")]
        if not all(types):
            raise UsageError("layer_types is the layers' class names separated by '/'")
        return types


SPEC_KEYS = (
    SpecKey("dp", "M", "data-parallel degree", minimum=1, attr="dp"),
    SpecKey("tp", "T", "tensor-parallel degree", minimum=1, attr="tp"),
    SpecKey("pp", "P", "pipeline-parallel degree: stages", minimum=1, attr="pp"),
    SpecKey("zero", "S", "ZeRO stage", choices=(1, 2, 3), attr="zero"),
    SpecKey("partition", "|".join(PARTITION_METHODS),
            "how the pipeline layers are cut into stages (PipelineModule's partition_method; type:REGEX balances "
            "the layers whose class name matches REGEX)", option="partition_method"),
    SpecKey("layer_types", "A/B/...", "the pipeline layers' class names in order, for partition=type:REGEX "
            "(a checkpoint does not hold them)", option="layer_types"),
    SpecKey("kv_heads", "K", "the model's key-value heads, how AutoTP cuts attention at a new tp: each tensor cut "
            "by heads holds whole ones", minimum=1, option="kv_heads"),
    SpecKey("ep", "E", "expert-parallel degree of a mixture-of-experts checkpoint, dividing dp and the expert "
            "count", minimum=1, option="ep"),
)
SPEC_KEY_NAMES = tuple(k.name for k in SPEC_KEYS)
_SPEC_KEY = {k.name: k for k in SPEC_KEYS}


def spec_keys(spec: str) -> set:
    """The keys a layout spec ("dp=4,zero=3") names."""
    return {item.partition("=")[0].strip() for item in spec.split(",") if item.strip()}


def partition_method_problem(method) -> str | None:
    """Why `method` is not a PipelineModule partition method we can cut by (None when it is one).
    'type:REGEX' is DeepSpeed's: balance the layers whose class name the regex matches."""
    if method in ("uniform", "parameters"):
        return None
    if isinstance(method, str) and method.startswith("type:"):
        try:
            re.compile(method.split(":")[1], re.IGNORECASE)     # DeepSpeed takes the text up to a 2nd ':'
        except re.error as e:
            return f"partition {method!r}: bad regular expression ({e})"
        return None
    return f"partition must be one of {', '.join(PARTITION_METHODS)}"


@dataclass
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    dtype: str = "float32"           # the model's (16-bit or fp32) parameter dtype
    master_dtype: str = "float32"    # dtype of the optimizer's master copy
    # How the optimizer partitions were cut, where the format has variants (DeepSpeed: elastic,
    # round_robin, bf16_optimizer, parameter_alignment, sub_group_size).
    options: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def topology(self) -> str:
        """e.g. "dp=4,tp=1,pp=1,zero=2"; a mixture of experts adds its expert-parallel degree (",ep=2")."""
        ep = f",ep={self.options['ep']}" if "ep" in self.options else ""
        return f"dp={self.dp},tp={self.tp},pp={self.pp},zero={self.zero}{ep}"

    def to_dict(self) -> dict:
        return {"kind": DESCRIPTOR_KIND, "version": DESCRIPTOR_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict, source: str = "layout") -> "Layout":
        if data.get("kind") != DESCRIPTOR_KIND:
            raise UsageError(f"{source}: not a reshard layout descriptor (kind is {data.get('kind')!r})")
        if data.get("version") != DESCRIPTOR_VERSION:
            raise UsageError(f"{source}: layout descriptor version {data.get('version')!r} is not supported")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"kind", "version", *CONTENT_KEYS})
        if unknown:
            raise UsageError(f"{source}: unknown layout keys {', '.join(unknown)}")
        layout = cls(**{k: v for k, v in data.items() if k in known})
        layout.check(source)
        return layout

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path) -> "Layout":
        return cls._from_file(read_descriptor(path), path)

    @classmethod
    def _from_file(cls, data: dict, path) -> "Layout":
        try:
            return cls.from_dict(data, str(path))
        except ReshardError as e:   # its line starts with the path: say which file it is about, typed
            raise type(e)(str(e), file=path) from None

    def with_descriptor(self, path) -> "Layout":
        """This layout with the degrees (dp, tp, pp, zero) and pipeline partition method a descriptor
        file names; keys it leaves out keep this layout's values. Its dtypes, when given, must match:
        a conversion keeps the training precision."""
        given = read_descriptor(path)
        unknown = sorted(set(given) - {f.name for f in fields(Layout)} - {"kind", "version", *CONTENT_KEYS})
        if unknown:     # (a key this merge would not take is a mistake, not a no-op)
            raise UsageError.at(path, f"unknown layout keys {', '.join(unknown)}")
        for key in ("dtype", "master_dtype"):
            if key in given and given[key] != getattr(self, key):
                raise UsageError.at(path, f"{key} {given[key]} differs from the source's {getattr(self, key)}; "
                                            "convert keeps the training precision")
        merged = {**self.to_dict(), **{k: given[k] for k in ("dp", "tp", "pp", "zero") if k in given}}
        given_options = given.get("options") or {}
        for key in ("partition_method", "layer_types"):
            if given_options.get(key) is not None:
                merged["options"] = {**merged.get("options", self.options), key: given_options[key]}
        return Layout._from_file(merged, path)

    def check(self, source: str = "layout") -> None:
        method = self.options.get("partition_method")
        if method is not None and partition_method_problem(method):
            raise UsageError(f"{source}: {partition_method_problem(method)}")
        types = self.options.get("layer_types")
        if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) and t for t in types)):
            raise UsageError(f"{source}: layer_types must be a list of the pipeline layers' class names")
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise UsageError(f"{source}: zero must be 0, 1, 2 or 3, got {self.zero!r}")

    def with_spec(self, spec: str) -> "Layout":
        """This layout with the degrees named in `spec` ("dp=4,zero=3") changed; `partition=uniform|parameters|type:REGEX`
        names the pipeline partition method of the target (type:REGEX with `layer_types=A/B/...`, the class
        names of its layers, which a checkpoint does not hold), `kv_heads=K` the model's key-value heads (AutoTP's cut
        at a new tensor-parallel degree), `ep=E` the expert-parallel degree of a mixture-of-experts target (the source's
        when not named)."""
        changes, options, seen = {}, dict(self.options), set()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in _SPEC_KEY:
                raise UsageError(f"bad layout spec {spec!r}: {key!r} is not a key; expected keys "
                                 f"{', '.join(SPEC_KEY_NAMES)} as key=value")
            if key in seen:     # not the last one silently
                raise UsageError(f"bad layout spec {spec!r}: {key} is given twice")
            seen.add(key)
            try:
                parsed = _SPEC_KEY[key].parse(value)
            except UsageError as e:
                raise UsageError(f"bad layout spec {spec!r}: {e}") from None
            if _SPEC_KEY[key].attr:
                changes[key] = parsed
            else:
                options[_SPEC_KEY[key].option] = parsed
        changes["options"] = options
        target = replace(self, **changes)
        target.check(f"layout spec {spec!r}")
        return target


def _once(pairs) -> dict:
    """A JSON object whose keys each appear once (json takes the last of a repeated key silently)."""
    twice = sorted({k for i, (k, _) in enumerate(pairs) if k in (k2 for k2, _ in pairs[:i])})
    if twice:
        raise UsageError(f"{', '.join(twice)} given twice")
    return dict(pairs)


def read_descriptor(path) -> dict:
    """A layout descriptor file's JSON, its kind and version checked."""
    try:
        with open(path) as f:
            data = json.load(f, object_pairs_hook=_once)
    except OSError as e:
        raise UsageError.at(path, f"cannot read layout descriptor: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError.at(path, f"layout descriptor is not valid JSON ({e})") from None
    except UsageError as e:
        raise UsageError.at(path, f"layout descriptor: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != DESCRIPTOR_KIND:
        kind = data.get("kind") if isinstance(data, dict) else None
        raise UsageError.at(path, f"not a reshard layout descriptor (kind is {kind!r})")
    return data
