"""Catalog x target Layout -> verl's FSDP checkpoint at another world size, in the layout its FSDPCheckpointManager
saves and loads (`<role>/{model,optim,extra_state}_world_size_W_rank_R.pt`, `fsdp_config.json` saying W).

Each rank's model file is its sharded state dict as FSDP2 gives it (and FSDP1 under verl's device mesh): every
parameter a DTensor of its torch.chunk row block over a 1-D mesh of W ranks (dtensors.py); its optimizer file is
torch.optim's state_dict() of those blocks, each parameter keyed by its index in model order, the moments DTensors
like the weights, `step` the parameter's own. The extra-state file of a rank the source had is carried as it is (the
lr scheduler and that rank's RNG states); a rank the source lacked gets what --new-rank-state says: `fresh`, the lr
scheduler without RNG states, so verl's loader leaves that process's random streams as its seed made them;
`copy-rank0`, rank 0's file (scheduler and RNG states: rank 0's stream, repeated); `fail`, a refusal naming the rank.
The step's other files (`huggingface/`, `data.pt`) are carried. Read from a run folder, the output is a run folder
too: the step under its own name and verl's tracker naming it, written last (the trainer's order: its
`find_latest_ckpt_path` finds the step only once it is whole).

FSDP1's optimizer (use_orig_params=False) is each rank's block of FSDP's flat parameters: each block at W ranks is
written from the parameters the flat one holds, in its order, then zeros up to the block's size (flat_optim.py).
"""
from __future__ import annotations

import collections
import json
import math
import os

from reshard.core.catalog import MODULE, Catalog, ScalarTensor
from reshard.core.geometry import chunks
from reshard.core.layout import Layout
from reshard.core.write_requests import CopiedFile, NewTensor, Output, Piece, TextFile
from reshard.errors import ReshardError
from reshard.formats.framework.files import (
    CARRIED,
    COPIED,
    COPY_RANK0,
    DROPPED,
    FAIL,
    FRESH,
    FRESH_STATE,
    REWRITTEN,
    Disposition,
)
from reshard.formats.torchsave_write import TorchFile, TorchFileBuilder
from reshard.formats.verl import dtensors, flat_optim
from reshard.formats.verl.megatron_reader import MegatronBackendNotes
from reshard.formats.verl.notes import VerlNotes, rank_file
from reshard.storage import files as fs

PLACES_EXPERTS = False
RESUMED_BY_FRAMEWORKS = False
SAVES_OWN_NAMES = False        # it saves under the model's own state-dict names
OWN_RANK_STATE = True          # each rank's extra-state file (lr scheduler, RNG states): rank_state
FSDP_CONFIG = "fsdp_config.json"
TRACKER = "latest_checkpointed_iteration.txt"
EXTRA_STATE = "the lr scheduler and RNG states"


def target_files(catalog: Catalog, target: Layout, tag: str, source_save_dir: str | None = None) -> list:
    """Every file but the extra state of the ranks the source lacked (rank_state_files: as --new-rank-state says)."""
    notes = _checked(catalog, target)
    world = target.dp
    index = {name: i for i, name in enumerate(n for n in catalog.order if catalog.params[n].kind != "buffer")}
    out: list = []
    for rank in range(world):
        out.append(_model_file(catalog, notes, world, rank))
        if catalog.param_groups and notes.flat_params:
            out.append(_flat_optim_file(catalog, notes, world, rank))
        elif catalog.param_groups:
            out.append(_optim_file(catalog, notes, world, rank, index))
        if rank < len(notes.extra_states):     # its own file (the scheduler and its RNG states), renamed
            source = os.path.join(catalog.root, notes.extra_states[rank])
            out.append(CopiedFile(os.path.join(notes.role, rank_file("extra_state", world, rank)), source,
                                  fs.getsize(source)))
    config = json.dumps({**notes.config, "world_size": world}, indent=4)    # as verl writes it
    out.append(TextFile(os.path.join(notes.role, FSDP_CONFIG), config))
    out += [CopiedFile(path, os.path.join(catalog.root, path), size) for path, size in notes.carried]
    if notes.tracker is not None:       # (text files are written last, in order: this one after every role's)
        out.append(TextFile(TRACKER, notes.tracker))
    return out


