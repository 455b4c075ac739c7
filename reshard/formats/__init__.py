"""File formats. Only this package knows file names, keys and byte layouts.

Every reader module satisfies reshard.formats.protocol.Reader, every writer module (`convert --format`)
reshard.formats.protocol.Writer; the protocol module says in which order they are called. Which modules those are,
and everything else said of a format, is its entry in the registry (reshard.formats.registry). The rest of
reshard reaches them only through the functions here.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from reshard import paths
from reshard.core.layout import MESH_KEYS, Layout, SpecKey, parse_spec
from reshard.errors import ReshardError, UnknownFormatError, UsageError
from reshard.formats import framework, registry
from reshard.formats.deepspeed import files as ds_files
from reshard.formats.framework import FRESH, NEW_RANK_POLICIES, REPRODUCIBILITY, lightning as lightning_framework  # noqa: F401  (for cli, convert)
from reshard.formats.protocol import MESH_ONLY, Reader, ReadRequest, TargetKeys, Writer
from reshard.formats.registry import Pointer, WriterEntry  # noqa: F401  (the registry's types, for callers)
from reshard.reading import commit_state
from reshard.rules import files as rule_files
from reshard.storage import files as fs
from reshard.storage.names import MANIFEST

if TYPE_CHECKING:
    from reshard.core.catalog import Catalog
    from reshard.core.container import Container
    from reshard.core.write_requests import WriteRequest
    from reshard.formats.weights_only import Form

# Derived from the registry (reshard.formats.registry), the one place a format is described: the reader modules in
# the order they are tried, the writers of `convert --format`, the weights-only forms by catalog format or framework.
READERS = registry.readers()
WRITERS = registry.writers()
WEIGHTS_ONLY = {by: form.module for by, form in registry.thin_forms().items()}


def weights_only_form(catalog: Catalog, path: str, keep_masters: bool = False) -> Form:
    """The weights-only form (weights_only.Form) of the full checkpoint at `path` (`catalog` read from it); a
    ReshardError in one line where its format has none reshard writes."""
    frame = framework.framework_of(catalog)
    at_frame = frame is not None and fs.normpath(frame.folder) == fs.normpath(fs.abspath(path))
    name = frame.name if at_frame and frame is not None else catalog.format
    if name not in WEIGHTS_ONLY:
        raise ReshardError.at(path, f"thinning {name} checkpoints is not built (weights-only forms: "
                                    f"{registry.thinnable()})")
    return importlib.import_module(WEIGHTS_ONLY[name]).form(catalog, path, keep_masters)


def read(path: str, tag: str | None = None, layout_rules: str | None = None, config: str | None = None,
         model_order: bool = True) -> Catalog:
    """The Catalog of the checkpoint at `path`, whatever its format. `layout_rules`: a tensor-parallel
    rule file (a path, or the name of one shipped with reshard: rule_files) for checkpoints that do not say how
    their tensors were cut. `config`: the model's config.json, for a checkpoint that does not record what it gives
    (a torchtitan save's fused q/k/v: the key-value head count). `model_order`: False where the caller names every
    param itself (ReadRequest.model_order). A training framework's folder around a DeepSpeed
    save (HF Trainer's checkpoint-N/, Accelerate's save_state dir, Lightning's *.ckpt/) is read as that save, with
    the framework's own files in catalog.framework and any of them missing in catalog.problems."""
    with fs.settled():      # its readers ask what the same paths are many times: an object store answers once
        reader = reader_for(path, tag)
        rules = rule_files.find(layout_rules, rule_files.TP_RULES) if layout_rules else None
        catalog = reader.read(path, reader_options(reader, path, ReadRequest(tag, rules, config,
                                                                            None if model_order else False)))
        catalog.check_dtypes()
        around = framework.detect(path) if reader.IN_FRAMEWORK_FOLDERS else None
        if around is not None:      # else what the reader found (Lightning, from DeepSpeed's client state)
            catalog = replace(catalog, framework=around, model_files=catalog.model_files or around.model_files)
        frame = framework.framework_of(catalog)
        if frame is not None:
            frame = replace(frame, world=catalog.layout.world_size)
            catalog = replace(catalog, framework=frame, problems=(*catalog.problems, *frame.missing()))
    return catalog


def framework_dispositions(catalog: Catalog, format_name: str, world: int,
                           policy: str) -> tuple[framework.Disposition, ...]:
    """What becomes of each of the framework's files (framework.Disposition) in an output of `format_name` at
    `world` processes: the framework resumes only from its own layout (DeepSpeed's files, or FSDP's as it writes
    them), so another format carries none."""
    frame = framework.framework_of(catalog)
    if frame is None:
        return ()
    if _resumed_by_frameworks(format_name) and lightning_framework.crosses(frame, format_name):
        # only FSDPStrategy's folder has a file of Lightning's (meta.pt); DeepSpeedStrategy keeps it as client state
        return tuple(framework.Disposition(framework.DROPPED, f.name, None, f"its dict is written as the "
                                           f"{format_name} output's client state, where DeepSpeedStrategy reads it")
                     for f in frame.files)
    if not _resumed_by_frameworks(format_name):
        resumed = " or ".join(name for name in WRITERS if _resumed_by_frameworks(name))
        return tuple(framework.Disposition(framework.DROPPED, f.name, None, f"{frame.name} resumes from its own "
                                           f"layout (--format {resumed}), not from {format_name}") for f in frame.files)
    return frame.dispositions(world, policy)


def rank_state(catalog: Catalog, format_name: str, target: Layout,
               policy: str) -> tuple[str, tuple[framework.Disposition, ...]] | None:
    """(what a process the source lacked gets under `policy`, in words; what becomes of each per-process file) of an
    output whose writer keeps per-process state of its own (Writer.OWN_RANK_STATE: verl's extra-state files); None
    for every other."""
    if format_name not in WRITERS or format_name != catalog.format or not writer(format_name).OWN_RANK_STATE:
        return None
    return importlib.import_module(WRITERS[format_name].module).rank_state(catalog, target, policy)


def with_framework(catalog: Catalog, format_name: str, world: int, policy: str,
                   targets: list[WriteRequest]) -> list[WriteRequest]:
    """The output's files: the writer's `targets` and the framework's own as framework_dispositions says, the
    whole folder the framework writes at `world` processes."""
    frame = framework.framework_of(catalog)
    if frame is None or not _resumed_by_frameworks(format_name) or lightning_framework.crosses(frame, format_name):
        return targets
    return [*targets, *frame.target_files(world, policy)]



def _resumed_by_frameworks(format_name: str) -> bool:
    return format_name in WRITERS and writer(format_name).RESUMED_BY_FRAMEWORKS


def default_tag(catalog: Catalog) -> str:
    """The output's tag for a source whose format has no tags (DCP, torch.save, HF, Lightning): the name DeepSpeed's
    own save gives its step, or the one the framework around it gives DeepSpeed (Accelerate's pytorch_model), which
    its resume asks for."""
    frame = framework.framework_of(catalog)
    if frame is not None and frame.deepspeed_tag:
        return frame.deepspeed_tag
    step = catalog.training.global_steps
    return ds_files.step_tag(catalog.contents().step if step is None else step)


def reader_for(path: str, tag: str | None = None) -> Reader:
    """The reader module of the checkpoint at `path` (with tag folder `tag`)."""
    if not fs.exists(path):
        raise ReshardError.at(path, "no such file or directory")
    marker = commit_state.unfinished_marker(path)
    if marker is not None:      # before any reader: its files may all be there, but the commit is not
        raise ReshardError.at(path, f"a conversion written in place that has not finished ({marker} and no "
                                    f"{MANIFEST}): still being written, or killed (`reshard convert --resume` "
                                    "finishes it)")
    for name in READERS:
        module = importlib.import_module(name)
        if module.sniff(path, tag):
            return module
    if tag is not None and not fs.isdir(os.path.join(path, tag)):
        raise ReshardError.at(os.path.join(path, tag), "tag folder does not exist")
    raise UnknownFormatError.at(path, f"not a checkpoint reshard can read (supported: {registry.supported()})")


# The pointer files of a run directory (reshard.lifecycle.run_layout reads them; reshard.lifecycle.units says what a
# checkpoint folder is whole): DeepSpeed's `latest` and `latest_universal` name tag folders, Megatron-LM's tracker an
# iteration ("200" is iter_0000200/, as its reader resolves it).
POINTERS = registry.pointers()


def pointed(save_dir: str, pointer: Pointer) -> str | None:
    """The checkpoint `pointer` (a file in `save_dir`) names, as a path; None when it is unreadable, names nothing
    that exists, or a path leaving `save_dir`."""
    try:
        if pointer.how == registry.RESOLVE:
            folder, _, _ = importlib.import_module(pointer.reader).resolve(save_dir, None)
            return folder
        with fs.open(os.path.join(save_dir, pointer.file)) as f:
            tag = f.read(4096).strip()
    except (OSError, UnicodeDecodeError, ReshardError):
        return None
    return None if paths.escape(tag, save_dir, single=True) else os.path.join(save_dir, tag)


def reader_options(reader: Reader, path: str, request: ReadRequest) -> object:
    """`request` as the reader's OPTIONS; an option the reader does not take is a usage error, a hint it does not
    take (ReadRequest.model_order) left out."""
    given = request.given()
    for name in list(given):
        if name not in _taken(reader) and ReadRequest.option(name).get("hint"):
            del given[name]     # (a hint a reader has no use for)
        elif name not in _taken(reader):
            option = ReadRequest.option(name)
            raise UsageError.at(path, f"{reader.FORMAT} checkpoints take no {option['flag']} ({option['use']})")
    return reader.OPTIONS(**given)


def takes(path: str, tag: str | None, option: str) -> bool:
    """Does the format of the checkpoint at `path` take reading option `option` (a ReadRequest field)?"""
    return option in _taken(reader_for(path, tag))


def _taken(reader: Reader) -> set[str]:
    return {f.name for f in fields(reader.OPTIONS)}


def every_spec_key() -> tuple[SpecKey, ...]:
    """Every key of `--to`, once: the mesh's, then those the writers declare, in their order (--help lists them)."""
    return tuple({k.name: k for k in (*MESH_KEYS, *(k for w in WRITERS.values() for k in w.keys.keys))}.values())


def spec_keys_of(format_name: str) -> tuple[str, ...]:
    """The `--to` keys (every_spec_key) an output of `format_name` has a place for: the mesh's and its writer's."""
    return tuple(k.name for k in (*MESH_KEYS, *_target_keys(format_name).keys))


def formats_taking(keys: Iterable[str]) -> list[str]:
    """The output formats whose writers take every one of these `--to` keys (every_spec_key)."""
    return [name for name in WRITERS if set(keys) <= set(spec_keys_of(name))]


def target_layout(source: Layout, spec: str, format_name: str) -> Layout:
    """`source` with what a `--to` spec ("dp=4,zero=3") names: the mesh's degrees, and what the writer of
    `format_name` takes of the other keys (a key it has no place for is the caller's to refuse)."""
    given = parse_spec(spec, every_spec_key())
    mesh = {k.name for k in MESH_KEYS}
    keys = _target_keys(format_name)
    own = {k.name for k in keys.keys}
    target = source.with_degrees({k: v for k, v in given.items() if k in mesh and isinstance(v, int)})
    return replace(target, format_topology=keys.target(source, {k: v for k, v in given.items() if k in own}))


def descriptor_layout(source: Layout, path: str, format_name: str) -> Layout:
    """`source` with what a layout descriptor file names (Layout.with_descriptor), read by the writer of
    `format_name`."""
    known = tuple(dict.fromkeys(k for w in WRITERS.values() for k in w.keys.descriptor_keys))
    return source.with_descriptor(path, _target_keys(format_name).descriptor, known)


def _target_keys(format_name: str) -> TargetKeys:
    """(a format no writer writes takes the mesh's keys: the refusal to write it comes with the writer)"""
    return WRITERS[format_name].keys if format_name in WRITERS else MESH_ONLY


def writer(format_name: str) -> Writer:
    """The writer module of a target format."""
    if format_name not in WRITERS:
        raise UsageError(f"no writer for format {format_name!r} (known: {', '.join(WRITERS)})")
    return importlib.import_module(WRITERS[format_name].module)


def container_loader(container: Container) -> Callable[..., object]:
    """For a container (reshard.core.container.Container) whose files a live process loads in memory
    (reshard.live.materialize): the function (header, storage_of) -> the object loading the written file would give."""
    from reshard.formats.containers import CONTAINERS
    loader = CONTAINERS[container.name].loader
    if loader is None:
        raise ReshardError(f"{container.name!r} files are only written to disk")
    return loader
