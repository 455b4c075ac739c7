"""A Hugging Face Llama folder of the 70B shape as sparse files: config.json, model.safetensors.index.json and
save_pretrained's 5 GB shards, each a real safetensors header (names, dtypes, shapes, offsets, in transformers'
state-dict order) followed by a hole as long as its tensors' bytes: ~141 GB apparent, a few MB on disk. What
`reshard plan`/`convert --format megatron --names megatron-core-llama` read of a model is its headers and config
alone, so planning the import at tp=8·pp=4 is measured here at the real size without the bytes (bench.py make-hf
--sparse; docs/performance.md).
"""
from __future__ import annotations

import json
import os
import struct

# Llama 3 70B (its config.json's values)
SHAPE = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
             num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5)
SHARD_BYTES = 5 * 10**9     # save_pretrained's max_shard_size default


def tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) in LlamaForCausalLM's state-dict order."""
    h, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        at = f"model.layers.{i}."
        out += [(at + "self_attn.q_proj.weight", (h, h)), (at + "self_attn.k_proj.weight", (kv, h)),
                (at + "self_attn.v_proj.weight", (kv, h)), (at + "self_attn.o_proj.weight", (h, h)),
                (at + "mlp.gate_proj.weight", (f, h)), (at + "mlp.up_proj.weight", (f, h)),
                (at + "mlp.down_proj.weight", (h, f)), (at + "input_layernorm.weight", (h,)),
                (at + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def make(folder: str, layers: int = SHAPE["num_hidden_layers"]) -> int:
    """Write the folder; the apparent bytes."""
    os.makedirs(folder, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors(layers):
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for index, held in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in held:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + 2 * _numel(shape)]}
            at += 2 * _numel(shape)
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(folder, file), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + at)      # the tensors' bytes: a hole
        total += at
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE, "num_hidden_layers": layers,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
              "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "dtype": "bfloat16"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
