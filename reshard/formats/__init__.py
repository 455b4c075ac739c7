"""File formats. Only this package knows file names, keys and byte layouts.

Every reader module satisfies reshard.formats.protocol.Reader, every writer module (`convert --format`)
reshard.formats.protocol.Writer; the protocol module says in which order they are called. The rest of
reshard reaches them only through the functions here.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

from reshard import manifest, paths, rule_files
from reshard.core.layout import MESH_KEYS, Layout, SpecKey, parse_spec
from reshard.errors import ReshardError, UnknownFormatError, UsageError
from reshard.formats import framework
from reshard.formats.deepspeed import files as ds_files, topology as ds_topology, universal as ds_universal
from reshard.formats.framework import FRESH, NEW_RANK_POLICIES, REPRODUCIBILITY, lightning as lightning_framework  # noqa: F401  (for cli, convert)
from reshard.formats.megatron import topology as megatron_topology
from reshard.formats.protocol import MESH_ONLY, Reader, ReadRequest, TargetKeys, Writer
from reshard.storage import files as fs

# Tried in order; the first whose sniff() accepts the path reads it.
READERS = ["reshard.formats.megatron.reader",      # latest_checkpointed_iteration.txt, iter_NNNNNNN/ (torch_dist)
           "reshard.formats.deepspeed.universal_reader",   # latest_universal, zero/ trees
           "reshard.formats.deepspeed.reader",
           "reshard.formats.dcp.lightning_reader",       # .metadata + meta.pt (Lightning's FSDPStrategy, sharded)
           "reshard.formats.dcp.reader",                 # .metadata + *.distcp
           "reshard.formats.dcp.fsdp_reader",            # pytorch_model_fsdp_0/ + optimizer_0/ (Accelerate's FSDP)
           "reshard.formats.single.hf_trainer",          # checkpoint-N/ with trainer_state.json
           "reshard.formats.single.safetensors_reader",  # *.safetensors, index, save_pretrained folders
           "reshard.formats.single.lightning",           # *.ckpt
           "reshard.formats.single.torchsave_checkpoint"]           # *.pt, *.pth, *.bin


@dataclass(frozen=True)
class WriterEntry:
    module: str             # satisfies protocol.Writer; imported when its format is written
    keys: TargetKeys        # what its output takes of a target topology (read by --help without importing it)


# Target formats of `convert --format`. Every key of `--to` has a place in DeepSpeed's files; a DCP directory is one
# file per data-parallel rank (tp=1 and pp=1 gather a model-parallel source), with no ZeRO stage. A Megatron-LM save dir
# (torch_dist) at any tp, pp and dp, its optimizer in the sharding `sharding=` names.
WRITERS = {"deepspeed": WriterEntry("reshard.formats.deepspeed.writer", ds_topology.TARGET_KEYS),
           "universal": WriterEntry("reshard.formats.deepspeed.universal_writer", ds_topology.TARGET_KEYS),
           "dcp": WriterEntry("reshard.formats.dcp.writer", MESH_ONLY),
            "megatron": WriterEntry("reshard.formats.megatron.writer", megatron_topology.TARGET_KEYS),
            # the folder a framework (HF Trainer, Accelerate) resumes from with FSDP's sharded state dict, its own
            # files carried beside it as for DeepSpeed
            "fsdp": WriterEntry("reshard.formats.dcp.fsdp_writer", MESH_ONLY),
            # torchtitan's step-N folder (its CheckpointManager's flat keys), its own entries carried
            "torchtitan": WriterEntry("reshard.formats.dcp.torchtitan_writer", MESH_ONLY)}


# Each format's weights-only form (reshard.formats.weights_only.Form), what its framework writes with its model-only
# option and loads with its weights-only load: by catalog format, or by the training framework whose folder is
# the checkpoint (HF Trainer's checkpoint-N/ around a DeepSpeed save). `reshard thin` writes it.
WEIGHTS_ONLY = {"deepspeed": "reshard.formats.deepspeed.weights_only",
                "megatron": "reshard.formats.megatron.weights_only",
                "hf-trainer": "reshard.formats.single.trainer_weights",
                "HF Trainer": "reshard.formats.single.trainer_weights",
                "Accelerate": "reshard.formats.single.accelerate_weights",
                "torchtitan": "reshard.formats.dcp.torchtitan_weights",
                "Lightning": "reshard.formats.dcp.lightning_weights",
                "dcp": "reshard.formats.dcp.weights_only"}


def weights_only_form(catalog, path: str, keep_masters: bool = False):
    """The weights-only form (weights_only.Form) of the full checkpoint at `path` (`catalog` read from it); a
    ReshardError in one line where its format has none reshard writes."""
    frame = framework.framework_of(catalog)
    at_frame = frame is not None and fs.normpath(frame.folder) == fs.normpath(fs.abspath(path))
    name = frame.name if at_frame and frame is not None else catalog.format
    if name not in WEIGHTS_ONLY:
        raise ReshardError.at(path, f"thinning {name} checkpoints is not built (weights-only forms: DeepSpeed "
                                    "ZeRO-1/2/3 tag folders, HF Trainer checkpoint-N/ with DeepSpeed ZeRO-1/2, DDP or "
                                    "FSDP (sharded or full state dict), Accelerate save_state folders with FSDP "
                                    "(sharded or full), Megatron-LM iteration folders, torchtitan step-N/, Lightning "
                                    "FSDPStrategy *.ckpt/, plain DCP folders)")
    return importlib.import_module(WEIGHTS_ONLY[name]).form(catalog, path, keep_masters)


def read(path: str, tag: str | None = None, layout_rules: str | None = None, config: str | None = None):
    """The Catalog of the checkpoint at `path`, whatever its format. `layout_rules`: a tensor-parallel
    rule file (a path, or the name of one shipped with reshard: rule_files) for checkpoints that do not say how
    their tensors were cut. `config`: the model's config.json, for a checkpoint that does not record what it gives
    (a torchtitan save's fused q/k/v: the key-value head count). A training framework's folder around a DeepSpeed
    save (HF Trainer's checkpoint-N/, Accelerate's save_state dir, Lightning's *.ckpt/) is read as that save, with
    the framework's own files in catalog.framework and any of them missing in catalog.problems."""
    reader = reader_for(path, tag)
    rules = rule_files.find(layout_rules, rule_files.TP_RULES) if layout_rules else None
    catalog = reader.read(path, reader_options(reader, path, ReadRequest(tag, rules, config)))
    catalog.check_dtypes()
    around = framework.detect(path) if reader.IN_FRAMEWORK_FOLDERS else None
    if around is not None:      # else what the reader found (Lightning, from DeepSpeed's client state)
        catalog = replace(catalog, framework=around, model_files=catalog.model_files or around.model_files)
    frame = framework.framework_of(catalog)
    if frame is not None:
        frame = replace(frame, world=catalog.layout.world_size)
        catalog = replace(catalog, framework=frame, problems=(*catalog.problems, *frame.missing()))
    return catalog


def framework_dispositions(catalog, format_name: str, world: int, policy: str) -> tuple:
    """What becomes of each of the framework's files (framework.Disposition) in an output of `format_name` at
    `world` processes: the framework resumes only from its own layout (DeepSpeed's files, or FSDP's as it writes
    them), so another format carries none."""
    frame = catalog.framework
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


def with_framework(catalog, format_name: str, world: int, policy: str, targets: list) -> list:
    """The output's files: the writer's `targets` and the framework's own as framework_dispositions says, the
    whole folder the framework writes at `world` processes."""
    frame = catalog.framework
    if frame is None or not _resumed_by_frameworks(format_name) or lightning_framework.crosses(frame, format_name):
        return targets
    return targets + frame.target_files(world, policy)



def _resumed_by_frameworks(format_name: str) -> bool:
    return format_name in WRITERS and writer(format_name).RESUMED_BY_FRAMEWORKS


def default_tag(catalog) -> str:
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
    marker = manifest.unfinished(path)
    if marker is not None:      # before any reader: its files may all be there, but the commit is not
        raise ReshardError.at(path, f"a conversion written in place that has not finished ({marker} and no "
                                    f"{manifest.NAME}): still being written, or killed (`reshard convert --resume` "
                                    "finishes it)")
    for name in READERS:
        module = importlib.import_module(name)
        if module.sniff(path, tag):
            return module
    if tag is not None and not fs.isdir(os.path.join(path, tag)):
        raise ReshardError.at(os.path.join(path, tag), "tag folder does not exist")
    raise UnknownFormatError.at(path, "not a checkpoint reshard can read (supported: Megatron-core torch_dist, "
                                "DeepSpeed ZeRO, universal and "
                                "tag folders, PyTorch DCP directories, torch.save .pt/.pth/.bin, Lightning .ckpt, "
                                "Hugging Face Trainer checkpoint folders (DeepSpeed, FSDP, one process), "
                                "Accelerate save_state folders (DeepSpeed, FSDP), safetensors)")


@dataclass(frozen=True)
class Pointer:
    """A file a framework writes beside its checkpoints once a save is done, naming the one it resumes from: the
    lifecycle (list, prune, watch) never deletes what it names, and holds back what is newer as still written."""
    file: str               # its name in the save dir
    reader: str             # the reader module whose format writes it
    how: str                # "tag": its text is the checkpoint's folder name; "resolve": the reader's resolve()


# How a run directory's checkpoints are named by the frameworks that save them (reshard.formats.run_layout reads
# these; reshard.formats.units says what a checkpoint folder is whole): DeepSpeed's `latest` and `latest_universal`
# name tag folders, Megatron-LM's tracker an iteration ("200" is iter_0000200/, as its reader resolves it).
POINTERS = (Pointer(ds_files.LATEST, "reshard.formats.deepspeed.reader", "tag"),
            Pointer(ds_universal.LATEST_UNIVERSAL, "reshard.formats.deepspeed.universal_reader", "tag"),
            Pointer("latest_checkpointed_iteration.txt", "reshard.formats.megatron.reader", "resolve"))


def pointed(save_dir: str, pointer: Pointer) -> str | None:
    """The checkpoint `pointer` (a file in `save_dir`) names, as a path; None when it is unreadable, names nothing
    that exists, or a path leaving `save_dir`."""
    try:
        if pointer.how == "resolve":
            folder, _, _ = importlib.import_module(pointer.reader).resolve(save_dir, None)
            return folder
        with fs.open(os.path.join(save_dir, pointer.file)) as f:
            tag = f.read(4096).strip()
    except (OSError, UnicodeDecodeError, ReshardError):
        return None
    return None if paths.escape(tag, save_dir, single=True) else os.path.join(save_dir, tag)


def reader_options(reader: Reader, path: str, request: ReadRequest):
    """`request` as the reader's OPTIONS; an option the reader does not take is a usage error."""
    given = request.given()
    for name in given:
        if name not in _taken(reader):
            option = ReadRequest.option(name)
            raise UsageError.at(path, f"{reader.FORMAT} checkpoints take no {option['flag']} ({option['use']})")
    return reader.OPTIONS(**given)


def takes(path: str, tag: str | None, option: str) -> bool:
    """Does the format of the checkpoint at `path` take reading option `option` (a ReadRequest field)?"""
    return option in _taken(reader_for(path, tag))


def _taken(reader: Reader) -> set:
    return {f.name for f in fields(reader.OPTIONS)}


def every_spec_key() -> tuple[SpecKey, ...]:
    """Every key of `--to`, once: the mesh's, then those the writers declare, in their order (--help lists them)."""
    return tuple({k.name: k for k in (*MESH_KEYS, *(k for w in WRITERS.values() for k in w.keys.keys))}.values())


def spec_keys_of(format_name: str) -> tuple[str, ...]:
    """The `--to` keys (every_spec_key) an output of `format_name` has a place for: the mesh's and its writer's."""
    return tuple(k.name for k in (*MESH_KEYS, *_target_keys(format_name).keys))


def formats_taking(keys: Iterable[str]) -> list:
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


def container_loader(container):
    """For a container (reshard.core.container.Container) whose files a live process loads in memory
    (reshard.materialize): the function (header, storage_of) -> the object loading the written file would give."""
    from reshard.formats.containers import CONTAINERS
    loader = CONTAINERS[container.name].loader
    if loader is None:
        raise ReshardError(f"{container.name!r} files are only written to disk")
    return loader
