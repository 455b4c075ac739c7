"""Megatron's common state for a source that holds none (a DeepSpeed, universal or DCP checkpoint of megatron-core's
GPTModel): built from the Megatron-LM arguments the user gives (`--to ...,args=FILE`), checked against the
checkpoint's tensors, never guessed.

    {"args": {"num_layers": 2, "hidden_size": 16, ...},           Megatron-LM's arguments, under its names
     "opt_param_scheduler": {"max_lr": ..., "num_steps": ...},    the scheduler state its load_checkpoint restores
     "iteration": 3}                                              optional: the source's step count where it has one

What Megatron would resume wrong without is required (REQUIRED, SCHEDULER); each model-shape argument must give the
shapes the checkpoint holds, and the optimizer's the hyper-parameters its param groups hold, or the file is refused
in one line naming the argument. The iteration and consumed samples are the source's (DeepSpeed's global steps and
samples) where it records them; the file may repeat them, not contradict them. The degrees (tp, pp, dp) are the
target's, whatever the file says. The optimizer's param groups are megatron-core's default ones (a group with
weight decay, then one without: 1-D params and biases, the rule file's no_weight_decay), each taking the
hyper-parameters of the source's group holding its params, which must be one group per Megatron group.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.catalog import Catalog
from reshard.errors import ReshardError, UsageError
from reshard.formats.megatron.order import ParamOrder
from reshard.storage import files as fs

# what megatron-core's load and the next step read from args, which no tensor says
REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
            "max_position_embeddings", "seq_length", "normalization", "swiglu", "add_bias_linear",
            "position_embedding_type", "untie_embeddings_and_output_weights", "bf16", "fp16", "optimizer", "lr",
            "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "micro_batch_size", "global_batch_size",
            "transformer_impl")
# OptimizerParamScheduler.state_dict(), which load_checkpoint hands to its load_state_dict
SCHEDULER = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps", "start_wd",
             "end_wd", "wd_incr_steps", "wd_incr_style")
CHECKPOINT_VERSION = 3.0     # what Megatron-LM's save writes (the format's version, not the run's)
# torch's AdamW hyper-parameters a source's param group carries into Megatron's
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
             "fused", "decoupled_weight_decay")


@dataclass(frozen=True)
class RunArgs:
    """The common state to write (args as a plain dict, iteration, scheduler) and the optimizer's param groups."""
    args: Mapping[str, Any]
    iteration: int
    scheduler: Mapping[str, Any]
    param_groups: tuple[Mapping[str, Any], ...]


