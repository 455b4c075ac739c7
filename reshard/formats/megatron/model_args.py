"""Megatron-LM's arguments for a model that comes without them (a Hugging Face model imported with the export-names
rule file read backwards: reshard.rules.import_names), derived from its hyperparameters, overridable by the user's
arguments file (`--to ...,args=FILE`: {"args": {...}}), and checked against its tensors (run_args.check_shapes: one
line naming the argument that contradicts them).

The model is written alone (`sharding=none`: no optimizer, no scheduler, no RNG state), as a fine-tune or a continued
pre-training starts from it (Megatron-LM's --finetune, or --no-load-optim --no-load-rng). Its vocabulary is the
model's rows, padded only to a multiple of tp (make_vocab_size_divisible_by 1): every padded row enters the
softmax of the output layer and changes the model's outputs, so none is added that Megatron does not need, unless
the arguments file asks for make_vocab_size_divisible_by.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.core.catalog import MODULE, Catalog
from reshard.errors import ReshardError, UsageError
from reshard.formats.megatron import run_args
from reshard.formats.megatron.order import ParamOrder

# the hyperparameters the model's config must give (under Megatron-LM's names, as the rule file maps them)
SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
         "max_position_embeddings")
# what the rule file's `requires` says of the architecture, and what a Llama-configured model is otherwise
ARCHITECTURE = ("normalization", "swiglu", "add_bias_linear", "position_embedding_type",
                "untie_embeddings_and_output_weights")
# a mixture of experts' (what the rule file maps a Mixtral's config to), carried where the model's config gives them;
# moe_aux_loss_coeff is the load-balancing loss's weight in training, which the model's outputs do not depend on
EXPERTS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_grouped_gemm", "moe_aux_loss_coeff")
PRECISION = {"bfloat16": {"bf16": True, "fp16": False}, "float16": {"bf16": False, "fp16": True},
             "float32": {"bf16": False, "fp16": False}}


def derive(facts: Mapping[str, Any], catalog: Catalog, rules: ParamOrder, given: str | None) -> dict[str, Any]:
    """The args of the model alone (see the module's doc): from `facts`, the model's hyperparameters under
    Megatron-LM's names, then the arguments file `given` over them, checked against `catalog`'s tensors."""
    where = getattr(catalog.notes, "source", catalog.root)
    if facts.get("ffn_hidden_size") is None and facts.get("num_experts"):
        # (a model whose every MLP is a mixture of experts has no dense width: Megatron-LM's moe_ffn_hidden_size
        # defaults to ffn_hidden_size, which Megatron-LM's Mixtral runs set to the experts' width)
        facts = {**facts, "ffn_hidden_size": facts.get("moe_ffn_hidden_size")}
    lacking = next((k for k in (*SHAPE, *ARCHITECTURE) if facts.get(k) is None), None)
    if lacking is not None:
        raise ReshardError.at(where, f"gives no {lacking}: Megatron builds the model with it")
    dtypes = {t.dtype for k, t in catalog.tensors.items() if k.state == MODULE}
    if len(dtypes) != 1 or next(iter(dtypes)) not in PRECISION:
        raise ReshardError.at(catalog.root, f"weights of {', '.join(sorted(dtypes))}: one of "
                                            f"{', '.join(PRECISION)} is written")
    args = {key: facts[key] for key in (*SHAPE, *ARCHITECTURE)}
    heads = int(facts["num_attention_heads"])
    groups = facts.get("num_query_groups") or heads
    args.update(
        num_query_groups=groups, group_query_attention=groups != heads,
        kv_channels=facts.get("kv_channels") or int(facts["hidden_size"]) // heads,
        seq_length=facts["max_position_embeddings"], vocab_size=facts["padded_vocab_size"],
        make_vocab_size_divisible_by=1, transformer_impl="local", **PRECISION[dtypes.pop()])
    for key in ("norm_epsilon", "rotary_base", *EXPERTS):
        if facts.get(key) is not None:
            args[key] = facts[key]
    if given is not None:
        args.update(_overrides(given))
    args.update(ckpt_format="torch_dist", iteration=0, consumed_train_samples=0)
    run_args.check_shapes(given or where, args, catalog, rules)
    return args


def _overrides(path: str) -> dict[str, Any]:
    """The arguments file's args: {"args": {...}} and nothing else (a model alone has no scheduler)."""
    data = run_args.read(path)
    if not isinstance(data, dict) or not isinstance(data.get("args"), dict) or set(data) - {"args"}:
        raise UsageError.at(path, 'a model\'s arguments file is {"args": {Megatron-LM\'s arguments}} (the model '
                                  "is written alone: no scheduler, no iteration)")
    return dict(data["args"])
