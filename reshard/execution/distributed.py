"""Who writes what when several processes execute one plan (torchrun, or --workers).

A Group gives this process's rank, the world size, and two collectives: broadcast a small object
from rank 0, and agree that every rank succeeded. `Solo` is the single-process case; `TorchGroup`
uses torch.distributed (gloo), as set up by torchrun's environment variables.
"""
from __future__ import annotations

import os
from typing import Any


class Solo:
    rank, world = 0, 1

    def broadcast(self, obj):
        return obj

    def all_ok(self, ok: bool) -> bool:
        return ok

    def gather_dicts(self, mine: dict) -> dict:
        return dict(mine)

    def close(self):
        pass


class TorchGroup:
    """torch.distributed over gloo, initialised from torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""

    def __init__(self):
        import torch.distributed as dist
        self._dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def broadcast(self, obj):
        box = [obj]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_ok(self, ok: bool) -> bool:
        import torch
        flag = torch.tensor([0 if ok else 1])
        self._dist.all_reduce(flag)
        return int(flag) == 0

    def gather_dicts(self, mine: dict) -> dict:
        """Every rank's dict merged (on every rank)."""
        parts: list[Any] = [None] * self.world      # all_gather_object puts each rank's dict in its place
        self._dist.all_gather_object(parts, mine)
        return {k: v for part in parts for k, v in part.items()}

    def close(self):
        # Leaving gloo's threads running at exit can abort the process ("terminate called ...").
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def placement(files: list, world: int) -> list:
    """(file, rank) for every file (with `nbytes`): largest first, each to the least loaded rank (the same answer
    on every rank; what a pool of `world` processes taking the largest file left does where bytes take time)."""
    loads = [0] * world
    placed = []
    for _index, f in sorted(enumerate(files), key=lambda item: (-item[1].nbytes, item[0])):
        owner = min(range(world), key=lambda r: (loads[r], r))
        loads[owner] += f.nbytes
        placed.append((f, owner))
    return placed


def share(files: list, rank: int, world: int) -> list:
    """This rank's files (placement), largest first."""
    return [f for f, owner in placement(files, world) if owner == rank]


def loads(files: list, world: int) -> tuple[int, ...]:
    """The bytes each of `world` ranks (or worker processes) writes, as placement gives them the files."""
    out = [0] * world
    for f, owner in placement(files, world):
        out[owner] += f.nbytes
    return tuple(out)