def _checked(catalog: Catalog, target: Layout) -> VerlNotes:
    """The source's notes, or the one line saying why this catalog is not written as verl's."""
    notes = catalog.notes
    if isinstance(notes, MegatronBackendNotes):     # its optimizer is not read: a conversion would drop it
        raise ReshardError.at(catalog.root, "verl's Megatron-backend checkpoints are not converted: reshard reads "
                              "their model (inspect, validate, export), not their optimizer/dist_ckpt")
    if not isinstance(notes, VerlNotes):
        # verl's FSDPCheckpointManager.load_checkpoint hands the optimizer file to optimizer.load_state_dict, which
        # refuses another number of param groups than build_optimizer's one
        groups = len(catalog.param_groups)
        grouping = f"its optimizer has {groups} param groups, verl's one (build_optimizer over every parameter), " \
                   "which verl's load_state_dict refuses; and " if groups > 1 else ""
        raise ReshardError.at(catalog.root, f"a {catalog.format} checkpoint is not written as verl's: {grouping}"
                                            "verl's loader takes its device mesh, huggingface/ (config, tokenizer) "
                                            "and extra state (lr scheduler, RNG) from a verl save, which this is not")
    if target.tp != 1 or target.pp != 1:
        raise ReshardError(f"target {target.topology()}: verl's FSDP checkpoints are written for dp ranks only")
    if notes.fsdp != 1 and notes.fsdp != 2:
        raise ReshardError.at(catalog.root, f"FSDP_version {notes.fsdp} is not one verl writes (1 or 2)")
    if len(notes.mesh_dims) != 1:
        raise ReshardError.at(catalog.root, f"a device mesh of dims {notes.mesh_dims} (verl's HSDP) is not written; "
                                            "a 1-D fsdp mesh is")
    return notes


def _torch_file(notes: VerlNotes, kind: str, world: int, rank: int) -> TorchFileBuilder:
    name = rank_file(kind, world, rank)
    return TorchFileBuilder(os.path.join(notes.role, name), archive=os.path.splitext(name)[0])   # torch.save's stem


class _RankTensors:
    """Rank `rank`'s DTensors of one file: each logical tensor's row block, on the file's one mesh."""

    def __init__(self, file: TorchFileBuilder, notes: VerlNotes, world: int, rank: int):
        self.file, self.world, self.rank = file, world, rank
        ranks = file.slot("int32", (world,), [Piece(1, value=r) for r in range(world)])    # the mesh's rank map
        self.mesh = dtensors.mesh(world, rank, notes.mesh_dims, notes.device_type, notes.mesh_groups, ranks)

    def block(self, catalog: Catalog, name: str, state: str) -> object:
        tensor = catalog.tensor(name, state)
        if not tensor.shape:
            raise ReshardError(f"{name} ({state}): a 0-dim tensor has no rows for FSDP to shard")
        first, stop = chunks(tensor.shape[0], self.world)[self.rank]
        row = math.prod(tensor.shape[1:])
        count = (stop - first) * row
        local = self.file.slot(tensor.dtype, (stop - first, *tensor.shape[1:]),
                               [Piece(count, (name, state), first * row)] if count else [])
        return dtensors.sharded(local, tensor.shape, tensor.dtype, self.mesh)


def _model_file(catalog: Catalog, notes: VerlNotes, world: int, rank: int) -> TorchFile:
    file = _torch_file(notes, "model", world, rank)
    tensors = _RankTensors(file, notes, world, rank)
    tree: collections.OrderedDict = collections.OrderedDict()
    # FSDP1 at one rank runs NO_SHARD (FSDP switches to it), whose state dict holds plain tensors, not DTensors
    whole = notes.fsdp == 1 and world == 1
    for name in catalog.order:
        if whole or catalog.params[name].kind == "buffer":    # a plain tensor, whole on every rank
            tensor = catalog.tensor(name, MODULE)
            tree[name] = file.slot(tensor.dtype, tensor.shape, [Piece(tensor.numel, (name, MODULE))])
        else:
            tree[name] = tensors.block(catalog, name, MODULE)
    return file.build(tree)


def _optim_file(catalog: Catalog, notes: VerlNotes, world: int, rank: int, index: dict) -> TorchFile:
    """torch.optim's state_dict() of this rank's blocks: {"state": {index: {...}}, "param_groups": [...]}."""
    file = _torch_file(notes, "optim", world, rank)
    tensors = _RankTensors(file, notes, world, rank)
    states = catalog.optimizer_states()
    state: dict = {}
    groups = []
    for group in catalog.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [index[name] for name in group["params"]]})
        for name in group["params"]:
            entry: dict[str, object] = {}
            for key, value in catalog.scalars_of_param(name).items():
                entry[key] = _scalar(file, value) if isinstance(value, ScalarTensor) else value
            for key in states:
                if (name, key) in catalog.tensors:
                    entry[key] = tensors.block(catalog, name, key)
            if entry:
                state[index[name]] = entry
    return file.build({"state": state, "param_groups": groups})