def load(path: str, catalog: Catalog, rules: ParamOrder) -> RunArgs:
    """The file at `path` read and checked against `catalog` (see the module's doc)."""
    data = read(path)
    if not isinstance(data, dict) or not isinstance(data.get("args"), dict):
        raise UsageError.at(path, 'needs {"args": {Megatron-LM\'s arguments}, "opt_param_scheduler": {...}}')
    unknown = sorted(set(data) - {"args", "opt_param_scheduler", "iteration"})
    if unknown:
        raise ReshardError.at(path, f"unknown key {unknown[0]!r} (args, opt_param_scheduler, iteration)")
    args = dict(data["args"])
    missing = [k for k in REQUIRED if k not in args]
    if missing:
        raise ReshardError.at(path, f"args.{missing[0]} is not given: Megatron resumes with it and the checkpoint "
                                    f"does not say it")
    scheduler = data.get("opt_param_scheduler")
    if not isinstance(scheduler, dict) or any(k not in scheduler for k in SCHEDULER):
        lacking = next(k for k in SCHEDULER if not isinstance(scheduler, dict) or k not in scheduler)
        raise ReshardError.at(path, f"opt_param_scheduler.{lacking} is not given: Megatron-LM's load_checkpoint "
                                    "restores the scheduler's state, which the checkpoint does not hold")
    check_shapes(path, args, catalog, rules)
    for key, arg in (("max_lr", "lr"), ("min_lr", "min_lr")):
        if scheduler[key] != args[arg]:
            raise ReshardError.at(path, f"opt_param_scheduler.{key} = {scheduler[key]} is not args.{arg} = "
                                        f"{args[arg]}")
    iteration = _counter(path, data.get("iteration"), catalog.training.global_steps, "iteration",
                         "its step count")
    if args.setdefault("iteration", iteration) != iteration:
        raise ReshardError.at(path, f"args.iteration = {args['iteration']}: the checkpoint's is {iteration}")
    samples = _counter(path, args.get("consumed_train_samples"), catalog.training.global_samples,
                       "args.consumed_train_samples", "its sample count")
    args["consumed_train_samples"] = samples
    args.setdefault("kv_channels", args["hidden_size"] // args["num_attention_heads"])   # (Megatron-LM's default)
    args["ckpt_format"] = "torch_dist"     # (the output's; the degrees and the optimizer's sharding: the writer's)
    return RunArgs(args, iteration, scheduler, _param_groups(path, args, catalog, rules))


def read(path: str) -> object:
    """The JSON value of the arguments file at `path`."""
    # (a file the user gives that cannot be read as one is a usage error, exit 2, as a bad --config is)
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        raise UsageError.at(path, f"cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError.at(path, f"not JSON ({e})") from None


def _counter(path: str, given: object, source: int | None, what: str, says: str) -> int:
    """A count the source records (DeepSpeed's global steps or samples): the file may repeat it only."""
    if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 0):
        raise ReshardError.at(path, f"{what} = {given!r}: a count (0, 1, ...)")
    if source is not None and given is not None and given != source:
        raise ReshardError.at(path, f"{what} = {given}: the checkpoint's is {source}")
    value = source if source is not None else given
    if value is None:
        raise ReshardError.at(path, f"{what} is not given, and the checkpoint does not record {says}")
    return int(value)


def check_shapes(path: str, args: dict, catalog: Catalog, rules: ParamOrder) -> None:
    """Each model-shape argument against the shapes the checkpoint holds."""
    shapes = {name: tuple(info.shape) for name, info in catalog.params.items()}
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
                "max_position_embeddings"):
        value = args[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ReshardError.at(path, f"args.{key} = {value!r}: a positive whole number")
    layers = {where[0] for where in map(rules.layer_of, shapes) if where is not None}
    if len(layers) != args["num_layers"] or layers != set(range(len(layers))):
        raise ReshardError.at(path, f"args.num_layers = {args['num_layers']}: the checkpoint holds "
                                    f"{len(layers)} layers")
    heads, hidden = args["num_attention_heads"], args["hidden_size"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    kv = args.get("kv_channels") or hidden // heads
    ffn = args["ffn_hidden_size"]
    expected: dict[str, tuple[tuple[int, ...], str]] = {
        "embedding.word_embeddings.weight": ((args["padded_vocab_size"], hidden), "args.padded_vocab_size, "
                                                                                   "args.hidden_size")}
    if args["untie_embeddings_and_output_weights"]:
        expected["output_layer.weight"] = ((args["padded_vocab_size"], hidden), "args.padded_vocab_size")
    if args["position_embedding_type"] == "learned_absolute":
        expected["embedding.position_embeddings.weight"] = ((args["max_position_embeddings"], hidden),
                                                             "args.max_position_embeddings")
    for layer in sorted(layers):
        at = f"{rules.layer_prefix}{layer}."
        expected[at + "self_attention.linear_qkv.weight"] = (
            ((heads + 2 * int(groups or 0)) * kv, hidden),
            "args.num_attention_heads, num_query_groups, kv_channels")
        expected[at + "self_attention.linear_proj.weight"] = ((hidden, heads * kv), "args.num_attention_heads")
        expected.update(_mlp_shapes(args, at, rules, hidden, ffn))
    extra = next((n for n in shapes if rules.expert_of(n) is not None and n not in expected), None)
    if extra is not None:
        raise ReshardError.at(path, f"args.num_experts = {args.get('num_experts')!r}, yet the checkpoint holds {extra}")
    for name, (shape, which) in expected.items():
        if shapes.get(name) != shape:
            held = f"holds {list(shapes[name])}" if name in shapes else "does not hold it"
            raise ReshardError.at(path, f"{which} make {name} {list(shape)}; the checkpoint {held}")
    unexpected = {"output_layer.weight": not args["untie_embeddings_and_output_weights"],
                  "embedding.position_embeddings.weight": args["position_embedding_type"] != "learned_absolute"}
    for name, absent in unexpected.items():
        if absent and name in shapes:
            which = ("args.untie_embeddings_and_output_weights" if name.startswith("output")
                     else "args.position_embedding_type")
            raise ReshardError.at(path, f"{which} = {args[which[5:]]!r}, yet the checkpoint holds {name}")
    flags: dict[str, tuple[str, object]] = {"add_bias_linear": (".self_attention.linear_proj.bias", True),
                                            "normalization": (".self_attention.linear_qkv.layer_norm_bias",
                                                              "LayerNorm")}
    for key, (suffix, holds) in flags.items():
        present = any(n.endswith(suffix) for n in shapes)
        if present != (args[key] == holds):
            raise ReshardError.at(path, f"args.{key} = {args[key]!r}, yet the checkpoint "
                                        f"{'holds' if present else 'holds no'} *{suffix}")
    dtypes = {t.dtype for k, t in catalog.tensors.items() if k.state == "module"}
    if not dtypes:
        raise ReshardError.at(catalog.root, "holds no model weights of its own (a ZeRO-3 save keeps only the fp32 "
                                            "partitions): Megatron output of it is not written yet")
    dtype = "bfloat16" if args["bf16"] else "float16" if args["fp16"] else "float32"
    if dtypes != {dtype}:
        raise ReshardError.at(path, f"args.bf16 = {args['bf16']}, args.fp16 = {args['fp16']}: the model is "
                                    f"{', '.join(sorted(dtypes))}")


def _mlp_shapes(args: Mapping[str, Any], at: str, rules: ParamOrder, hidden: int,
                ffn: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The shapes of one layer's MLP (`at`: the layer's prefix): a dense SwiGLU or plain MLP, or with
    args.num_experts a router and that many experts of args.moe_ffn_hidden_size each."""
    gated = 2 if args["swiglu"] else 1
    experts = args.get("num_experts")
    if not experts:
        return {at + "mlp.linear_fc1.weight": ((ffn * gated, hidden), "args.ffn_hidden_size, args.swiglu"),
                at + "mlp.linear_fc2.weight": ((hidden, ffn), "args.ffn_hidden_size")}
    width = args.get("moe_ffn_hidden_size") or ffn
    out: dict[str, tuple[tuple[int, ...], str]] = {
        at + "mlp.router.weight": ((experts, hidden), "args.num_experts, args.hidden_size")}
    for expert in range(experts):
        within = f"{at}{rules.expert_prefix}{expert}."
        out[within + "linear_fc1.weight"] = ((width * gated, hidden), "args.moe_ffn_hidden_size, args.swiglu")
        out[within + "linear_fc2.weight"] = ((hidden, width), "args.moe_ffn_hidden_size, args.num_experts")
    return out


def _param_groups(path: str, args: Mapping[str, Any], catalog: Catalog, rules: ParamOrder) -> tuple:
    """megatron-core's default param groups (with weight decay, then without), each with the hyper-parameters of
    the source's group its params are in (see the module's doc)."""
    if args["optimizer"] != "adam" or catalog.training.optimizer != "AdamW":
        raise ReshardError.at(path, f"args.optimizer = {args['optimizer']!r}: Megatron's adam is AdamW (decoupled "
                                    f"weight decay); the checkpoint's optimizer is "
                                    f"{catalog.training.optimizer or 'not recorded'}")
    by_mult: dict[float, dict[str, Any]] = {}
    for index, group in enumerate(catalog.param_groups):
        names = [n for n in group.get("params", []) if n in catalog.params]
        mults = {0.0 if rules.takes_no_weight_decay(n, catalog.params[n].shape) else 1.0 for n in names}
        if len(mults) > 1:
            raise ReshardError.at(catalog.root, f"param group {index} holds params megatron-core's default optimizer "
                                                "puts in two groups (with and without weight decay)")
        if not mults:
            continue
        mult = mults.pop()
        hyper = {k: group[k] for k in ADAM_KEYS if k in group}
        _check_group(path, index, hyper, args, mult)
        if mult in by_mult and by_mult[mult] != hyper:
            raise ReshardError.at(catalog.root, f"param group {index}: its hyper-parameters differ from another "
                                                "group's that megatron-core's optimizer would join it with")
        by_mult[mult] = hyper
    out = []
    for mult in (1.0, 0.0):        # megatron-core: the default group first, then the wd_mult 0 override
        if mult in by_mult:
            out.append({**by_mult[mult], "is_expert_parallel": False, "default_config": True, "wd_mult": mult,
                        "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": args["lr"], "min_lr": args["min_lr"]})
    return tuple(out)


def _check_group(path: str, index: int, hyper: Mapping[str, Any], args: Mapping[str, Any], mult: float) -> None:
    betas = hyper.get("betas")
    checks = (("adam_beta1", betas[0] if betas else None), ("adam_beta2", betas[1] if betas else None),
              ("adam_eps", hyper.get("eps")))
    for key, value in checks:
        if value is None or not math.isclose(float(value), float(args[key]), rel_tol=1e-12):
            raise ReshardError.at(path, f"args.{key} = {args[key]}: the checkpoint's param group {index} holds "
                                        f"{value}")
    decay = hyper.get("weight_decay")
    if decay is None or not math.isclose(float(decay), float(args["weight_decay"]) * mult, abs_tol=1e-12):
        raise ReshardError.at(path, f"args.weight_decay = {args['weight_decay']}: the checkpoint's param group "
                                    f"{index} decays by {decay} (Megatron's wd_mult {mult})")
