"""The training framework around a DeepSpeed save (HF Trainer's checkpoint-N/, Accelerate's save_state dir):
its files, what becomes of each at another world size, and the per-process policy.

Frameworks that drive DeepSpeed write files of their own beside its save dir: their training state, the LR
scheduler, per-process RNG states, the model's config. A Framework lists them (FrameworkFile) and says what
becomes of each at another world size (Disposition): carried byte for byte, rewritten (only renamed: a
per-process file whose name depends on the world size, such as HF's rng_state.pth at one process and
rng_state_K.pth above), or dropped (the process no longer exists). None of these files is ever unpickled:
what reshard writes is the source's bytes, under the name the framework reads at the target size.

New processes have no state of their own; `--new-rank-state` says what they get (NEW_RANK_POLICIES).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from reshard.core.problems import READER, Problem
from reshard.core.write_requests import CopiedFile
from reshard.errors import ReshardError
from reshard.formats import weights_only
from reshard.formats.deepspeed import topology
from reshard.formats.framework import fsdp
from reshard.storage import files as fs
from reshard.storage.names import MANIFEST

FRESH, COPY_RANK0, FAIL = "fresh", "copy-rank0", "fail"
NEW_RANK_POLICIES = (FRESH, COPY_RANK0, FAIL)
CARRIED, REWRITTEN, DROPPED, NONE, COPIED = "carried", "rewritten", "dropped", "none", "copied from rank 0"
FRESH_STATE = "written fresh"   # a new process's file written by the output's writer, not copied (verl's scheduler)
UNKNOWN = "a file reshard does not know"
# One line, printed by plan: what no conversion can promise.
REPRODUCIBILITY = ("exact reproducibility across world sizes is impossible: each process's random stream and "
                   "share of the data change with the number of processes")


@dataclass(frozen=True)
class PerRank:
    """A kind of file each process writes: `many` names process K's ("rng_state_{rank}.pth"); `one`, when set,
    is the name the framework writes and reads at a world size of one ("rng_state.pth")."""
    what: str
    many: str
    one: str | None = None
    fresh: str = "the process starts from its seed"     # what a process without its file does

    def name(self, rank: int, world: int) -> str:
        return self.one if world == 1 and self.one else self.many.format(rank=rank)

    def rank_of(self, name: str) -> int | None:
        """The process a file of this kind belongs to (0 for the one-process name); None: not this kind."""
        if name == self.one:
            return 0
        head, _, tail = self.many.partition("{rank}")
        m = re.fullmatch(re.escape(head) + r"(\d+)" + re.escape(tail), name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FrameworkFile:
    name: str                    # relative to the framework's folder
    what: str                    # what it holds, for people
    size: int
    rank: int | None = None      # the process whose file it is; None: one file for the whole run
    kind: PerRank | None = None  # for a per-process file, its kind
    folder: bool = False         # a folder the framework's files do not explain: not carried

    def to_dict(self) -> dict:
        return {"path": self.name, "what": self.what, "rank": self.rank, "bytes": self.size}


@dataclass(frozen=True)
class Disposition:
    """What becomes of one framework file (or of one new process's missing file) at the target world size."""
    action: str              # CARRIED, REWRITTEN (renamed), DROPPED, NONE (a new process gets none), COPIED,
    #                          FRESH_STATE
    source: str | None       # the source file (None: a new process, nothing in the source)
    target: str | None       # its name in the output (None: not written)
    why: str

    def line(self) -> str:
        where: str | None
        if self.action == REWRITTEN:
            where = f"{self.source} -> {self.target}"
        elif self.action in (NONE, COPIED, FRESH_STATE):
            where = self.target
        else:
            where = self.source
        return f"{where:<28} {self.action}: {self.why}"

    def to_dict(self) -> dict:
        return {"action": self.action, "source": self.source, "target": self.target, "why": self.why}


@dataclass(frozen=True)
class Framework:
    """A framework's folder, which is also DeepSpeed's save dir: its own files, and the world size that saved them."""
    name: str                    # "HF Trainer"
    folder: str                  # absolute
    files: tuple                 # FrameworkFile, by name
    kinds: tuple                 # PerRank: the per-process kinds this framework writes
    model_files: tuple = ()      # paths an export copies beside the weights (config, tokenizer): catalog.model_files
    world: int = 1               # processes that saved it: the checkpoint's world size, once read
    batch_note: str = ""         # where the framework sets the batch size, for plan's advice
    backend: str = ""            # what saved the model and optimizer beside its files, when not DeepSpeed
    deepspeed_tag: str = ""      # the tag it gives DeepSpeed's save (Accelerate: pytorch_model); "": global_stepN
    # the framework's own non-tensor state where its backend keeps it (Lightning's checkpoint dict less model and
    # optimizer: DeepSpeed's client state, FSDPStrategy's meta.pt), for a writer of the other backend to carry
    state: dict | None = None

    def title(self, layout) -> str:
        """e.g. "HF Trainer + DeepSpeed ZeRO-2, dp=2" (tp and pp named when not 1), "HF Trainer + FSDP (sharded
        state dict), dp=2"."""
        degrees = ", ".join(f"{k}={v}" for k, v in layout.degrees.items() if k == "dp" or v != 1)
        backend = self.backend or f"DeepSpeed ZeRO-{topology.of(layout).zero}"
        return f"{self.name} + {backend}, {degrees}"

    def missing(self) -> list[Problem]:
        """Per-process files missing for a process that saved, each a problem of that file. In a folder reshard
        wrote (its manifest is there) an absent one is what --new-rank-state decided, and a file the manifest
        lists but the folder lacks is the manifest check's to report."""
        if fs.isfile(os.path.join(self.folder, MANIFEST)):
            return []
        out = []
        for kind in self.kinds:
            have = {f.rank for f in self.files if f.kind == kind}
            if not have:
                continue        # the run wrote none of this kind (HF: save_only_model)
            for rank in range(self.world):
                if rank not in have:
                    name = kind.name(rank, self.world)
                    out.append(Problem(os.path.join(self.folder, name), None, READER,
                                       f"missing ({kind.what} of process {rank} of a {self.world}-process run)"))
        return out

    def dispositions(self, world: int, policy: str = FRESH) -> tuple[Disposition, ...]:
        """What becomes of every file at `world` processes; raises for policy FAIL when a process would have none."""
        if policy not in NEW_RANK_POLICIES:
            raise ReshardError(f"unknown --new-rank-state {policy!r} ({', '.join(NEW_RANK_POLICIES)})")
        out = []
        for f in self.files:
            if f.folder:
                out.append(Disposition(DROPPED, f.name, None, "a folder reshard does not know: not carried"))
            elif f.kind is None:
                out.append(Disposition(CARRIED, f.name, f.name, f"{f.what}; copied byte for byte"))
            elif f.rank >= world:
                out.append(Disposition(DROPPED, f.name, None, f"process {f.rank} does not exist at {world}"))
            else:
                name = f.kind.name(f.rank, world)
                action = CARRIED if name == f.name else REWRITTEN
                why = f"{f.what} of process {f.rank}; copied byte for byte" + (
                    "" if name == f.name else f" (the name {self.name} reads at {world} process{'es' * (world > 1)})")
                out.append(Disposition(action, f.name, name, why))
        for kind in self.kinds:
            rank0 = next((f for f in self.files if f.kind == kind and f.rank == 0), None)
            if rank0 is None:
                continue
            for rank in range(self.world, world):
                name = kind.name(rank, world)
                if policy == FAIL:
                    raise ReshardError.at(os.path.join(self.folder, kind.name(0, self.world)),
                                          f"process {rank} of {world} would have no {kind.what} ({name}): the source "
                                          f"saved {self.world}; --new-rank-state fresh (the framework seeds it) or "
                                          "copy-rank0 (a copy of process 0's)")
                if policy == COPY_RANK0:
                    out.append(Disposition(COPIED, rank0.name, name, f"{kind.what}: process 0's stream, repeated"))
                else:
                    out.append(Disposition(NONE, None, name, f"a new process, no file: {kind.fresh}"))
        return tuple(out)

    def target_files(self, world: int, policy: str = FRESH) -> list[CopiedFile]:
        """CopiedFiles of every framework file the output holds at `world` processes."""
        sizes = {f.name: f.size for f in self.files}
        return [CopiedFile(d.target, os.path.join(self.folder, d.source), sizes[d.source])
                for d in self.dispositions(world, policy) if d.source is not None and d.target is not None]

    def batch_advice(self, advice: str | None) -> str | None:
        """The DeepSpeed writer's batch-size advice, saying where this framework sets it."""
        return f"{advice}; {self.batch_note}" if advice and self.batch_note else advice

    def policy_line(self, policy: str) -> str:
        """What processes the source did not have get, under `policy`."""
        kinds = "; ".join(k.what for k in self.kinds) or "per-process state"
        meaning = {FRESH: f"new processes get no file of their own ({kinds}): {self.name} seeds them afresh",
                   COPY_RANK0: f"new processes get a copy of process 0's ({kinds}: its random stream, repeated)",
                   FAIL: "a process the source did not have is refused"}[policy]
        return f"--new-rank-state {policy}: {meaning}; kept for the processes at both sizes, dropped for those gone"

    def to_dict(self, layout) -> dict:
        return {"name": self.name, "title": self.title(layout), "folder": self.folder, "world_size": self.world,
                "backend": self.backend or "DeepSpeed", "files": [f.to_dict() for f in self.files]}


def framework_files(folder: str, kinds: tuple, what) -> tuple:
    """The FrameworkFiles of every entry of `folder` that is not DeepSpeed's: per-process files of `kinds`,
    others described by `what(name)`, folders (not carried) as such."""
    out = []
    for name in sorted(fs.listdir(folder)):
        path = os.path.join(folder, name)
        if deepspeed_own(folder, name):
            continue
        kind = next((k for k in kinds if k.rank_of(name) is not None), None)
        if fs.isdir(path):
            out.append(FrameworkFile(name, "a folder", 0, folder=True))
        elif kind is not None:
            out.append(FrameworkFile(name, kind.what, fs.getsize(path), kind.rank_of(name), kind))
        else:
            out.append(FrameworkFile(name, what(name), fs.getsize(path)))
    return tuple(out)


def deepspeed_own(folder: str, name: str) -> bool:
    """`latest`, DeepSpeed's scripts and its tag folders (any folder of rank files) are DeepSpeed's part; FSDP's
    model and optimizer folders are FSDP's (framework/fsdp.py): the checkpoint's, not the framework's files."""
    from reshard.formats.deepspeed import files as deepspeed_files
    from reshard.formats.deepspeed.zero_target import SCRIPTS
    path = os.path.join(folder, name)
    # reshard's manifest of a folder it wrote, and its record of a thinning, describe that folder: every output
    # gets its own
    return name == deepspeed_files.LATEST or name in SCRIPTS or name in (MANIFEST, weights_only.PROVENANCE) or \
        (fs.isdir(path) and (fsdp.own(name) or deepspeed_files.is_deepspeed_dir(path)))
