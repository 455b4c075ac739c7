"""torchtitan's checkpoint folder (`<dump_folder>/checkpoint/step-N/`): one DCP folder that its CheckpointManager
(torchtitan/components/checkpointer/dcp.py) saves from a flat state dict.

Observed with torchtitan 0.3.0 (torch 2.13): the model's state dict is flattened into the top level (keys are the
bare FQNs, planner path (fqn,)); the OptimizersContainer saves one flat FQN-keyed dict under "optimizer"
(`optimizer.state.<fqn>.<state>`, `optimizer.param_groups.<fqn>.<hyper>`, torchtitan's get_flat_optim_state_dict);
beside them its own entries, plain values: `lr_scheduler.last_epoch` (LRSchedulersContainer), `train_state.step` and
`train_state.ntokens_seen` (the Trainer), `dataloader.dp_rank_<K>` (each data-parallel rank's pickled
StatefulDataLoader state, bytes) and `dataloader.world_size`. Those are carried byte for byte, never unpickled into
anything but plain values: torchtitan loads its dataloader's state only at the data-parallel size that saved it
(ParallelAwareDataloader.load_state_dict asserts it), so a resume at another size sets
`checkpoint.exclude_from_loading = ["dataloader"]`.

Fused q/k/v (FusedQKVLinear, every llama3 flavor's default in 0.3.0): the module holds one `wqkv` parameter whose
rows are, per key-value head g, that group's heads_per_kv·head_dim q rows, then head_dim k rows, then head_dim v rows
(its forward views them as (n_kv_heads, heads_per_kv + 2, head_dim)); a state-dict post-hook
(`FusedQKVLinear._split_qkv_on_save`) saves the model's as `wq`/`wk`/`wv`, but the optimizer's state is keyed by the
parameter: `wqkv`'s, interleaved. The save does not record n_kv_heads, and wq's and wk's row counts give only
n_heads/n_kv_heads: head_dim is wk's rows over the kv head count the model's config.json gives (`fused_parts`). Each
of wq, wk, wv is then a set of row boxes of wqkv's stored chunks (placement.through), no byte moved.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.core.placement import Block
from reshard.errors import UsageError
from reshard.formats.hf import sharding as hf

OWN = ("lr_scheduler", "dataloader", "train_state")     # CheckpointManager's top-level entries beside model, optimizer
OPTIMIZER = "optimizer"
NAME, BACKEND = "torchtitan", "FSDP2 (DCP)"
STEP = "train_state.step"
WHAT = {"lr_scheduler": "the LR schedulers' last_epoch", "dataloader": "the data loaders' positions, per dp rank",
        "train_state": "the Trainer's step and tokens seen"}


@dataclass(frozen=True)
class OwnEntry:
    """One of torchtitan's own entries: its DCP key and planner path, the item's bytes as saved (a torch.save
    archive: what a writer copies) and its plain value (what inspect shows and diff compares)."""
    key: str
    path: tuple
    blob: bytes
    value: object

    def to_dict(self) -> dict:
        shown = f"{len(self.value)} bytes" if isinstance(self.value, bytes) else self.value
        return {"key": self.key, "what": WHAT[self.key.partition(".")[0]], "value": shown}


def owns(key: str) -> bool:
    return key.partition(".")[0] in OWN


def is_torchtitan(keys) -> bool:
    """Keys of a torchtitan save: its train state and its flat optimizer, and no "model." prefix."""
    keys = list(keys)
    return (STEP in keys and any(k.startswith(f"{OPTIMIZER}.state.") for k in keys)
            and not any(k.startswith("model.") for k in keys))


FUSED = re.compile(r"(?P<module>.*\.)wqkv\.(?P<param>weight|bias)")   # FusedQKVLinear's parameter
PARTS = ("wq", "wk", "wv")                  # the names its save hook gives the model's, in the fused rows' order


@dataclass(frozen=True)
class Part:
    """One of the model's parameters inside a fused one: its name, shape, and its row boxes in the fused tensor
    (each Block: `at` in the part, `local` in the fused tensor)."""
    name: str
    shape: tuple
    view: tuple[Block, ...]


def part_names(name: str) -> tuple[str, ...]:
    """The model's wq, wk, wv names of a fused `wqkv` parameter's name; () for any other name."""
    m = FUSED.fullmatch(name)
    return tuple(f"{m['module']}{p}.{m['param']}" for p in PARTS) if m else ()


def heads_of(config: str) -> tuple[int, int | None]:
    """(key-value head count, head_dim or None) of a Hugging Face model config: its `num_key_value_heads`, else
    `num_attention_heads` (as transformers' Llama defaults it), and its `head_dim` where it gives one; a one-line error
    naming the file otherwise."""
    values = hf.model_config(config)
    heads = _count(values.get("num_key_value_heads") or values.get("num_attention_heads"))
    if heads is None:
        raise UsageError.at(config, "gives no key-value head count (num_key_value_heads or num_attention_heads)")
    return heads, _count(values.get("head_dim"))


def _count(value) -> int | None:
    """`value` where it is a count (a whole number >= 1), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def fused_parts(fused: tuple, shapes: dict, heads: tuple[int, int | None]) -> tuple[Part, ...] | str:
    """wq, wk, wv (their `shapes` as the model saved them) inside the fused parameter of shape `fused`, `heads` the
    config's (key-value head count, head_dim or None); a reason where these shapes cannot be that layout."""
    n_kv, given_head_dim = heads
    (rows_q, *tail), (rows_k, *_), (rows_v, *_) = (tuple(s) for s in shapes.values())
    if rows_k != rows_v or fused[0] != rows_q + 2 * rows_k or \
            any(tuple(s[1:]) != tuple(fused[1:]) for s in shapes.values()):
        return f"{list(fused)} is not q{list(shapes.values())[0]}, k and v{list(shapes.values())[1]} fused by rows"
    if rows_k % n_kv or rows_q % rows_k:
        return (f"{n_kv} key-value heads do not cut k's {rows_k} rows and q's {rows_q} into whole heads of one size")
    head_dim, per_kv = rows_k // n_kv, rows_q // rows_k
    if given_head_dim is not None and given_head_dim != head_dim:
        return f"{n_kv} key-value heads make k's {rows_k} rows heads of {head_dim}, not the config's head_dim " \
               f"{given_head_dim}"
    group, zeros = (per_kv + 2) * head_dim, (0,) * len(tail)
    offsets = (0, per_kv * head_dim, (per_kv + 1) * head_dim)          # q, k, v rows within a group
    sizes = (per_kv * head_dim, head_dim, head_dim)
    return tuple(Part(name, shape, tuple(Block((g * size, *zeros), (g * group + at, *zeros), (size, *tail))
                                         for g in range(n_kv)))
                 for (name, shape), at, size in zip(shapes.items(), offsets, sizes, strict=True))
