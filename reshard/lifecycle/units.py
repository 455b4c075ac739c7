"""What one checkpoint is on disk, as the framework that saved it writes it: a unit, taken whole or left alone.

A training framework saves one checkpoint as a folder of many files and sub-folders (the Hugging Face Trainer's
`checkpoint-N/` holds `pytorch_model_fsdp_0/` and `optimizer_0/` under FSDP, a DeepSpeed `global_stepN/`
under DeepSpeed, RNG pickles for every process). Those parts are no checkpoints of their own: listed alone they
would be counted, judged and deleted apart from the rest. So a folder is recognised by its framework's markers
(names in a directory listing; no file is opened) as one Unit, never looked into by the run scan:

- HF Trainer: `checkpoint-N/` (or any folder with `trainer_state.json`) with DeepSpeed (`latest` + a tag folder),
  FSDP sharded (`pytorch_model_fsdp_0/`, `optimizer_0/`: DCP folders; the first alone where `reshard thin` left
  its record), FSDP full (`pytorch_model_fsdp.bin`, `optimizer.bin`), or DDP / one process (`model.safetensors` or
  `pytorch_model.bin`, `optimizer.pt`);
- Accelerate: save_state's `checkpoint_N/` (`random_states_K.pkl`) with DeepSpeed, FSDP, or neither
  (`model.safetensors`, `optimizer.bin`, `scheduler.bin`);
- Lightning: `*.ckpt` files and `*.ckpt/` folders with DeepSpeed or FSDP (DCP + `meta.pt`);
- Megatron-LM: `iter_NNNNNNN/`, torch_dist (DCP + `metadata.json`) or the legacy torch format (`mp_rank_*/`);
- torchtitan `step-N/` and any other DCP folder (`.metadata`, `*.distcp`), DeepSpeed tag folders of a save dir
  (`latest`), universal trees.

Whether reshard reads a unit is the format registry's to say (reshard.formats.reader_for): a unit one of its
readers takes is READ, and `reshard list` then proves it whole (every data file read: unread) and
complete; one none takes is OPAQUE, listed as one row naming framework and backend, never deleted. A folder with
checkpoint files that matches no framework whole is UNKNOWN: listed, never deleted.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from reshard.errors import ReshardError
from reshard.formats import reader_for, registry, weights_only
from reshard.formats.dcp.chunks import METADATA, RANK_FILE
from reshard.formats.deepspeed import files as ds_files
from reshard.formats.framework import lightning
from reshard.formats.hf import weights as hf_weights
from reshard.formats.hf.trainer import OPTIMIZER, RNG, SCHEDULER, TRAINER_STATE
from reshard.storage import files as fs
from reshard.storage.names import STAGING_SUFFIX

READ, OPAQUE, UNKNOWN = "read", "opaque", "unknown"
NOT_READ = "no reader of reshard's format registry reads it"

_TRAINER, _ACCELERATE = registry.entry("hf-trainer").run, registry.entry("accelerate").run
HF_CHECKPOINT, HF_STAGING = re.compile(_TRAINER.checkpoints), re.compile(_TRAINER.staging)
ACCELERATE_CHECKPOINT = re.compile(_ACCELERATE.checkpoints)     # save_state with automatic_checkpoint_naming
RANDOM_STATES = re.compile(r"^random_states_\d+\.pkl$")         # Accelerate's, one per process
MEGATRON_ITER = re.compile(registry.entry("megatron").run.checkpoints)
MEGATRON_META = "metadata.json"
LIGHTNING_SUFFIX = registry.entry("lightning").run.suffix
FSDP_MODEL = re.compile(r"^pytorch_model_fsdp(_\d+)?(_rank\d+)?(\.bin)?$")    # accelerate's FSDP_MODEL_NAME
FSDP_OPTIMIZER_DIR = re.compile(r"^optimizer_\d+$")                          # sharded: a DCP folder
ACCELERATE_OPTIMIZER = "optimizer.bin"     # save_state's (and FSDP full state dict's) torch.save of the optimizer
# Names only found inside a checkpoint: beside them, a folder is part of one (or an unrecognised one).
MEMBERS = (RNG, RANDOM_STATES, FSDP_MODEL, re.compile(r"^(optimizer|scheduler|scaler)(_\d+)?\.(pt|bin)$"),
           ds_files.MODEL_STATES, ds_files.ZERO3_MODEL_STATES, ds_files.OPTIM_STATES, ds_files.LAYER_STATES,
           re.compile(r"^(model_optim_rng|distrib_optim|common)\.pt$"), RANK_FILE)
DATA_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".safetensors", ".distcp", ".ckpt", ".npy", ".npz", ".msgpack")
# A folder holding folders named so is a folder of checkpoints (an output dir), whatever it holds besides: the
# registry's checkpoint and staging folder names of every format.
UNIT_NAMES = registry.run_patterns("checkpoints") + registry.run_patterns("staging")
# The names a save loop gives its checkpoints, whole: beside them, any other name is no member of the series
# (a weights export `checkpoint-1-weights/` kept in the output dir is not step 1's save); a save dir's tag folders too
SERIES_NAMES = (*UNIT_NAMES, *registry.run_patterns("tags"))

@dataclass(frozen=True)
class Unit:
    """One checkpoint as its framework wrote it. `reading`: READ (a reader of the format registry reads it; `list`
    proves it whole and complete), OPAQUE (recognised; no reader reads it: `why`), UNKNOWN (`why`)."""
    framework: str      # "HF Trainer", "DCP", "unknown"
    reading: str
    why: str = ""
    backend: str = ""   # "with FSDP (sharded state dict)", "(DDP or one process)"
    # recognised by a framework's markers: its files sit beside what a reader reads, so `list` proves every data
    # file read or the framework's own (unread) before it calls the unit complete
    claimed: bool = False

    @property
    def what(self) -> str:
        return f"{self.framework} {self.backend}".strip()

    @property
    def format(self) -> str:
        """The framework as `list`'s FORMAT column spells formats: `hf-trainer`, `megatron-lm`, `dcp`."""
        return self.framework.lower().replace(" ", "-")


