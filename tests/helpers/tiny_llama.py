"""The tiny random Llama tests/scripts/engine_llama.py trains with the DeepSpeed engine, and the fixed input on which
the engine's logits and those of `from_pretrained` of an export are compared."""
from __future__ import annotations

TOKENS = 64


def config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=TOKENS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=True)


def probe():
    import torch
    return torch.arange(2 * 12).reshape(2, 12) % TOKENS
