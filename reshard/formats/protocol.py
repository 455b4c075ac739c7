"""What a format implements: a Reader turns a checkpoint's files into a Catalog, a Writer turns a Catalog
and a target Layout into the files of a checkpoint. Each is a module named by its format's entry in the registry
(reshard.formats.registry) that satisfies the Protocol below; the rest of reshard calls formats only through
reshard.formats, so nothing outside reshard/formats/ imports a format module.

A Reader should expect this sequence of calls by `reshard.formats.read`:

  1) sniff(path, tag) on each registered reader in turn, until one says the checkpoint is its own;
  2) (registry) every option the command gives (a ReadRequest field that is not None) must be a field of
     that reader's OPTIONS; an option it lacks is refused in one line (UsageError, exit 2) before any
     file is opened;
  3) read(path, options) once, `options` an instance of its OPTIONS holding what was given;
  4) (registry) the returned Catalog's fragments are checked against their tensors' dtypes
     (Catalog.check_dtypes), so no reader repeats that check.

A Writer declares what it takes of a target topology beyond the mesh's degrees (its `--to` keys, parsed into a
FormatTopology of its format's own) as a TargetKeys beside its module in its registry entry: --help, the spec
parser and the refusal of a key it has no place for read that, without importing it. It should expect this
sequence of calls by `reshard.convert`, with `target` built so:

  1) target_files(catalog, target, tag, source_save_dir) once: every file of the output, or a
     ReshardError saying in one line why this catalog cannot be written at `target`;
  2) describe(target, tag): what the output is, in the format's own terms (for the plan and the manifest);
  3) batch_size_advice(catalog, target), by `plan` only: what happens to the global batch size.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reshard.core.layout import DescriptorKeys, FormatTopology, Layout, SpecKey

if TYPE_CHECKING:
    from reshard.core.catalog import Catalog
    from reshard.core.write_requests import Output, WriteRequest


@dataclass(frozen=True)
class ReadRequest:
    """Every reading option a command can give; None: not given. A reader takes a subset (its OPTIONS).
    Each field's metadata names its command-line flag and says what it is for, for the refusal."""
    tag: str | None = field(default=None, metadata={
        "flag": "--tag", "use": "a tag names a folder of a DeepSpeed save dir"})
    layout_rules: str | None = field(default=None, metadata={
        "flag": "--layout-rules", "use": "layout rules say how tensor parallelism cut a DeepSpeed checkpoint "
                                         "that does not record it"})
    config: str | None = field(default=None, metadata={
        "flag": "--config", "use": "a model's config.json gives what a torchtitan save with fused q/k/v does not "
                                   "record: its key-value head count"})
    # a hint, not a flag: False where the caller names every param itself (an import brings a model to the names and
    # order of a rule file), so a reader need not learn the model's own order and ties (a Hugging Face folder's:
    # from its class, built by the installed transformers, seconds); a reader that has nothing to skip ignores it
    model_order: bool | None = field(default=None, metadata={"hint": True})

    def given(self) -> dict[str, Any]:
        """{field name: value} of the options given."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def option(cls, name: str) -> Mapping[str, str]:
        """The metadata of option `name` (flag, use)."""
        return next(f.metadata for f in fields(cls) if f.name == name)


@dataclass(frozen=True)
class NoOptions:
    """The OPTIONS of a format that takes no reading option (a file or folder says all there is)."""


@dataclass(frozen=True)
class TagOption:
    """The OPTIONS of a format whose save dir holds tag folders."""
    tag: str | None = None


@dataclass(frozen=True)
class ConfigOption:
    """The OPTIONS of a format whose saves may lack the model's shape: the model's config.json (a path)."""
    config: str | None = None


@dataclass(frozen=True)
class ModelOrderOption:
    """The OPTIONS of a format whose files lose the model's parameter order and ties (safetensors), which the reader
    learns elsewhere unless `model_order` is False (ReadRequest.model_order)."""
    model_order: bool | None = None


@runtime_checkable
class Reader(Protocol):
    FORMAT: str      # the format's name, as its catalogs, `inspect` and `list` spell it ("dcp")
    OPTIONS: type    # a frozen dataclass whose fields are the ReadRequest fields this format takes
    # Its saves sit in a training framework's folder (HF Trainer's checkpoint-N/, Accelerate's, Lightning's): the
    # registry reads the framework's own files around them (formats.framework)
    IN_FRAMEWORK_FOLDERS: bool

    def sniff(self, path: str, tag: str | None) -> bool:
        """Is the checkpoint at `path` (with tag folder `tag`, when given) in this format? From names and magic
        bytes only: cheap, and never an error (a damaged file of this format is still this format's)."""

    # `options`: an instance of its own OPTIONS (each reader names its class; no one type is common to them)
    def read(self, path: str, options: Any) -> Catalog:
        """The Catalog of the checkpoint at `path`, from metadata alone, with `options` (an OPTIONS); what
        is wrong but readable goes to catalog.problems, what is unreadable raises a ReshardError."""


@dataclass(frozen=True)
class TargetKeys:
    """What a writer's output takes of a target topology beyond the mesh's degrees (dp, tp, pp): its `--to` keys,
    parsed into its own FormatTopology, and their keys in a layout descriptor file. Declared in a module of the
    format that --help can read without importing the writer (its registry entry: registry.WriterEntry)."""
    keys: tuple[SpecKey, ...]
    # (the source's layout, {key: value} of its keys a spec gives) -> the target's FormatTopology
    target: Callable[[Layout, Mapping[str, object]], FormatTopology | None]
    descriptor: DescriptorKeys      # its keys in a descriptor file -> the target's FormatTopology
    descriptor_keys: tuple[str, ...] = ()


def _sources(source: Layout, given: Mapping[str, object]) -> FormatTopology | None:
    return source.format_topology


def _source_own(source: FormatTopology | None, data: Mapping[str, object]) -> FormatTopology | None:
    return source


# An output written at the mesh's degrees alone: what the source's format added it keeps (for the target's
# topology line), and it reads none of a descriptor's other keys
MESH_ONLY = TargetKeys((), _sources, _source_own)


@runtime_checkable
class Writer(Protocol):
    PLACES_EXPERTS: bool   # writes a mixture-of-experts catalog with its expert placement (else it is refused)
    # A training framework (formats.framework) resumes from its files: the framework's own files go with them
    RESUMED_BY_FRAMEWORKS: bool
    # It saves params under names of its own, which a module-names rule file (reshard.rules.module_names) maps to a
    # module's: a source under the module's names is written under its own by those rules undone
    SAVES_OWN_NAMES: bool
    # Its output holds per-process state of its own beside the model (verl's extra-state files: the lr scheduler and
    # RNG states): target_files leaves out the files of the processes the source lacked, which
    # rank_state_files(catalog, target, policy) gives as the policy says (formats.framework.NEW_RANK_POLICIES), and
    # rank_state(catalog, target, policy) says it in words, with what becomes of each such file (Disposition)
    OWN_RANK_STATE: bool

    def target_files(self, catalog: Catalog, target: Layout, tag: str,
                     source_save_dir: str | None = None) -> list[WriteRequest]:
        """Every file of `catalog` written at `target` (reshard.core.write_requests: TensorFile, TextFile, CopiedFile),
        named relative to the output directory; `tag` names the output's tag, `source_save_dir` is where
        files copied as they are (scripts) come from (None: none)."""

    def output_tag(self, catalog: Catalog, tag: str) -> str:
        """The tag the output is written under when none is asked for, given the source's (or the default one)."""

    def describe(self, target: Layout, tag: str) -> Output:
        """What the output is, in the format's own terms."""

    def batch_size_advice(self, catalog: Catalog, target: Layout) -> str | None:
        """What happens to the global batch size when dp changes, and which setting keeps it; None: nothing to say."""
