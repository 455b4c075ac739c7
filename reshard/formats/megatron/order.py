"""The order in which a Megatron model registers its parameters, which pipeline stage holds each, which take no
weight decay and how tensor parallelism cuts each: a rule file
(reshard/layouts/megatron-buffers/megatron-core-gpt.json, kind "reshard.megatron-buffers"), since a torch_dist save
records none of them: the distributed optimizer's `dp_reshardable` buffers are laid out in that order (buckets.py),
and the saved param groups name no params."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from reshard.errors import ReshardError
from reshard.rules import files as rule_files

KIND = rule_files.MEGATRON_BUFFERS
SHIPPED = "megatron-core-gpt"


@dataclass(frozen=True)
class TpCut:
    """How tensor parallelism cuts a parameter: `parts` equal blocks along `axis`, each in tp equal pieces (the
    rule file's `tensor_parallel`); `parts_when`: an argument (`swiglu`) without which there is one block."""
    axis: int
    parts: int = 1
    parts_when: str | None = None


@dataclass(frozen=True)
class ParamOrder:
    path: str
    transformer_impl: tuple[str, ...]     # the layer implementations the order was checked for
    layer_prefix: str                    # "decoder.layers."
    before_layers: tuple[str, ...]
    layer: tuple[str, ...]               # relative to a layer
    after_layers: tuple[str, ...]
    shared_embedding: tuple[str, ...]    # tied between the first and last stage: a bucket of its own
    no_decay_ndim: int | None = None     # params of this many dimensions take no weight decay
    no_decay_suffixes: tuple[str, ...] = ()     # nor do params whose names end so
    tp_cuts: tuple[tuple[str, TpCut], ...] = ()   # (name, or name within a layer) -> its cut; others are whole
    keys_map: tuple[tuple[str, str], ...] = ()     # a legacy state dict's layer-relative prefix -> the saved key's
    expert_prefix: str | None = None     # "mlp.experts.experts.": saved with an expert axis after the layer axis
    expert_params: tuple[str, ...] = ()  # an expert's params (relative to it), in registration order
    expert_cuts: tuple[tuple[str, TpCut], ...] = ()   # how an expert's params are cut (SwiGLU's fc1: two parts)
    extra_states: tuple[str, ...] = ()   # layer modules (relative to a layer) that save an empty `_extra_state`
    expert_extra_states: tuple[str, ...] = ()   # an expert's modules (relative to it) that save one
    vocabulary: tuple[str, ...] = ()     # params with a row per token of the padded vocabulary

    def expert_of(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, name within the expert) of one expert's param, or None."""
        where = self.layer_of(name)
        if where is None or self.expert_prefix is None or not where[1].startswith(self.expert_prefix):
            return None
        found = re.fullmatch(r"(\d+)\.(.+)", where[1][len(self.expert_prefix):])
        return (where[0], int(found.group(1)), found.group(2)) if found else None

    def saves_extra_state(self, module: str) -> bool:
        """Does the module `module` (a full name: decoder.layers.0.mlp.linear_fc1) save an empty `_extra_state`?"""
        expert = self.expert_of(f"{module}.weight")
        if expert is not None:
            return expert[2].rsplit(".", 1)[0] in self.expert_extra_states
        where = self.layer_of(module)
        return where is not None and where[1] in self.extra_states

    def is_expert_stack(self, within_layer: str) -> bool:
        """Is a saved layer stack's key (relative to the layer) an expert stack (an expert axis after the layer's)?"""
        return self.expert_prefix is not None and within_layer.startswith(self.expert_prefix)

    def stacked_key(self, name: str) -> str | None:
        """The torch_dist key of the layer stack a per-layer name is saved in (the layer's number, and an expert's,
        become the stack's leading axes), or None for a name outside the layers."""
        where = self.layer_of(name)
        if where is None:
            return None
        expert = self.expert_of(name)
        within = where[1] if expert is None else f"{self.expert_prefix}{expert[2]}"
        return f"{self.layer_prefix}{within}"

    def sharded_name(self, name: str) -> str:
        """A module state dict's name under the key megatron-core's sharded state dict gives it (a legacy save's
        `decoder.layers.0.input_layernorm.weight` is `decoder.layers.0.self_attention.linear_qkv.layer_norm_weight`
        in torch_dist)."""
        where = self.layer_of(name)
        if where is None:
            return name
        for prefix, replacement in self.keys_map:
            if where[1].startswith(prefix):
                return f"{self.layer_prefix}{where[0]}.{replacement}{where[1][len(prefix):]}"
        return name

    def tp_cut(self, name: str) -> TpCut | None:
        """How tensor parallelism cuts `name`, or None: whole on every rank."""
        expert = self.expert_of(name)
        if expert is not None:
            return dict(self.expert_cuts).get(expert[2])
        where = self.layer_of(name)
        own = where[1] if where is not None else name
        return dict(self.tp_cuts).get(own)

    def takes_no_weight_decay(self, name: str, shape: Sequence[int]) -> bool:
        """Is `name` in the default optimizer's group without weight decay (wd_mult 0)?"""
        return len(shape) == self.no_decay_ndim or name.endswith(self.no_decay_suffixes)

    def layer_of(self, name: str) -> tuple[int, str] | None:
        """(layer index, name within the layer) of a per-layer name, or None."""
        found = re.fullmatch(re.escape(self.layer_prefix) + r"(\d+)\.(.+)", name)
        return (int(found.group(1)), found.group(2)) if found else None

    def places(self, name: str) -> bool:
        """Is `name` a parameter this order places (a torch_dist key of the model it describes)?"""
        where = self.layer_of(name)
        expert = self.expert_of(name)
        return (where is not None and where[1] in self.layer) or name in self.before_layers or \
            name in self.after_layers or (expert is not None and expert[2] in self.expert_params)

    def ordered(self, names: Sequence[str]) -> list[str]:
        """`names` in registration order; a ReshardError naming the rule file for one it does not place."""
        def rank(name: str) -> tuple:
            expert = self.expert_of(name)
            if expert is not None and expert[2] in self.expert_params:
                return (1, expert[0], len(self.layer), expert[1], self.expert_params.index(expert[2]))
            where = self.layer_of(name)
            if where is not None and where[1] in self.layer:
                return (1, where[0], self.layer.index(where[1]))
            if name in self.before_layers:
                return (0, 0, self.before_layers.index(name))
            if name in self.after_layers:
                return (2, 0, self.after_layers.index(name))
            raise ReshardError.at(self.path, f"{name}: this parameter order does not place it, so the distributed "
                                             "optimizer's buffers cannot be laid out")
        return sorted(names, key=rank)

    def on_stage(self, name: str, stage: int, stages: int, layers: int) -> bool:
        """Does pipeline stage `stage` of `stages` hold `name` (layers split evenly, the names before them on the
        first stage, those after on the last)?"""
        where = self.layer_of(name)
        if where is not None:
            per = layers // stages
            return stage * per <= where[0] < (stage + 1) * per
        if name in self.before_layers:
            return stage == 0
        return stage == stages - 1


def load(given: str | None = None) -> ParamOrder:
    path, data = rule_files.load(given or SHIPPED, KIND)
    try:
        no_decay = data.get("no_weight_decay", {})
        experts = data.get("experts", {})
        def cuts_of(given: dict) -> tuple[tuple[str, TpCut], ...]:
            return tuple((name, TpCut(int(cut["axis"]), int(cut.get("parts", 1)), cut.get("parts_when")))
                         for name, cut in given.items() if name != "description")
        cuts = cuts_of(data.get("tensor_parallel", {}))
        return ParamOrder(path, tuple(data["transformer_impl"]), str(data["layer_prefix"]),
                          tuple(data["before_layers"]), tuple(data["layer"]), tuple(data["after_layers"]),
                          tuple(data.get("shared_embedding", ())), no_decay.get("ndim"),
                          tuple(no_decay.get("suffixes", ())), cuts,
                          tuple((str(k), str(v)) for k, v in data.get("state_dict_keys_map", {}).items()),
                          experts.get("prefix"), tuple(experts.get("params", ())),
                          cuts_of(experts.get("tensor_parallel", {})),
                          tuple(data.get("extra_states", {}).get("modules", ())),
                          tuple(experts.get("extra_states", {}).get("modules", ())),
                          tuple(data.get("padded_vocabulary", {}).get("params", ())))
    except (KeyError, TypeError) as e:
        raise ReshardError.at(path, f"malformed parameter-order file ({type(e).__name__}: {e})") from None
