"""What a Megatron torch_dist save adds to its topology, and what its reader keeps for later (notes)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reshard.core.layout import FormatTopology, Layout, SpecKey
from reshard.errors import UsageError
from reshard.formats.protocol import TargetKeys

PLAIN = "plain"       # the non-distributed optimizer: model-shaped states (optimizer.state.fp32_param.<key>)
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"    # the distributed optimizer's
FULLY_SHARDED_MODEL_SPACE = "fully_sharded_model_space"     # 0.15's default: model-space states, flattened blocks
# no optimizer state: the model alone, as Megatron-LM's --no-save-optim --no-save-rng saves it (its weights-only form,
# loaded with --no-load-optim --no-load-rng)
WEIGHTS_ONLY = "none"
SHARDINGS = (DP_RESHARDABLE, FULLY_RESHARDABLE, PLAIN, WEIGHTS_ONLY)
# What inspect says of the version: a 0.16 save records none; its files are laid out as 0.16 lays them
LAYOUT_016 = "0.16 layout (common.pt beside the DCP files; the save records no version)"
LAYOUT_015 = "0.15 layout (common.pt beside the DCP files; optimizer states as flat ranges of their blocks)"
LAYOUT_019 = "0.19 layout (the common state a DCP object; the save records no version)"


@dataclass(frozen=True)
class MegatronTopology:
    """The optimizer's sharding type (`plain`, or the distributed optimizer's `dp_reshardable` /
    `fully_reshardable`) and what the save says of itself."""
    sharding: str
    iteration: int | None = None
    checkpoint_version: float | None = None
    layout: str = ""          # which megatron-core layout the files follow ("0.16": common.pt beside DCP's files)
    backend: str = "torch_dist"
    # a target's Megatron-LM arguments file (args=FILE: megatron/run_args.py), for a source without Megatron's
    # common state (DeepSpeed, universal, DCP)
    run_args: str | None = None
    ep: int | None = None     # a mixture of experts' expert-parallel degree (None: no experts)
    # a target's tokenizer vocabulary (vocab=N), where the padded embedding's rows at the target's tp do not follow
    # from the saved ones
    vocab: int | None = None

    def terms(self, brief: bool = False) -> tuple[tuple[str, object], ...]:
        experts = (("ep", self.ep),) if self.ep is not None else ()
        return experts if brief else (*experts, ("optimizer", self.sharding))

    def descriptor(self) -> dict[str, object]:
        return {"optimizer": self.sharding, "options": self.options()}

    def options(self) -> dict[str, object]:
        optimizer = {PLAIN: "plain", WEIGHTS_ONLY: "none"}.get(self.sharding, "distributed")
        return {"optimizer": optimizer, "sharding": self.sharding,
                "iteration": self.iteration, "checkpoint_version": self.checkpoint_version,
                "backend": self.backend, "megatron_core": self.layout}


@dataclass(frozen=True)
class MegatronNotes:
    """The save's own facts for `inspect --params` and `diff`: per parameter how it is stored (its stacked key,
    layer and tensor-parallel boxes), the counters Megatron-LM keeps, and the run's arguments that are plain values
    (`args` of common.pt: hidden_size, num_query_groups, norm_epsilon, ...), which export's rule files read as the
    model's hyperparameters (reshard.rules.export_names.ModelFacts)."""
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    args: tuple[tuple[str, Any], ...] = ()
    # the distributed optimizer's grad buffers as saved: (param dtype, grad dtype) of each, torch's names
    # ("torch.bfloat16", "torch.float32"); empty where the save does not say (model-shaped optimizer states)
    grad_buffers: tuple[tuple[str, str], ...] = ()

    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.args)

    def param_details(self, name: str) -> dict[str, Any]:
        return dict(self.params.get(name, {}))

    def layout_scalar(self, key: str, value: object) -> bool:
        # (megatron-core marks the experts' groups so at ep > 1 only: a change of ep changes it)
        return key == "is_expert_parallel"

    def scalars(self) -> dict[str, Any]:
        return dict(self.counters)


