"""Read verl's FSDP checkpoints: a role folder (``global_step_N/actor``), the step folder holding its roles, or the
run folder whose tracker (``latest_checkpointed_iteration.txt``) names the step.

A step's roles are each one model: the actor (the first role present) is the catalog, each other role (the critic) a
companion catalog rooted at its own folder, so a step is validated, compared and converted whole.

verl's FSDPCheckpointManager saves each rank's sharded state dicts with torch.save: the model as DTensors (FSDP2, and
FSDP1 under verl's device mesh), each a row block (Shard(0)) of its parameter; FSDP2's optimizer as DTensors of the
same blocks, keyed by the parameter's index in model order. A parameter's rows are the ranks' blocks in rank order,
so each rank's block is one fragment of the logical tensor. FSDP1's optimizer (use_orig_params=False) keys each flat
parameter by its index, each rank's file holding its block of it: which parameters a flat one holds is told from the
sizes (flat_params.py), each parameter's state its runs of the ranks' blocks (flat_optim.py). A save without optimizer
files (verl's save_contents without "optimizer") is read as weights, every parameter frozen.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from reshard.core.catalog import (
    MASTER,
    MODULE,
    Catalog,
    CatalogBuilder,
    FileInfo,
    Fragment,
    ParamInfo,
    ScalarTensor,
    TensorDraft,
    TrainingState,
)
from reshard.core.layout import Layout
from reshard.errors import CheckpointError
from reshard.formats.protocol import NoOptions
from reshard.formats.torchsave_read import TensorRef
from reshard.formats.unpartitioned import UNPARTITIONED
from reshard.formats.verl import flat_optim
from reshard.formats.verl.flat_params import FlatParam
from reshard.formats.verl.notes import RANK_KINDS, VerlNotes, rank_file
from reshard.formats.verl.pickles import ShardRef, load
from reshard.reading.source_bytes import file_size, read_scalar
from reshard.storage import files as fs, names

FORMAT = "verl"
OPTIONS = NoOptions
IN_FRAMEWORK_FOLDERS = False
ROLES = ("actor", "critic")
FSDP_CONFIG = "fsdp_config.json"
HF_FOLDER = "huggingface"
TRACKER = "latest_checkpointed_iteration.txt"    # verl's trainer writes it beside the step folders, last
_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_ANY_RANK_FILE = re.compile(r"^(" + "|".join(RANK_KINDS) + r")_world_size_\d+_rank_\d+\.pt$")
_STEP = re.compile(r"^global_step_(\d+)$")


def role_folder(path: str) -> str | None:
    """The role folder `path` is or holds (the actor's first), None: none."""
    if fs.isdir(path) and fs.isfile(os.path.join(path, FSDP_CONFIG)) and _world(path):
        return path
    for role in ROLES:
        inner = os.path.join(path, role)
        if fs.isdir(inner) and fs.isfile(os.path.join(inner, FSDP_CONFIG)):
            return inner
    return None


def _world(folder: str) -> int | None:
    sizes = {int(m.group(1)) for name in fs.listdir(folder) if (m := _RANK_FILE.match(name))}
    return sizes.pop() if len(sizes) == 1 else None


def resolve(path: str, tag: str | None) -> tuple[str, str | None, str]:
    """(step folder, run dir or None, its name) of the checkpoint at `path`: a run dir's is the step its trainer's
    tracker names ("3" is global_step_3/), the one it resumes from."""
    path = fs.abspath(path)
    if tag is not None:
        return os.path.join(path, tag), path, tag
    if _STEP.match(os.path.basename(path)):
        return path, os.path.dirname(path), os.path.basename(path)
    tracker = os.path.join(path, TRACKER)
    with fs.open(tracker) as f:
        text = f.read(64).strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise CheckpointError(tracker, f"holds {text[:20]!r}, not a step number")
    folder = os.path.join(path, f"global_step_{int(text)}")
    if not fs.isdir(folder):
        raise CheckpointError(folder, f"missing: {TRACKER} names step {text}")
    return folder, path, os.path.basename(folder)


def sniff(path: str, tag: str | None) -> bool:
    """A role folder, a step folder holding one, or a run folder: verl's tracker beside step folders of roles
    (Megatron-LM's tracker has the same name, beside iter_N folders); the step it names is read."""
    if not fs.isdir(path):
        return False
    return role_folder(path) is not None or fs.isfile(os.path.join(path, TRACKER)) and any(
        _STEP.match(name) and role_folder(os.path.join(path, name)) for name in fs.listdir(path))


def _config(folder: str) -> dict:
    where = os.path.join(folder, FSDP_CONFIG)
    try:
        with fs.open(where) as f:
            config = json.load(f)
        return {"fsdp": int(config["FSDP_version"]), "world": int(config["world_size"])}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(where, f"not verl's fsdp_config.json (FSDP_version, world_size): {e}") from None


def read(path: str, options: NoOptions) -> Catalog:
    path = fs.abspath(path)
    step_folder, tracker = path, None
    if role_folder(path) is None and fs.isfile(os.path.join(path, TRACKER)):    # a run: the step its tracker names
        step_folder, _, name = resolve(path, None)
        tracker = name[len("global_step_"):]     # (resolve names global_step_N)
    folder = role_folder(step_folder)
    if folder is None:
        raise CheckpointError(step_folder, "no verl role folder (actor/ or critic/ with fsdp_config.json)")
    config = _config(folder)
    world = config["world"]
    catalog = CatalogBuilder(root=path, format=FORMAT, layout=Layout.of(world, format_topology=UNPARTITIONED))
    if tracker is not None:     # a run folder is its own save dir: output beside it does not overlap it
        catalog.save_dir = path
    step = _STEP.match(os.path.basename(os.path.dirname(folder)))
    catalog.tag = os.path.basename(os.path.dirname(folder)) if step else ""
    models = _rank_files(catalog, folder, world, path, "model", "model_states")
    for file, state in models:
        if not isinstance(state, dict):
            raise CheckpointError(file, f"holds a {type(state).__name__}, not a state dict")
    order = list(models[0][1])
    names = [k for k, v in models[0][1].items() if isinstance(v, ShardRef)]
    if config["fsdp"] == 1 and world == 1 and not names:     # NO_SHARD at one rank: every entry a plain tensor
        names = order
    saved_optimizer = fs.isfile(os.path.join(folder, rank_file("optim", world, 0)))
    optimizers = _optimizers(catalog, folder, world, path) if saved_optimizer else []
    first = optimizers[0][1] if optimizers else {"param_groups": []}
    flat: tuple[FlatParam, ...] = ()
    if config["fsdp"] == 1 and optimizers:     # each index a flat parameter, which its size tells
        sizes = [(n, math.prod(_shape(models[0][1][n]))) for n in names]
        flat = flat_optim.flat_params(sizes, optimizers, world)
        group_of = {n: g for g, group in enumerate(first["param_groups"]) for i in group["params"]
                    for n in flat[i].names}
    else:
        group_of = _groups(names, first)
    for key in order:
        shape = _shape(models[0][1][key])
        kind = "trainable" if key in group_of else "frozen" if key in names else "buffer"
        catalog.params[key] = ParamInfo(key, shape, kind, group_of.get(key))
        states = (MODULE, MASTER) if kind == "trainable" else (MODULE,)
        for state in states:
            _add_blocks(catalog, key, state, [(file, s[key]) for file, s in models])
    catalog.order = order
    if flat:
        flat_optim.read(catalog, flat, optimizers, world)
    elif optimizers:
        _fill_optimizer(catalog, names, optimizers)
    hf = os.path.join(folder, HF_FOLDER)
    if fs.isdir(hf):    # the model's config, tokenizer and generation config: an export's folder loads with them
        catalog.model_files = tuple(os.path.join(hf, n) for n in sorted(fs.listdir(hf))
                                    if fs.isfile(os.path.join(hf, n)))
    scheduler, accelerator = _extra_state(folder, world)
    catalog.training = TrainingState(global_steps=int(step.group(1)) if step else None, lr_scheduler=scheduler)
    first_dtensor = next((v for v in models[0][1].values() if isinstance(v, ShardRef)), None)
    catalog.notes = _notes(path, folder, config, first_dtensor or _mesh_of_one(accelerator), flat, tracker)
    if folder != path:      # the step's other roles, each its own model (a role folder read alone has none)
        catalog.companions = tuple(read(os.path.join(step_folder, role), options) for role in ROLES
                                   if fs.isdir(os.path.join(step_folder, role)) and
                                   os.path.join(step_folder, role) != folder)
    return catalog.freeze()


def _mesh_of_one(accelerator: str | None) -> ShardRef:
    """The mesh facts of a save with no DTensor (FSDP1 at one rank, NO_SHARD): verl's (a 1-D "fsdp" mesh over the
    default process group) on the device whose RNG state it saved."""
    return ShardRef(None, (), "", mesh_dims=("fsdp",), device_type=accelerator or "cpu", mesh_groups=("0",))


def _notes(root: str, folder: str, config: dict, first: ShardRef, flat: tuple, tracker: str | None) -> VerlNotes:
    """The writer's facts: the mesh the ranks saved on (a 1-D mesh is all verl's FSDP workers build without HSDP),
    and every file of the checkpoint that is no rank's: the role's own and, read from a step or a run, the step's
    (data.pt); another role's are its companion's, a run's other steps no part of it, reshard's manifest redone."""
    role = os.path.relpath(folder, root) if folder != root else ""
    with fs.open(os.path.join(folder, FSDP_CONFIG)) as f:
        saved = json.load(f)
    scope = os.path.dirname(folder) if role else folder
    carried = []
    for top, dirs, files in fs.walk(scope):
        dirs[:] = [d for d in dirs if _under(os.path.join(top, d), folder)]     # (another role's folder left out)
        for name in files:
            rank_owned = top == folder and (_ANY_RANK_FILE.match(name) or name == FSDP_CONFIG)
            if not rank_owned and name != names.MANIFEST:
                carried.append((os.path.relpath(os.path.join(top, name), root), fs.getsize(os.path.join(top, name))))
    return VerlNotes(config["fsdp"], role, saved, tuple(first.mesh_dims), first.device_type,
                     tuple(first.mesh_groups), tuple(
                         os.path.relpath(os.path.join(folder, rank_file("extra_state", config["world"], r)), root)
                         for r in range(config["world"])), tuple(sorted(carried)), flat, tracker)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


def _shape(value) -> tuple:
    if isinstance(value, ShardRef | TensorRef):
        return tuple(value.shape)
    raise CheckpointError("", f"state dict entry of type {type(value).__name__} is not a tensor")


def _add_blocks(catalog: CatalogBuilder, name: str, state: str, blocks: list) -> None:
    """The logical tensor (name, state) from each rank's block of it, in rank order: a DTensor's local rows
    follow the rows of the ranks before it; a plain tensor is whole on every rank (rank 0's is read)."""
    first = blocks[0][1]
    dtype = first.dtype
    tensor = catalog.add(TensorDraft(name, state, tuple(first.shape), dtype), blocks[0][0])
    if isinstance(first, TensorRef):
        tensor.fragments.append(Fragment(0, first.numel, first.storage, first.storage_offset, 0))
        return
    start = 0
    for rank, (file, ref) in enumerate(blocks):
        local = ref.local
        if not isinstance(local, TensorRef) or not local.is_contiguous():
            raise CheckpointError(file, f"{name} ({state}): its local shard is not a contiguous tensor")
        if any(getattr(p, "dim", 0) != 0 for p in ref.placements):
            raise CheckpointError(file, f"{name} ({state}): sharded on a dim other than 0, not read")
        if local.numel:
            tensor.fragments.append(Fragment(start, start + local.numel, local.storage, local.storage_offset, rank))
        start += local.numel
    if start != math.prod(first.shape):
        raise CheckpointError(blocks[-1][0], f"{name} ({state}): the ranks' blocks hold {start} elements, the "
                              f"tensor {math.prod(first.shape)}")


def _rank_files(catalog: CatalogBuilder, folder: str, world: int, root: str, prefix: str,
                kind: str) -> list[tuple[str, Any]]:
    """[(file, what it unpickles to)] of each rank's `{prefix}_world_size_W_rank_R.pt`, listed in the catalog; a
    missing one is named."""
    out = []
    for rank in range(world):
        file = os.path.join(folder, f"{prefix}_world_size_{world}_rank_{rank}.pt")
        if not fs.isfile(file):
            raise CheckpointError(file, f"missing: rank {rank}'s {prefix} file of world size {world} "
                                        "(fsdp_config.json)")
        catalog.files.append(FileInfo(os.path.relpath(file, root), kind, rank, file_size(file)))
        out.append((file, load(file)))
    return out


def _optimizers(catalog: CatalogBuilder, folder: str, world: int, root: str) -> list:
    out = _rank_files(catalog, folder, world, root, "optim", "optim_states")
    for file, state in out:
        if not (isinstance(state, dict) and "state" in state and "param_groups" in state):
            raise CheckpointError(file, "not a torch.optim state_dict (state, param_groups)")
    return out


def _groups(names: list, optimizer: dict) -> dict:
    """{name: its param group} of FSDP2's trained parameters: entry i is the i-th of the model's state dict."""
    return {names[i]: g for g, group in enumerate(optimizer["param_groups"]) for i in group["params"]
            if isinstance(i, int) and i < len(names)}


def _fill_optimizer(catalog: CatalogBuilder, names: list, optimizers: list) -> None:
    """FSDP2's optimizer: entry i is the i-th parameter of the model's state dict, its moments DTensors of the
    parameter's row blocks."""
    file0, first = optimizers[0]
    catalog.param_groups, catalog.group_scalars = [], [{} for _ in first["param_groups"]]
    for g, group in enumerate(first["param_groups"]):
        indices = list(group["params"])
        if any(not isinstance(i, int) or i >= len(names) for i in indices):
            raise CheckpointError(file0, f"param group {g} lists indices the model's {len(names)} parameters lack")
        hyper = {k: v for k, v in group.items() if k != "params"}
        catalog.param_groups.append({**hyper, "params": [names[i] for i in indices]})
        for i in indices:
            entry = first["state"].get(i) or {}
            for key, value in entry.items():
                if isinstance(value, ShardRef):
                    _add_blocks(catalog, names[i], key, [(f, o["state"][i][key]) for f, o in optimizers])
                elif isinstance(value, TensorRef) and value.shape == ():
                    catalog.record_param_scalar(g, names[i], key, ScalarTensor(read_scalar(value), value.dtype),
                                                file0)
                else:
                    catalog.record_param_scalar(g, names[i], key, value, file0)


def _extra_state(folder: str, world: int) -> tuple[Any, str | None]:
    """(the lr scheduler's state, the accelerator verl saved an RNG state of: "cuda", None for the CPU alone) of
    rank 0's extra-state file."""
    file = os.path.join(folder, f"extra_state_world_size_{world}_rank_0.pt")
    if not fs.isfile(file):
        return None, None
    extra = load(file)
    if not isinstance(extra, dict):
        return None, None
    rng = extra.get("rng")
    devices = [k for k in rng if k not in ("cpu", "numpy", "random")] if isinstance(rng, dict) else []
    return extra.get("lr_scheduler"), devices[0] if devices else None