def _flat_optim_file(catalog: Catalog, notes: VerlNotes, world: int, rank: int) -> TorchFile:
    """FSDP1's: torch.optim's state_dict() of this rank's blocks of the flat parameters (flat_optim.py)."""
    file = _torch_file(notes, "optim", world, rank)
    states = catalog.optimizer_states()
    state: dict = {}
    for i, unit in enumerate(notes.flat_params):
        first = unit.names[0]
        entry: dict[str, object] = {}
        for key, value in catalog.scalars_of_param(first).items():
            entry[key] = _scalar(file, value) if isinstance(value, ScalarTensor) else value
        for key in states:
            if (first, key) in catalog.tensors:
                pieces = flat_optim.pieces(unit, key, world, rank)
                entry[key] = file.slot(catalog.tensor(first, key).dtype, (sum(p.count for p in pieces),), pieces)
        state[i] = entry
    groups = []
    for group in catalog.param_groups:
        held = set(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [i for i, unit in enumerate(notes.flat_params) if unit.names[0] in held]})
    return file.build({"state": state, "param_groups": groups})


def _scalar(file: TorchFileBuilder, value: ScalarTensor) -> NewTensor:
    return file.slot(value.dtype, (), [Piece(1, value=value.value)])


def rank_state_files(catalog: Catalog, target: Layout, policy: str) -> list:
    """The extra-state file of each rank the source lacked, as `policy` says (the module's docstring)."""
    notes = _checked(catalog, target)
    out: list = []
    for rank in range(len(notes.extra_states), target.dp):
        name = os.path.join(notes.role, rank_file("extra_state", target.dp, rank))
        rank0 = os.path.join(catalog.root, notes.extra_states[0])
        if policy == FAIL:
            raise ReshardError.at(rank0, f"rank {rank} of {target.dp} would have no extra state ({name}): the source "
                                         f"saved {len(notes.extra_states)} ranks; --new-rank-state fresh (the lr "
                                         "scheduler, verl seeds its RNG) or copy-rank0 (rank 0's, its random stream "
                                         "repeated)")
        if policy == COPY_RANK0:
            out.append(CopiedFile(name, rank0, fs.getsize(rank0)))
        else:
            out.append(_torch_file(notes, "extra_state", target.dp, rank).build(
                {"lr_scheduler": catalog.training.lr_scheduler}))
    return out


def rank_state(catalog: Catalog, target: Layout, policy: str) -> tuple[str, tuple[Disposition, ...]]:
    """(what a rank the source lacked gets under `policy`, in words; what becomes of each role's extra-state file at
    the target's world size), for plan and the conversion's summary."""
    meaning = {FRESH: "new ranks get the lr scheduler without RNG states: verl keeps the seeded streams of the process",
               COPY_RANK0: "new ranks get a copy of rank 0's (the lr scheduler and RNG states: its random stream, "
                           "repeated)",
               FAIL: "a rank the source did not have is refused"}[policy]
    out: list[Disposition] = []
    for folder, each in (("", catalog), *catalog.companion_folders()):
        notes = _checked(each, target)
        saved = [os.path.join(folder, path) for path in notes.extra_states]
        for rank in range(max(target.dp, len(saved))):
            name = os.path.join(folder, notes.role, rank_file("extra_state", target.dp, rank))
            if rank >= target.dp:
                out.append(Disposition(DROPPED, saved[rank], None, f"rank {rank} does not exist at {target.dp}"))
            elif rank < len(saved):
                out.append(Disposition(CARRIED if saved[rank] == name else REWRITTEN, saved[rank], name,
                                       f"{EXTRA_STATE} of rank {rank}; copied byte for byte"))
            elif policy == COPY_RANK0:
                out.append(Disposition(COPIED, saved[0], name, f"{EXTRA_STATE}: rank 0's stream, repeated"))
            elif policy == FRESH:
                out.append(Disposition(FRESH_STATE, None, name, "the lr scheduler alone: verl seeds the RNG"))
    return f"--new-rank-state {policy}: {meaning}; kept for the ranks at both sizes, dropped for those gone", \
        tuple(out)


def output_tag(catalog: Catalog, tag: str) -> str:
    return tag


def describe(target: Layout, tag: str) -> Output:
    """verl's FSDP checkpoint: one model, optimizer and extra-state file per rank; no tag."""
    return Output("verl", f"dp={target.dp}")


def batch_size_advice(catalog: Catalog, target: Layout) -> str | None:
    if catalog.layout.dp == target.dp:
        return None
    return (f"verl's batch sizes (data.train_batch_size, ppo_mini_batch_size) are global: they stay, each rank's "
            f"share follows the world size ({catalog.layout.dp} -> {target.dp}) and must divide them")