@dataclass(frozen=True)
class Listing:
    """A folder's directory listing, split once."""
    files: frozenset
    dirs: frozenset

    @classmethod
    def of(cls, folder: str) -> Listing:
        try:
            names = fs.listdir(folder)
        except OSError:
            names = []
        paths = {n: os.path.join(folder, n) for n in names}
        dirs = {n for n, p in paths.items() if fs.isdir(p) and not fs.islink(p)}
        return cls(frozenset(set(names) - dirs), frozenset(dirs))


def in_series(name: str) -> bool:
    """Is `name` (reshard's `.X.reshard-tmp` staging of X included) one a save loop gives its checkpoints?"""
    staged = re.fullmatch(rf"\.(.+){re.escape(STAGING_SUFFIX)}", name)
    return any(p.match(staged.group(1) if staged else name) for p in SERIES_NAMES)


def is_member(name: str) -> bool:
    """A file name only ever found inside a checkpoint (an RNG pickle, a rank file, an optimizer's state)."""
    return any(p.match(name) for p in MEMBERS)


def holds_data(listing: Listing) -> bool:
    """Files that look like checkpoint data (tensors, pickles): a folder of them is something, if nothing known."""
    return any(n.endswith(DATA_SUFFIXES) or n == METADATA for n in listing.files)


def holds_units(listing: Listing) -> bool:
    """Sub-folders named as checkpoints: `listing` is a run's output folder, not one checkpoint."""
    return any(p.match(d) for d in listing.dirs for p in UNIT_NAMES) or \
        any(d.endswith(LIGHTNING_SUFFIX) for d in listing.dirs)


def framework_unit(name: str, listing: Listing, folder: str) -> Unit | None:
    """The unit a framework's markers make of `folder` (named `name`), or None when none claims it. A folder of
    checkpoints (an output dir holding `checkpoint-N/`) is never one."""
    if holds_units(listing):
        return None
    if name.endswith(LIGHTNING_SUFFIX):
        return _lightning(listing, folder)
    if TRAINER_STATE in listing.files or HF_CHECKPOINT.match(name):
        return _hf_trainer(listing, folder)
    if any(RANDOM_STATES.match(n) for n in listing.files) or ACCELERATE_CHECKPOINT.match(name):
        return _accelerate(listing, folder)
    if MEGATRON_ITER.match(name):
        return _megatron(listing, folder)
    return None


def _engine(listing: Listing) -> str | None:
    """The backend whose files sit inside a framework's folder: DeepSpeed, FSDP sharded or full."""
    if ds_files.LATEST in listing.files:
        return "DeepSpeed"
    if any(FSDP_MODEL.match(d) or FSDP_OPTIMIZER_DIR.match(d) for d in listing.dirs) or \
            any(FSDP_MODEL.match(n) and "_rank" in n for n in listing.files):
        return "FSDP (sharded state dict)"
    if any(FSDP_MODEL.match(n) for n in listing.files):
        return "FSDP (full state dict)"
    return None


def registered(framework: str, backend: str, folder: str) -> Unit:
    """A framework's unit as the format registry takes it: READ when one of its readers reads `folder`, OPAQUE
    (never deleted) when none does."""
    unit = Unit(framework, READ, "", backend, claimed=True)
    try:
        reader_for(folder)
    except ReshardError:
        return replace(unit, reading=OPAQUE, why=f"{unit.what}: {NOT_READ}; never deleted")
    return unit