def _sharding(text: str) -> str:
    if text not in SHARDINGS:
        raise UsageError(f"sharding is {', '.join(SHARDINGS[:-1])} or {SHARDINGS[-1]}, not {text!r}")
    return text


def _args_file(text: str) -> str:
    if not text:
        raise UsageError("args is a JSON file of Megatron-LM's arguments (args=FILE)")
    return text


SPEC_KEYS = (SpecKey("sharding", "|".join(SHARDINGS), "Megatron's optimizer state: the distributed optimizer's "
                     "sharding type (dp_reshardable, Megatron-LM's default; fully_reshardable), plain: the "
                     "non-distributed optimizer, or none: the model alone, as --no-save-optim --no-save-rng saves it "
                     "(default: the source's own; dp_reshardable for a source of another format, none for a model "
                     "without optimizer state, a legacy "
                     "distributed save's, fully_reshardable for 0.15's model space)",
                     text=_sharding),
             SpecKey("args", "FILE", "a JSON file of the run's Megatron-LM arguments and scheduler state, for a "
                     "source that holds none (DeepSpeed, universal, DCP): docs/formats/megatron.md", text=_args_file),
             SpecKey("ep", "E", "expert-parallel degree of a mixture-of-experts save, dividing dp and each layer's "
                     "experts (default: the source's)", minimum=1),
             SpecKey("vocab", "N", "the tokenizer's vocabulary size (Megatron-LM's --true-vocab-size), where a tp "
                     "change re-pads the embedding and output layer to make_vocab_size_divisible_by x tp and the "
                     "saved padding does not tell the size (default: args.vocab_size)", minimum=1))


def kept_sharding(sharding: str) -> str:
    """The torch_dist sharding that keeps what a source's optimizer sharding is: its own, or for 0.15's model-space
    states (fully_sharded_model_space) the model-space one megatron-core 0.16 writes and reshards itself
    (fully_reshardable), and for any other distributed save (a legacy distrib_optim.pt) Megatron-LM's default."""
    if sharding in SHARDINGS:
        return sharding
    return FULLY_RESHARDABLE if sharding == FULLY_SHARDED_MODEL_SPACE else DP_RESHARDABLE


def target(source: Layout, given: Mapping[str, object]) -> MegatronTopology:
    """The target's optimizer sharding: the one `sharding=` names; else the source's kept (kept_sharding), a
    source of another format written as Megatron-LM writes by default (dp_reshardable), and a model alone (no
    optimizer state: a Hugging Face model) as the model alone (none)."""
    own = source.format_topology if isinstance(source.format_topology, MegatronTopology) else None
    # (a source of another format without optimizer state, a model alone, is written alone)
    default = kept_sharding(own.sharding) if own else DP_RESHARDABLE if source.master_dtype else WEIGHTS_ONLY
    sharding = str(given.get("sharding", default))
    run_args = given.get("args")
    ep = given.get("ep", own.ep if own else None)
    vocab = given.get("vocab")
    return MegatronTopology(sharding, own.iteration if own else None, own.checkpoint_version if own else None,
                            LAYOUT_016, run_args=str(run_args) if run_args is not None else None,
                            ep=int(ep) if isinstance(ep, int) else None,
                            vocab=int(vocab) if isinstance(vocab, int) else None)


def from_descriptor(source: FormatTopology | None, data: Mapping[str, object]) -> MegatronTopology:
    """A descriptor file's `sharding` (the source's or dp_reshardable where it names none)."""
    own = source if isinstance(source, MegatronTopology) else None
    sharding = data.get("sharding", kept_sharding(own.sharding) if own else DP_RESHARDABLE)
    run_args, vocab = data.get("args"), data.get("vocab")
    if vocab is not None and (type(vocab) is not int or vocab < 1):
        raise UsageError(f"vocab is the tokenizer's vocabulary size, a whole number, not {vocab!r}")
    return MegatronTopology(_sharding(str(sharding)), layout=LAYOUT_016,
                            run_args=_args_file(str(run_args)) if run_args is not None else None, vocab=vocab)


TARGET_KEYS = TargetKeys(SPEC_KEYS, target, from_descriptor, ("sharding", "args", "vocab"))
