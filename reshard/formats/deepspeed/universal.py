"""DeepSpeed's universal checkpoint: its file names and the facts both our reader and writer rely on.

    <save dir>/latest_universal                       the tag (the engine reads it when "load_universal" is on)
    <save dir>/<tag>/mp_rank_00_model_states.pt        ZeRO-1/2 flavour: training state, 16-bit module
    <save dir>/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   ZeRO-3 flavour (the engine reads rank 0's)
    <save dir>/<tag>/zero/optimizer_state.pt           loss scaler, param-group hyper-parameters (and the step, ZeRO-3)
    <save dir>/<tag>/zero/<param>/<state>.pt           one full fp32 tensor per param and optimizer state

The two flavours differ because DeepSpeed 0.19.8's loaders do (checkpoint/universal_checkpoint.py,
runtime/zero/stage3.py): ZeRO-1/2 and BF16_Optimizer load every `<state>.pt` of a param folder as
`{'cat_dim': 0, 'param': <full shape>}` plus a per-param `step.pt`; ZeRO-3 loads only fp32, exp_avg
and exp_avg_sq, as bare flat tensors (a dict with 'param' works too), and the step from
optimizer_state.pt. Neither loader reads the other's model-states file names. No `latest` is
written: with load_universal on, the engine reads only `latest_universal` (engine.py:4428).
"""
from __future__ import annotations

import os

from reshard.storage import files as fs

LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
STEP = "step"
PARAM = "param"          # the key of the tensor in a ZeRO-1/2 flavour state file
VOCAB_TENSOR = "vocab_tensor"   # a vocabulary param, its padding stripped (ds_to_universal)
CAT_DIM = "cat_dim"      # how tensor-parallel slices were joined; 0 when there was no TP
IS_EXPERT_PARAM = "is_expert_param"   # a mixture-of-experts param: 'param' holds every expert, (num_experts, ...)
EP_NUM_EXPERTS = "ep_num_experts"     # ... and this many (the loader takes each ep rank's experts from dim 0)
ZERO3_LOADED_STATES = ("exp_avg", "exp_avg_sq")   # stage3.py:3665 hard-codes these (and fp32)
# Keys of a state-file dict that only tensor-parallel or expert-parallel conversions write.
PARALLEL_KEYS = ("vocab_tensor", "sub_param_shape", "params_to_average", "param_n_sub_params",
                 IS_EXPERT_PARAM, EP_NUM_EXPERTS)


def state_file(tag: str, param: str, state: str) -> str:
    return f"{tag}/{ZERO_DIR}/{param}/{state}.pt"


def optimizer_state_file(tag: str) -> str:
    return f"{tag}/{ZERO_DIR}/{OPTIMIZER_STATE}"


def is_universal_tag_dir(path: str) -> bool:
    return fs.isdir(os.path.join(path, ZERO_DIR))
