"""The parameter order and tied weights of a Hugging Face model, from its config.json.

safetensors files list tensors sorted by dtype and name, and save_pretrained leaves tied weights
(lm_head.weight) out, so neither the model's state-dict order (which torch.optim's indices follow)
nor the ties can be read from the weights. The model class can tell: we build the architecture
config.json names, from the installed transformers, on the meta device (no memory, no weights, no
code from the checkpoint: a config with `auto_map`, i.e. remote code, is not followed) and read its
state_dict keys in order and which keys share a parameter.
"""
from __future__ import annotations

import json
import os

from reshard.storage import files as fs

CONFIG = "config.json"


def model_order(folder: str):
    """(keys in state-dict order, {alias: holder}, buffer keys) or None when the architecture cannot be built."""
    path = os.path.join(folder, CONFIG)
    if not fs.isfile(path):
        return None
    try:
        with fs.open(path) as f:
            config = json.load(f)
        architecture = (config.get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(architecture, str) or config.get("auto_map"):
        return None
    try:
        import torch
        import transformers
        cls = getattr(transformers, architecture, None)
        if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
            return None
        if cls.config_class is None:      # a base class: no config of its own
            return None
        with torch.device("meta"):
            model = cls(cls.config_class.from_dict(config))
        state = model.state_dict(keep_vars=True)
        buffers = {id(b) for b in model.buffers()}
    except Exception:   # no transformers, an unknown or newer architecture: the order stays unknown
        return None
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, value in state.items():
        holder = first.setdefault(id(value), key)
        if holder != key:
            aliases[key] = holder
    return list(state), aliases, {k for k, v in state.items() if id(v) in buffers}


def ordered(tensors: dict, folder: str) -> tuple:
    """(tensors in the model's order, aliases, full key order, buffer keys) for safetensors tensors; the
    order is None when it cannot be known (the tensors then stay in file order)."""
    found = model_order(folder)
    if found is None or not set(tensors) <= set(found[0]):
        return tensors, {}, None, None
    order, aliases, buffers = found
    out = {k: tensors[k] for k in order if k in tensors}
    ties = {}
    for alias, holder in aliases.items():
        if alias in out and holder in out:
            continue                 # both saved as separate tensors: nothing tied on disk
        kept, other = (holder, alias) if holder in out else (alias, holder)
        if kept in out:
            ties[other] = kept
    return out, ties, [k for k in order if k in out or k in ties], buffers
