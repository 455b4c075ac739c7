"""Read verl's Megatron-backend checkpoints: a role folder verl's MegatronCheckpointManager wrote (its layout schema 2),
the step folder holding it, or the run dir whose tracker names that step.

    <run>/latest_checkpointed_iteration.txt         the step verl's trainer resumes from ("3"), written last
    <run>/global_step_3/data.pt                     the trainer's data loader state
                        actor/ckpt_contents.json    the manifest, rank 0's, written after every other file: framework
                                                    "megatron", schema_version 2, role, global_step, contents
                        actor/transformer_config.json   megatron-core's TransformerConfig as JSON (rank 0)
                        actor/model/dist_ckpt/      dist_checkpointing.save of the model's sharded state dict
                                                    (torch_dist: metadata.json, common.pt, .metadata, __R_I.distcp)
                        actor/optimizer/dist_ckpt/  the same of the optimizer's sharded state dict and the lr scheduler
                        actor/extra/dist_ckpt/      the same of the RNG states
                        actor/model/huggingface/    with a bridge (mbridge, Megatron-Bridge): Hugging Face weights

The model's folder is a torch_dist save of the kind Megatron-LM writes, less its args: the Megatron reader reads it
(geometry from its .metadata) and its catalog is this checkpoint's, re-rooted at the role folder. The optimizer's and
the RNG states' folders are separate DCP checkpoints whose keys (the distributed optimizer's dp_reshardable buckets)
need the model's parameter order and bucket sizes Megatron-LM's args would give: they are not read, but every file
their `.metadata` names is listed, a missing one a problem, so the checkpoint is whole only with all of them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from reshard.core.catalog import Catalog, FileInfo, FormatNotes
from reshard.core.layout import Degrees
from reshard.core.problems import READER, Problem
from reshard.errors import CheckpointError, UnreadLayoutError
from reshard.formats.dcp import metadata as dcp_metadata
from reshard.formats.dcp.chunks import METADATA
from reshard.formats.megatron import reader as megatron_reader
from reshard.formats.megatron.pickles import METADATA_ALLOWED
from reshard.formats.protocol import NoOptions, TagOption
from reshard.formats.verl import reader as fsdp_reader
from reshard.storage import files as fs

FORMAT = fsdp_reader.FORMAT
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = False
MANIFEST = "ckpt_contents.json"
TRANSFORMER_CONFIG = "transformer_config.json"
SCHEMA = 2                                  # MegatronCheckpointManager.MANIFEST_SCHEMA_VERSION
PARTS = ("model", "optimizer", "extra")     # the role folder's sub-folders, each <part>/dist_ckpt/
DIST_CKPT = "dist_ckpt"
LEGACY = ("dist_ckpt", "huggingface")       # schema 1: both directly under the role folder


@dataclass(frozen=True)
class MegatronBackendNotes:
    """The Megatron reader's notes of the model folder (asked for every parameter's details), and verl's framing:
    the role, the manifest, and the folders not read."""
    model: FormatNotes | None
    role: str                                   # "actor", "critic"
    manifest: dict[str, Any]                    # ckpt_contents.json as saved
    not_read: tuple[tuple[str, str], ...]       # (folder relative to the role folder, what it holds)

    def param_details(self, name: str) -> dict:
        return self.model.param_details(name) if self.model is not None else {}

    def layout_scalar(self, key: str, value: object) -> bool:
        return self.model.layout_scalar(key, value) if self.model is not None else False

    def scalars(self) -> dict:
        return self.model.scalars() if self.model is not None else {}

    def framing(self) -> str:
        """verl's framing of the save, in words (inspect)."""
        step = self.manifest.get("global_step")
        return (f"{self.role} of global step {step}, Megatron backend (MegatronCheckpointManager, layout schema "
                f"{self.manifest.get('schema_version')}, world size {self.manifest.get('world_size')}): "
                f"{os.path.join('model', DIST_CKPT)} read by the Megatron reader")

    def unread(self) -> list[dict[str, str]]:
        return [{"path": path, "what": what} for path, what in self.not_read]


