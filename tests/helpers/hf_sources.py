"""Hugging Face folders made here by transformers (no download): for the Megatron import tests a Llama of each
precision and a Mixtral with random weights, the import as `reshard convert` makes it, and how far Megatron's logits
of the fixed tokens lie from transformers'; and the config.json of the torchtitan fixture's model."""
from __future__ import annotations

import json

import reshard
from reshard.commands.convert import make_plan
from reshard.execution.executor import execute
from tests.helpers.fixtures import FIXTURES

LLAMA_NAMES = "megatron-core-llama"
SEQ = 8             # tests/scripts/megatron_import.py trains with tools/fixture_megatron_core.py's sequence length
LLAMA_SHAPE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, initializer_range=0.2)
# each precision and the tied, padded vocabulary
LLAMA_SOURCES = {"fp32": dict(vocab_size=64, dtype="float32", rope_theta=10000.0),
                 "bf16-sharded": dict(vocab_size=64, dtype="bfloat16", rope_theta=500000.0, shard="20KB"),
                 "fp32-tied-63": dict(vocab_size=63, dtype="float32", rope_theta=10000.0, tie_word_embeddings=True)}
MIXTRAL_SHAPE = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, vocab_size=64,
                     num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02, initializer_range=0.2,
                     tie_word_embeddings=False)
FP32_BOUND = 1e-5
TOKENS = [[1, 5, 9, 3, 60, 2, 7, 8], [4, 4, 33, 12, 0, 62, 2, 1]]


def make_llama(folder, name: str) -> None:
    """A LlamaForCausalLM of LLAMA_SOURCES[name] with random weights, saved by save_pretrained."""
    import torch
    import transformers
    given = dict(LLAMA_SOURCES[name])
    dtype, shard = given.pop("dtype"), given.pop("shard", None)
    rope = given.pop("rope_theta")
    config = transformers.LlamaConfig(**LLAMA_SHAPE, **given,
                                      rope_parameters={"rope_theta": rope, "rope_type": "default"})
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(folder), **({"max_shard_size": shard} if shard else {}))


def make_mixtral(folder) -> None:
    """A MixtralForCausalLM of MIXTRAL_SHAPE with random fp32 weights, saved by save_pretrained."""
    import torch
    import transformers
    torch.manual_seed(7)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL_SHAPE))
    model.save_pretrained(str(folder))


def megatron_import(source, dst, to: str, names: str = LLAMA_NAMES, model_order: bool = False) -> None:
    """The import as `reshard convert` makes it: the source read without the model class's param order (the rule
    file names every param), unless `model_order`."""
    plan = make_plan(reshard.open_checkpoint(str(source), model_order=model_order), to, fmt="megatron", names=names)
    execute(plan, str(dst), progress=False)


def logits_delta(result: dict, want) -> float:
    """The max |difference| of a loaded job's logits (Megatron's) from `want` (transformers'); the job must have
    loaded (the shapes fit, whatever the values)."""
    from safetensors.torch import load_file
    assert result["loaded"] and result["error"] is None, result
    got = load_file(result["logits_file"])["logits"]
    assert got.shape == want.shape
    return float((got - want).abs().max())


def torchtitan_hf_config(folder) -> str:
    """The Hugging Face config.json of the torchtitan fixture's model (what a torchtitan run's hf_assets_path
    holds), written into `folder`; its path."""
    from transformers import LlamaConfig
    m = json.loads((FIXTURES / "torchtitan" / "torchtitan_llama_fsdp2" / "truth.json").read_text())["model"]
    LlamaConfig(hidden_size=m["dim"], intermediate_size=m["hidden_dim"], num_hidden_layers=m["n_layers"],
                num_attention_heads=m["n_heads"], num_key_value_heads=m["n_kv_heads"],
                head_dim=m["dim"] // m["n_heads"], vocab_size=m["vocab_size"], rms_norm_eps=m["norm_eps"],
                rope_theta=m["rope_theta"], max_position_embeddings=32, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False).save_pretrained(folder)
    return str(folder / "config.json")
