"""What DeepSpeed adds to a topology (a core.layout.FormatTopology): its ZeRO stage, the expert-parallel degree, the
pipeline's partition method and layer classes, the model's key-value heads, and how its optimizer partitions were
cut; the `--to` keys that set them (its writers take them) and their keys in a layout descriptor file."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from reshard.core.layout import FormatTopology, Layout, SpecKey
from reshard.errors import UsageError
from reshard.formats.protocol import TargetKeys

PARTITION_METHODS = ("uniform", "parameters", "type:REGEX")
STAGES = (1, 2, 3)      # the ZeRO stages written; 0 is a source without ZeRO partitioning (another format's)
DESCRIPTOR_KEYS = ("zero", "options")


@dataclass(frozen=True)
class DeepSpeedTopology:
    zero: int = 0
    # How the optimizer partitions were cut, where DeepSpeed has variants (as its reader found them, or a live
    # engine's), then what `--to` names; in this order they are the descriptor's and inspect's "options"
    ds_config: dict | None = None           # a live engine's own config (reshard.deepspeed_engine)
    bf16_optimizer: bool = False
    elastic: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    sub_group_size: int | None = None
    # the weights alone (`reshard thin`): ZeRO-1/2 module files, or ZeRO-3 fp32 partitions without the moments
    weights_only: bool = False
    ep: int | None = None                   # a mixture of experts' expert-parallel degree
    partition_method: str | None = None     # PipelineModule's, for the target's stages (None: the source's cut)
    layer_types: tuple[str, ...] | None = None      # the pipeline layers' class names, for partition=type:REGEX
    kv_heads: int | None = None             # the model's key-value heads: AutoTP's cut at a new tp

    def options(self) -> dict:
        """The settings other than the stage that are set, by name."""
        named = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "zero"}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in named.items() if v is not None and v is not False}

    def terms(self, brief: bool = False) -> tuple[tuple[str, object], ...]:
        """zero=S, and ep=E for a mixture of experts; a list's row names a stage only (none for 0)."""
        if brief:
            return (("zero", self.zero),) if self.zero else ()
        return (("zero", self.zero),) + ((("ep", self.ep),) if self.ep is not None else ())

    def descriptor(self) -> dict[str, object]:
        return {"zero": self.zero, "options": self.options()}


def of(layout: Layout) -> DeepSpeedTopology:
    """What DeepSpeed settings `layout` has: none set for another format's (no ZeRO stage)."""
    own = layout.format_topology
    return own if isinstance(own, DeepSpeedTopology) else DeepSpeedTopology()


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


def _partition(text: str) -> str:
    problem = partition_method_problem(text)
    if problem:
        raise UsageError(problem)
    return text


def _layer_types(text: str) -> tuple[str, ...]:
    types = tuple(t.strip() for t in text.split("/"))
    if not all(types):
        raise UsageError("layer_types is the layers' class names separated by '/'")
    return types


# The `--to` keys DeepSpeed's files have a place for beyond the mesh's, each with the field it sets
SPEC_KEYS = (
    SpecKey("zero", "S", "ZeRO stage", choices=STAGES),
    SpecKey("partition", "|".join(PARTITION_METHODS),
            "how the pipeline layers are cut into stages (PipelineModule's partition_method; type:REGEX balances "
            "the layers whose class name matches REGEX)", text=_partition),
    SpecKey("layer_types", "A/B/...", "the pipeline layers' class names in order, for partition=type:REGEX "
            "(a checkpoint does not hold them)", text=_layer_types),
    SpecKey("kv_heads", "K", "the model's key-value heads, how AutoTP cuts attention at a new tp: each tensor cut "
            "by heads holds whole ones", minimum=1),
    SpecKey("ep", "E", "expert-parallel degree of a mixture-of-experts checkpoint, dividing dp and the expert "
            "count", minimum=1),
)
_FIELD_OF_KEY = {"zero": "zero", "partition": "partition_method", "layer_types": "layer_types",
                "kv_heads": "kv_heads", "ep": "ep"}


def target(source: Layout, given: Mapping[str, object]) -> DeepSpeedTopology:
    """The source's DeepSpeed settings with those the `--to` keys in `given` (parsed by SPEC_KEYS) name: the
    source's stage, expert-parallel degree and partition variants unless named."""
    changes: dict[str, Any] = {_FIELD_OF_KEY[k]: v for k, v in given.items()}
    return replace(of(source), **changes)


def from_descriptor(source: DeepSpeedTopology | None, data: Mapping[str, object]) -> DeepSpeedTopology:
    """The settings a descriptor file's `zero` and `options` name: all of them for a new layout (`source` None);
    over a source's, its stage and pipeline partition (the partitions' variants are the source's own)."""
    zero = data.get("zero", source.zero if source is not None else 0)
    if zero not in (0, *STAGES):
        raise UsageError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    options = data.get("options") or {}
    if not isinstance(options, dict):
        raise UsageError(f"options must be an object, got {options!r}")
    if source is not None:
        options = {k: options[k] for k in ("partition_method", "layer_types") if options.get(k) is not None}
    names = {f.name for f in fields(DeepSpeedTopology)} - {"zero"}
    unknown = sorted(set(options) - names)
    if unknown:
        raise UsageError(f"unknown layout options {', '.join(unknown)}")
    method = options.get("partition_method")
    problem = partition_method_problem(method) if method is not None else None
    if problem:
        raise UsageError(problem)
    types = options.get("layer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) and t for t in types)):
        raise UsageError("layer_types must be a list of the pipeline layers' class names")
    settings = {**options, **({"layer_types": tuple(types)} if types is not None else {})}
    return replace(source or DeepSpeedTopology(), zero=zero, **settings)


def read_descriptor_keys(source: FormatTopology | None, data: Mapping[str, object]) -> DeepSpeedTopology:
    """core.layout.DescriptorKeys: over a source of another format, from no DeepSpeed setting."""
    if source is None:
        return from_descriptor(None, data)
    return from_descriptor(source if isinstance(source, DeepSpeedTopology) else DeepSpeedTopology(), data)


# What DeepSpeed's writers (deepspeed, universal) take of a target topology beyond the mesh's degrees
TARGET_KEYS = TargetKeys(SPEC_KEYS, target, read_descriptor_keys, DESCRIPTOR_KEYS)


def load(path) -> Layout:
    """The layout a descriptor file names."""
    return Layout.load(path, read_descriptor_keys, DESCRIPTOR_KEYS)
