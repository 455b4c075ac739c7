"""Layout: the topology and precision a checkpoint was saved for (or should be written for).

A topology is named mesh degrees (dp, tp, pp: every format has them) and what the checkpoint's format adds, a
frozen object of that format's own (FormatTopology); the core reads none of the latter. A Layout is detected from a
checkpoint, read from a descriptor file (JSON, the format of reshard/layouts/topologies/), or derived from another
Layout and a spec such as `dp=4,tp=2` (reshard.formats.target_layout: each writer parses the keys it takes).
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from reshard.errors import ReshardError, UsageError
from reshard.rules import files as rule_files
from reshard.storage import files as fs
from reshard.storage.routing import output_for

DESCRIPTOR_KIND = rule_files.LAYOUT
DESCRIPTOR_VERSION = 1
MESH = ("dp", "tp", "pp")       # the degrees every topology has, in this order
# Facts of a checkpoint's contents that descriptors saved by earlier versions carry: not a topology, ignored
# (Catalog.contents computes them)
CONTENT_KEYS = ("optimizer", "states", "params", "elements", "step")
PRECISION_KEYS = ("dtype", "master_dtype")
Path = str | os.PathLike[str]
T = TypeVar("T")


@dataclass(frozen=True)
class SpecKey:
    """One key of a target spec ("dp=4,tp=2"), with the values it takes: the parser accepts these keys and values
    and no other, and the CLI's help lists them, so the two cannot drift apart. The mesh's keys are here (MESH_KEYS);
    a writer declares the keys its format adds (reshard.formats: which writers take which)."""
    name: str
    value: str          # what its value looks like
    meaning: str
    minimum: int | None = None      # a whole number, at least this
    choices: tuple[int, ...] = ()   # a whole number, one of these
    # a value that is not a whole number: the value it stands for, or a UsageError saying what the key takes
    text: Callable[[str], object] | None = None

    def accepted(self) -> str:
        """The values it takes, in words (--help and the parser's messages say the same)."""
        if self.choices:
            *most, last = map(str, self.choices)
            return f"{', '.join(most)} or {last}" if most else last
        if self.minimum is not None:
            return f"{self.minimum} or more"
        return self.value

    def parse(self, text: str) -> object:
        """The value `text` stands for, or a UsageError saying what the key takes."""
        text = text.strip()
        if self.text is not None:
            return self.text(text)
        number = int(text) if re.fullmatch(r"[0-9]+", text) else None
        if number is None or (self.choices and number not in self.choices) or \
                (self.minimum is not None and number < self.minimum):
            raise UsageError(f"{self.name} is {self.accepted()}, not {text!r}" if self.choices else
                             f"{self.name} is a whole number, {self.accepted()}, not {text!r}")
        return number


MESH_KEYS = (
    SpecKey("dp", "M", "data-parallel degree", minimum=1),
    SpecKey("tp", "T", "tensor-parallel degree", minimum=1),
    SpecKey("pp", "P", "pipeline-parallel degree: stages", minimum=1),
)


def spec_keys(spec: str) -> set[str]:
    """The keys a layout spec ("dp=4,tp=2") names."""
    return {item.partition("=")[0].strip() for item in spec.split(",") if item.strip()}


def parse_spec(spec: str, keys: tuple[SpecKey, ...]) -> dict[str, object]:
    """{key: value} of a spec ("dp=4,tp=2"), each key one of `keys` and given once, each value one it takes."""
    known = {k.name: k for k in keys}
    given: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise UsageError(f"bad layout spec {spec!r}: {name!r} is not a key; expected keys "
                             f"{', '.join(known)} as key=value")
        if name in given:     # not the last one silently
            raise UsageError(f"bad layout spec {spec!r}: {name} is given twice")
        try:
            given[name] = known[name].parse(value)
        except UsageError as e:
            raise UsageError(f"bad layout spec {spec!r}: {e}") from None
    return given


@dataclass(frozen=True)
class Degrees(Mapping[str, int]):
    """Named mesh degrees, in order: dp, tp and pp first (every topology has them), then any a format adds."""
    named: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if tuple(name for name, _ in self.named[:len(MESH)]) != MESH:
            raise ValueError(f"a mesh starts with {', '.join(MESH)}, not {self.named!r}")

    @classmethod
    def of(cls, dp: int, tp: int = 1, pp: int = 1, **more: int) -> Degrees:
        return cls((("dp", dp), ("tp", tp), ("pp", pp), *more.items()))

    def __getitem__(self, name: str) -> int:
        for key, degree in self.named:
            if key == name:
                return degree
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.named)

    def __len__(self) -> int:
        return len(self.named)

    def replaced(self, changes: Mapping[str, int]) -> Degrees:
        """These degrees with those `changes` names set; a name not here yet is added at the end."""
        added = tuple((name, degree) for name, degree in changes.items() if name not in self)
        return Degrees(tuple((name, changes.get(name, degree)) for name, degree in self.named) + added)


