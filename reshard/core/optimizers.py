"""Which torch.optim optimizer a state dict belongs to, from its state and hyper-parameter names.

torch.optim saves no class name. Adam and AdamW (one class since torch 2.6, told apart by
`decoupled_weight_decay`) save `amsgrad` and `decoupled_weight_decay` in every group; RAdam and
NAdam keep the same state names without them; SGD saves `momentum`, `dampening` and `nesterov`.
Anything else, or a group that does not say, is unknown (""), never a guess.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_ADAM_STATES = {"exp_avg", "exp_avg_sq"}
_ADAM_KEYS = {"betas", "amsgrad", "decoupled_weight_decay"}
_SGD_KEYS = {"momentum", "dampening", "nesterov"}


def kind(states: Iterable[str], groups: Sequence[Mapping[str, Any]]) -> str:
    """'Adam', 'AdamW', 'SGD' or '' for per-element state names `states` and param groups `groups`."""
    if not groups:
        return ""
    names = set(states)
    if all(_ADAM_KEYS <= set(g) for g in groups) and _ADAM_STATES <= names <= _ADAM_STATES | {"max_exp_avg_sq"}:
        decoupled = {bool(g["decoupled_weight_decay"]) for g in groups}
        return "" if len(decoupled) > 1 else ("AdamW" if decoupled.pop() else "Adam")
    if all(_SGD_KEYS <= set(g) for g in groups) and names <= {"momentum_buffer"}:
        return "SGD"
    return ""