def unknown(framework: str, missing: str) -> Unit:
    """Something no framework's layout accounts for whole (`missing`: what was looked for)."""
    whole = "a whole checkpoint" if framework == UNKNOWN else f"a whole {framework} checkpoint"
    return Unit(framework, UNKNOWN, f"not recognised as {whole} ({missing}); never deleted")


def _around_engine(framework: str, listing: Listing, folder: str) -> Unit | None:
    """A framework's folder around an engine's files (DeepSpeed, FSDP), as the registry reads it; None: no engine."""
    engine = _engine(listing)
    return registered(framework, f"with {engine}", folder) if engine else None


def _hf_trainer(listing: Listing, folder: str) -> Unit:
    around = _around_engine("HF Trainer", listing, folder)
    if around is not None:
        return around
    if hf_weights.present(folder) and OPTIMIZER in listing.files:
        return registered("HF Trainer", "(DDP or one process)", folder)
    if hf_weights.present(folder) and (SCHEDULER not in listing.files or weights_only.PROVENANCE in listing.files):
        # save_only_model, or `reshard thin` (which keeps the scheduler): nothing else to read
        return registered("HF Trainer", "(weights only)", folder)
    return unknown("HF Trainer", "no DeepSpeed, FSDP or model and optimizer.pt files the Trainer writes")


def _accelerate(listing: Listing, folder: str) -> Unit:
    around = _around_engine("Accelerate", listing, folder)
    if around is not None:
        return around
    if hf_weights.present(folder) or any(n.startswith(("model", "pytorch_model")) for n in listing.files):
        return registered("Accelerate", "save_state (DDP or one process)", folder)
    return unknown("Accelerate", "no DeepSpeed, FSDP or model files save_state writes")


def _lightning(listing: Listing, folder: str) -> Unit:
    if ds_files.LATEST in listing.files:
        return registered("Lightning", "with DeepSpeed", folder)
    if METADATA in listing.files and lightning.FSDP_META in listing.files:
        return registered("Lightning", "with FSDP (sharded)", folder)
    # without its meta.pt, FSDP's DCP files are no Lightning checkpoint whole (the trainer's state is gone)
    return unknown("Lightning", f"a .ckpt folder of neither DeepSpeed's files nor FSDP's with {lightning.FSDP_META}")


def _megatron(listing: Listing, folder: str) -> Unit:
    if MEGATRON_META in listing.files or METADATA in listing.files:
        return registered("Megatron-LM", "(torch_dist)", folder)
    if any(d.startswith("mp_rank_") for d in listing.dirs):
        return registered("Megatron-LM", "(torch, legacy)", folder)
    return unknown("Megatron-LM", "an iter_N folder of neither torch_dist's nor the legacy torch format's files")


def unread(catalog, path: str) -> tuple[str, ...]:
    """The data files (tensors, pickles) of the framework's unit at `path` that neither its reader read (or
    expected) nor the framework around it claims as its own. A unit is proven whole only when there is none: a
    proof on the files read says nothing of the files not read (Accelerate's plain save_state keeps its optimizer
    in an `optimizer.bin` the weights' reader never opens). Scripts, JSON and pointer files hold no state."""
    base = catalog.root if fs.isdir(catalog.root) else os.path.dirname(catalog.root)
    known = {fs.normpath(os.path.join(base, f.path)) for f in catalog.files}
    frame = catalog.framework
    if frame is not None:
        known |= {fs.normpath(os.path.join(frame.folder, f.name)) for f in frame.files if not f.folder}
    # beside what was read: its folder's top and the folders read from (another tag folder that `latest` does
    # not name is an older save of the engine's, not a part of this one)
    read_in = {fs.normpath(path), *(os.path.dirname(k) for k in known)}
    found = [fs.normpath(p) for p, _, _ in fs.tree(path).files_under(path)]
    return tuple(p for p in sorted(found)
                 if p not in known and p.endswith(DATA_SUFFIXES) and os.path.dirname(p) in read_in)


def format_unit(name: str, reader: str) -> Unit:
    """The unit of a folder the format registry reads (`reader`, the format that sniffs it: DeepSpeed tags, DCP,
    universal), as the registry's run layouts name it: a format read by another's reader (torchtitan's step-N/, a
    DCP folder) by the name its save loop gives the folder."""
    for f in registry.FORMATS:
        if f.read_as == reader and f.run.checkpoints and re.match(f.run.checkpoints, name):
            return Unit(f.run.unit, READ, backend=f.run.backend)
    run = registry.entry(reader).run
    return Unit(run.unit, READ, backend=run.backend)


def file_unit(name: str) -> bool:
    """Is the file `name` a checkpoint of its own: a Lightning `*.ckpt`, or a torch.save file whose name carries a
    step and is no framework's member (`rng_state_1.pth` is a part of a Trainer checkpoint, not step 1's save)?"""
    return name.endswith(LIGHTNING_SUFFIX) or not is_member(name)