class FormatTopology(Protocol):
    """What a checkpoint's format adds to its topology beyond the mesh's degrees, a frozen object of that format's
    own (reshard/formats/<format>/); the core only shows and saves it, in the format's words."""

    def terms(self, brief: bool = False) -> tuple[tuple[str, object], ...]:
        """The key=value terms the topology line gives after the mesh degrees (`brief`: those worth a list row)."""
        ...

    def descriptor(self) -> dict[str, object]:
        """Its keys in a layout descriptor file, in their order there."""
        ...


# A format's reader of its keys in a descriptor file: (the source's FormatTopology or None, the file's other keys)
# -> the FormatTopology they name; a UsageError when one is wrong.
DescriptorKeys = Callable[["FormatTopology | None", Mapping[str, object]], "FormatTopology | None"]


@dataclass(frozen=True)
class Layout:
    degrees: Degrees
    dtype: str = "float32"           # the model's (16-bit or fp32) parameter dtype
    master_dtype: str = "float32"    # dtype of the optimizer's master copy
    format_topology: FormatTopology | None = None    # what its format adds (None: nothing)

    @classmethod
    def of(cls, dp: int, tp: int = 1, pp: int = 1, dtype: str = "float32", master_dtype: str = "float32",
           format_topology: FormatTopology | None = None) -> Layout:
        return cls(Degrees.of(dp, tp, pp), dtype, master_dtype, format_topology)

    @property
    def dp(self) -> int:
        return self.degrees["dp"]

    @property
    def tp(self) -> int:
        return self.degrees["tp"]

    @property
    def pp(self) -> int:
        return self.degrees["pp"]

    @property
    def world_size(self) -> int:
        """Processes: the product of the mesh's degrees (a format's own degrees cut within them)."""
        return math.prod(self.degrees[name] for name in MESH)

    def topology(self, brief: bool = False) -> str:
        """e.g. "dp=4,tp=2,pp=1" and its format's terms; `brief`, a list's row: "dp=4,tp=2" and the terms its format
        gives a row, the degrees of 1 past dp left out."""
        degrees = [(k, v) for i, (k, v) in enumerate(self.degrees.items()) if not brief or i == 0 or v != 1]
        own = self.format_topology.terms(brief) if self.format_topology is not None else ()
        return ",".join(f"{k}={v}" for k, v in (*degrees, *own))

    def to_dict(self) -> dict[str, object]:
        """Its descriptor file's JSON object."""
        own = self.format_topology.descriptor() if self.format_topology is not None else {}
        scalars = {k: v for k, v in own.items() if not isinstance(v, dict)}     # (the format's sections last)
        return {"kind": DESCRIPTOR_KIND, "version": DESCRIPTOR_VERSION, **self.degrees, **scalars,
                "dtype": self.dtype, "master_dtype": self.master_dtype, **{k: v for k, v in own.items()
                                                                           if k not in scalars}}

    @classmethod
    def from_dict(cls, data: Mapping[str, object], own: DescriptorKeys, source: str = "layout",
                  known: tuple[str, ...] = ()) -> Layout:
        """The layout a descriptor's JSON object names; `own` reads the keys its format adds (`known`: their
        names), from nothing."""
        if data.get("kind") != DESCRIPTOR_KIND:
            raise UsageError(f"{source}: not a reshard layout descriptor (kind is {data.get('kind')!r})")
        if data.get("version") != DESCRIPTOR_VERSION:
            raise UsageError(f"{source}: layout descriptor version {data.get('version')!r} is not supported")
        _refuse_unknown(data, known, source)
        if "dp" not in data:    # (the other degrees are 1 unless named)
            raise UsageError(f"{source}: dp must be a positive integer, got None")
        base = cls(Degrees.of(1), str(data.get("dtype", "float32")), str(data.get("master_dtype", "float32")))
        return base._merged(data, own, known, source)

    def save(self, path: Path) -> None:
        """Its descriptor file written at `path` (a local path or an object store's URL: reshard.storage)."""
        output_for(os.fspath(path)).put(os.fspath(path), (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path, own: DescriptorKeys, known: tuple[str, ...] = ()) -> Layout:
        """The layout a descriptor file names (`own`, `known`: as from_dict)."""
        return _at_file(path, lambda: cls.from_dict(read_descriptor(path), own, str(path), known))

    def with_descriptor(self, path: Path, own: DescriptorKeys, known: tuple[str, ...] = ()) -> Layout:
        """This layout with the degrees, and what its format adds, that a descriptor file names (`own`, `known`:
        as from_dict); keys it leaves out keep this layout's values. Its dtypes, when given, must match: a
        conversion keeps the training precision."""
        given = read_descriptor(path)
        _at_file(path, lambda: _refuse_unknown(given, known, str(path)))
        for key in PRECISION_KEYS:
            if key in given and given[key] != getattr(self, key):
                raise UsageError.at(path, f"{key} {given[key]} differs from the source's {getattr(self, key)}; "
                                          "convert keeps the training precision")
        return _at_file(path, lambda: self._merged(given, own, known, str(path)))

    def with_degrees(self, changes: Mapping[str, int]) -> Layout:
        return replace(self, degrees=self.degrees.replaced(changes))

    def _merged(self, data: Mapping[str, object], own: DescriptorKeys, known: tuple[str, ...],
                source: str) -> Layout:
        """This layout with the degrees and format keys descriptor object `data` names."""
        degrees = {name: data[name] for name in MESH if name in data}
        for name, value in {"dp": self.dp, "tp": self.tp, "pp": self.pp, **degrees}.items():
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{source}: {name} must be a positive integer, got {value!r}")
        try:
            format_topology = own(self.format_topology, {k: v for k, v in data.items() if k in known})
        except UsageError as e:
            raise UsageError(f"{source}: {e}") from None
        return replace(self.with_degrees({k: v for k, v in degrees.items() if isinstance(v, int)}),
                       format_topology=format_topology)


def _refuse_unknown(data: Mapping[str, object], known: tuple[str, ...], source: str) -> None:
    """A key a descriptor may not hold is a mistake, not a no-op."""
    unknown = sorted(set(data) - {"kind", "version", *MESH, *PRECISION_KEYS, *known, *CONTENT_KEYS})
    if unknown:
        raise UsageError(f"{source}: unknown layout keys {', '.join(unknown)}")


def _at_file(path: Path, read: Callable[[], T]) -> T:
    try:
        return read()
    except ReshardError as e:   # its line starts with the path: say which file it is about, typed
        raise type(e)(str(e), file=path) from None


def _once(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys each appear once (json takes the last of a repeated key silently)."""
    twice = sorted({k for i, (k, _) in enumerate(pairs) if k in (k2 for k2, _ in pairs[:i])})
    if twice:
        raise UsageError(f"{', '.join(twice)} given twice")
    return dict(pairs)


def read_descriptor(path: Path) -> dict[str, object]:
    """A layout descriptor file's JSON (on disk or in object storage: reshard.storage), its kind and version
    checked."""
    try:
        with fs.open(path) as f:
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