def role_folder(path: str) -> str | None:
    """The Megatron-backend role folder `path` is or holds (the actor's first), None: none."""
    if _is_role(path):
        return path
    for role in fsdp_reader.ROLES:
        inner = os.path.join(path, role)
        if _is_role(inner):
            return inner
    return None


def _is_role(folder: str) -> bool:
    """A folder MegatronCheckpointManager saved into: its manifest, a <part>/dist_ckpt/ (the manifest comes last), or
    schema 1's dist_ckpt/ directly inside a role's folder (actor/, critic/); never an FSDP role folder."""
    if not fs.isdir(folder) or fs.isfile(os.path.join(folder, fsdp_reader.FSDP_CONFIG)):
        return False
    return fs.isfile(os.path.join(folder, MANIFEST)) or \
        any(fs.isdir(os.path.join(folder, part, DIST_CKPT)) for part in PARTS) or \
        (os.path.basename(os.path.normpath(folder)) in fsdp_reader.ROLES and fs.isdir(os.path.join(folder, LEGACY[0])))


def _step_of_run(path: str) -> str | None:
    """The step folder a run dir's tracker names, where it holds a Megatron-backend role; None: not such a run dir."""
    if not fs.isfile(os.path.join(path, fsdp_reader.TRACKER)):
        return None
    try:
        step, _run, _name = fsdp_reader.resolve(path, None)
    except CheckpointError:
        return None
    return step if role_folder(step) is not None else None


def resolve(path: str, tag: str | None) -> tuple[str, str | None, str]:
    return fsdp_reader.resolve(path, tag)


def sniff(path: str, tag: str | None) -> bool:
    if not fs.isdir(path):
        return False
    if tag is not None:
        return role_folder(os.path.join(path, tag)) is not None
    return role_folder(path) is not None or _step_of_run(path) is not None


def read(path: str, options: NoOptions) -> Catalog:
    path = fs.abspath(path)
    if role_folder(path) is None:
        path = _step_of_run(path) or path
    folder = role_folder(path)
    if folder is None:
        raise CheckpointError(path, "no verl Megatron-backend role folder (actor/ or critic/ with model/, optimizer/ "
                              "or extra/ dist_ckpt folders)")
    manifest = _manifest(folder)
    model = os.path.join(folder, "model", DIST_CKPT)
    if not fs.isfile(os.path.join(model, megatron_reader.CONFIG)):
        saved = manifest.get("contents", {}).get("model", {}) if isinstance(manifest.get("contents"), dict) else {}
        if isinstance(saved, dict) and saved.get("format") == "megatron_dist_checkpoint":
            raise CheckpointError(model, f"missing: {MANIFEST} says the model was saved here")
        held = f"the model is saved as {saved.get('format')} in {saved.get('path')}" if isinstance(saved, dict) and \
            saved else "no model weights saved"
        raise UnreadLayoutError(model, f"no torch_dist save of the model ({held}): verl's Megatron checkpoints are "
                                "read from model/dist_ckpt (use_dist_checkpointing=True)")
    inner = megatron_reader.read(model, TagOption(None))
    prefix = os.path.relpath(model, folder)
    files = [replace(f, path=os.path.join(prefix, f.path)) for f in inner.files]
    problems = list(inner.problems)
    not_read = []
    for part, what in (("optimizer", "the optimizer's states (the distributed optimizer's buckets) and the lr "
                                     "scheduler"), ("extra", "the RNG states")):
        where = os.path.join(folder, part, DIST_CKPT)
        if not fs.isdir(where):
            if part in manifest.get("save_contents", ()):
                problems.append(Problem(where, None, READER, f"missing: the manifest says {part} was saved"))
            continue
        files += _listed(where, folder, part, problems)
        not_read.append((os.path.relpath(where, folder), f"{what}; its files checked present"))
    for role in fsdp_reader.ROLES:      # another role of the step (the critic): a model of its own, read alone
        other = os.path.join(os.path.dirname(folder), role)
        if other != folder and _is_role(other):
            not_read.append((os.path.relpath(other, folder), f"the step's {role}: read it on its own ({role}/)"))
    layout = replace(inner.layout, degrees=_degrees(folder, manifest, inner.layout.degrees))
    step_folder = os.path.dirname(folder)
    step = manifest.get("global_step")
    notes = MegatronBackendNotes(inner.notes, os.path.basename(folder), manifest, tuple(not_read))
    return replace(inner, root=folder, format=FORMAT, layout=layout, tag=os.path.basename(step_folder),
                   files=tuple(files), problems=tuple(problems), notes=notes, save_dir=step_folder,
                   training=replace(inner.training, global_steps=step if isinstance(step, int) else None))


