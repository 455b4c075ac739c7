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
"""
from __future__ import annotations

from dataclasses import dataclass

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
