"""DeepSpeed's checkpoint directory: the tag folder and the names of its rank files."""
from __future__ import annotations

import os
import re

from reshard import paths
from reshard.errors import CheckpointError, ReshardError, UsageError
from reshard.storage import files as fs

LATEST = "latest"
UNNAMED_TAG = "converted"      # the tag of a save whose source knows no step

MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")                      # ZeRO 0/1/2
ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
LAYER_STATES = re.compile(r"^layer_\d+(-model_\d+)?-model_states\.pt$")              # PipelineModule
EXPERT_MODEL_STATES = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")      # MoE experts
EXPERT_OPTIM_STATES = re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")     # MoE without ZeRO


def model_states_name(mp: int, dp: int | None = None) -> str:
    """ZeRO 0/1/2 write one file per model-parallel rank; ZeRO-3 one per data-parallel rank."""
    if dp is None:
        return f"mp_rank_{mp:02d}_model_states.pt"
    return f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"


def layer_states_name(layer: int, tp_rank: int | None = None) -> str:
    """PipelineModule.ckpt_layer_path: `-model_TT` names the tensor-parallel rank when there is a model axis."""
    model = "" if tp_rank is None else f"-model_{tp_rank:02d}"
    return f"layer_{layer:02d}{model}-model_states.pt"


def expert_states_name(layer: int, expert: int, mp: int = 0) -> str:
    """The module weights of global expert `expert` of MoE layer `layer` (engine._get_expert_ckpt_name)."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp:02d}_model_states.pt"


def optim_states_name(dp: int, mp: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def is_deepspeed_dir(path: str) -> bool:
    if fs.isfile(os.path.join(path, LATEST)):
        return True
    try:
        names = fs.listdir(path)
    except OSError:
        return False
    return any(MODEL_STATES.match(n) or ZERO3_MODEL_STATES.match(n) for n in names)


def tag_folder(save_dir: str, tag: str, pointer: str | None = None) -> str:
    """The folder of `tag` in `save_dir`; a tag is one of its folders, so a name leading out of it is refused:
    the checkpoint's fault (exit 1) when the file `pointer` (`latest`) names it, a usage error when --tag does."""
    why = paths.escape(tag, save_dir, single=True)
    if why and pointer:
        raise CheckpointError(pointer, f"names the tag {tag!r}: {why}; name the tag with --tag")
    if why:
        raise UsageError.at(save_dir, f"--tag {tag!r}: {why}")
    return os.path.join(save_dir, tag)


def resolve_tag_dir(path: str, tag: str | None = None) -> tuple[str, str]:
    """(tag directory, tag) for a save dir with `latest`, a save dir plus --tag, or a tag dir."""
    path = fs.abspath(path)
    if not fs.isdir(path):
        raise ReshardError.at(path, "no such directory")
    latest = os.path.join(path, LATEST)
    pointer = None
    if tag is None and fs.isfile(latest):
        with fs.open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise ReshardError.at(latest, "file is empty; name the tag with --tag")
        pointer = latest
    if tag is not None:
        tag_dir = tag_folder(path, tag, pointer)
        if not fs.isdir(tag_dir):
            raise ReshardError.at(tag_dir, "tag folder does not exist")
        return tag_dir, tag
    if is_deepspeed_dir(path):
        return path, os.path.basename(path)
    raise ReshardError.at(path, f"not a DeepSpeed checkpoint (no '{LATEST}' file and no *_model_states.pt)")


def step_tag(step: int | None) -> str:
    """The tag folder DeepSpeed's own save gives step `step` (engine.save_checkpoint: `global_step{N}`)."""
    return UNNAMED_TAG if step is None else f"global_step{step}"