def _degrees(folder: str, manifest: dict[str, Any], read: Degrees) -> Degrees:
    """The degrees the ranks saved at: tp and pp from transformer_config.json (the model folder's common state holds
    no Megatron-LM args, so the Megatron reader takes 1 for both), dp what the manifest's world size leaves; `read`
    where the save does not say (no transformer_config.json: save_contents without "extra")."""
    where = os.path.join(folder, TRANSFORMER_CONFIG)
    if not fs.isfile(where):
        return read
    try:
        with fs.open(where) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(where, f"not JSON: {e}") from None
    tp, pp = (config.get(k) if isinstance(config, dict) else None for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size"))
    world = manifest.get("world_size")
    if not (isinstance(tp, int) and isinstance(pp, int) and isinstance(world, int)) or min(tp, pp, world) < 1 or \
            world % (tp * pp):
        raise CheckpointError(where, f"tensor_model_parallel_size {tp!r} and pipeline_model_parallel_size {pp!r} "
                              f"do not divide the manifest's world_size {world!r}")
    return Degrees.of(world // (tp * pp), tp, pp)


def _manifest(folder: str) -> dict[str, Any]:
    """ckpt_contents.json, checked to be schema 2's of the Megatron backend; schema 1 refused in one line."""
    where = os.path.join(folder, MANIFEST)
    if not fs.isfile(where):
        if fs.isdir(os.path.join(folder, LEGACY[0])):
            raise UnreadLayoutError(os.path.join(folder, LEGACY[0]), "verl's schema 1 layout (dist_ckpt/ of model, "
                                    "optimizer and RNG states in one save) is not read: verl's "
                                    "scripts/migrate_megatron_checkpoint_layout.py moves it to schema 2")
        raise CheckpointError(where, "missing: verl writes it after every other file, so the save did not finish")
    try:
        with fs.open(where) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(where, f"not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("framework") != "megatron" or \
            manifest.get("schema_version") != SCHEMA:
        got = (manifest.get("framework"), manifest.get("schema_version")) if isinstance(manifest, dict) else None
        raise CheckpointError(where, f"not the manifest of verl's Megatron backend, layout schema {SCHEMA} "
                              f"(framework, schema_version: {got})")
    return manifest


def _listed(where: str, folder: str, part: str, problems: list[Problem]) -> list[FileInfo]:
    """The files of a DCP folder not read, from its `.metadata` (every storage file it names), as FileInfo
    relative to `folder`; a missing one a problem."""
    meta_path = os.path.join(where, METADATA)
    if not fs.isfile(meta_path):
        problems.append(Problem(meta_path, None, READER, "missing: DCP writes .metadata last, so the save did not "
                                "finish"))
        return []
    meta = dcp_metadata.read(meta_path, METADATA_ALLOWED)
    names = sorted({info.relative_path for info in meta.storage_data.values()})
    out = [FileInfo(os.path.relpath(meta_path, folder), f"{part} metadata", None, fs.getsize(meta_path))]
    for name in [megatron_reader.CONFIG, megatron_reader.COMMON, *names]:
        file = os.path.join(where, name)
        if not fs.isfile(file):
            if name in names or name == megatron_reader.CONFIG:
                problems.append(Problem(file, None, READER, f"missing: {part}/{DIST_CKPT}/.metadata names it"
                                        if name in names else "missing: dist_checkpointing writes it"))
            continue
        out.append(FileInfo(os.path.relpath(file, folder), f"{part} (not read)", None, fs.getsize(file)))
    return out
