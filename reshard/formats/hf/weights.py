"""The model weights of a Hugging Face folder (save_pretrained, Trainer checkpoint-N/).

Tried in order: model.safetensors.index.json (shards), model.safetensors, pytorch_model.bin.index.json,
pytorch_model.bin, and last pytorch_model_fsdp.bin (Accelerate's FSDP FULL_STATE_DICT save, the gathered module state
dict by torch.save; the HF Trainer's folder has model.safetensors beside it, Accelerate's save_state only it).
safetensors lose the model's key order and the tied keys; hf_model recovers them from config.json. pytorch_model.bin
keeps both (torch.save keeps the order and the shared storage).
"""
from __future__ import annotations

import json
import os

from reshard.errors import CheckpointError
from reshard.formats import torchsave_read
from reshard.formats.hf import files as hf_files, model as hf_model
from reshard.formats.single import safetensors_header
from reshard.formats.single.torchsave_checkpoint import is_state_dict
from reshard.storage import files as fs

SAFE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
FSDP_BIN = hf_files.FSDP_FULL_MODEL
NAMES = (SAFE_INDEX, SAFE, BIN_INDEX, BIN, FSDP_BIN)


def present(folder: str) -> str | None:
    return next((n for n in NAMES if fs.isfile(os.path.join(folder, n))), None)


class Weights:
    """tensors {key: TensorRef} (model order when `order` is known), aliases, order, files [(path, role)],
    buffers (keys the model class says are buffers, when it is known)."""

    def __init__(self, tensors, aliases, order, files, buffers=None):
        self.tensors, self.aliases, self.order, self.files = tensors, aliases, order, files
        self.buffers = buffers


def read(folder: str, model_order: bool = True) -> Weights:
    """The weights of the Hugging Face folder `folder`; without `model_order` safetensors stay in file order, their
    ties unknown (hf_model not asked)."""
    name = present(folder)
    if name is None:
        raise CheckpointError(folder, f"no model weights ({', '.join(NAMES)})")
    path = os.path.join(folder, name)
    if name in (SAFE, SAFE_INDEX):
        if name == SAFE_INDEX:
            tensors = safetensors_header.read_sharded(path)
            files = [(path, "index")] + [(p, "weights") for p in dict.fromkeys(
                safetensors_header.read_index(path).values())]
        else:
            tensors, metadata = safetensors_header.read_header(path)
            files = [(path, "weights")]
            tied = tied_metadata(path, metadata)
            if tied:     # written by reshard export: the ties are in the metadata
                return Weights(tensors, tied, list(tensors) + list(tied), files)
        if not model_order:
            return Weights(tensors, {}, None, files)
        tensors, aliases, order, buffers = hf_model.ordered(tensors, folder)
        return Weights(tensors, aliases, order, files, buffers)
    if name == BIN_INDEX:
        shards = safetensors_header.read_index(path)
        loaded, tensors = {}, {}
        for key, shard in shards.items():
            if shard not in loaded:
                loaded[shard] = _state_dict(shard)
            if key not in loaded[shard]:
                raise CheckpointError(shard, f"tensor {key!r} named by {BIN_INDEX} is not in this shard")
            tensors[key] = loaded[shard][key]
        files = [(path, "index")] + [(p, "weights") for p in loaded]
        tensors, aliases, order, buffers = hf_model.ordered(tensors, folder)    # the index is sorted by name
        return Weights(tensors, aliases, order, files, buffers)
    state = _state_dict(path)
    return Weights(state, {}, list(state), [(path, "weights")])


def _state_dict(path) -> dict:
    obj = torchsave_read.load(path)
    if not is_state_dict(obj):
        raise CheckpointError(path, "not a state dict of tensors")
    return obj


def tied_metadata(path, metadata) -> dict:
    text = metadata.get("tied")
    if not text:
        return {}
    try:
        tied = json.loads(text)
        if isinstance(tied, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
            return tied
    except ValueError:
        pass
    raise CheckpointError(path, "metadata 'tied' is not a JSON object of names")
