"""The mixture-of-experts fixtures as the tests look at them: the AutoEP ones, a packed expert weight, how a read
catalog differs from the engine's truth, which experts each rank's file holds, and the truth under Mixtral's names."""
from __future__ import annotations

import torch

from reshard.core.catalog import MASTER, MODULE
from reshard.core.placement import Shard
from reshard.formats.deepspeed import topology as ds
from reshard.reading.source_bytes import full_tensor
from tests.helpers.fixtures import MOE_FIXTURES, truth_json, truth_tensors

AUTOEP = [n for n in MOE_FIXTURES if truth_json(n)["kind"] == "autoep" and truth_json(n)["zero_stage"] != 3]
AUTOEP_Z3 = [n for n in MOE_FIXTURES if truth_json(n)["kind"] == "autoep" and truth_json(n)["zero_stage"] == 3]
PACKED = "model.layers.1.mlp.experts.w2"          # an AutoEP packed weight: (num_experts, hidden, intermediate)
MOE_NAMES = "mixtral-autoep-fsdp"             # the rule file giving the AutoEP fixtures transformers' names


def truth_differences(catalog, truth) -> list:
    """The truth's tensors (state/name) the catalog does not give bit for bit; and any catalog tensor beyond them.
    A ZeRO-3 save keeps no module copy of a trainable param (the engine restores it from the fp32 master): there the
    truth's module weight is compared with the master cast to its dtype."""
    bad = []
    for key, expected in truth.items():
        state, _, name = key.partition("/")
        if not name:            # the probe's logits
            continue
        held = catalog.aliases.get(name, name)     # (ZeRO-3: AutoEP's router alias is a tie)
        if state == MODULE and (held, MODULE) not in catalog.tensors and ds.of(catalog.layout).zero == 3 \
                and catalog.params[held].kind == "trainable":
            got = full_tensor(catalog, held, MASTER).to(expected.dtype)
            if got.shape != expected.shape or not torch.equal(got, expected):
                bad.append(key)
            continue
        got = full_tensor(catalog, name, state)
        if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(got, expected):
            bad.append(key)
    return bad + sorted(f"{s}/{n}" for n, s in catalog.tensors if f"{s}/{n}" not in truth)


def experts_held(catalog) -> dict:
    """Optimizer file rank -> the global experts (of any packed weight's fp32 master) it holds."""
    held: dict = {}
    for layer in catalog.experts.layers:
        for param in layer.params:
            tensor = catalog.tensors[(param, MASTER)]
            for f in tensor.fragments:
                blocks = f.shard.blocks if f.shard is not None else [Shard.whole(tensor.shape).blocks[0]]
                for b in blocks:                 # (no shard at ep 1: the whole tensor)
                    held.setdefault(f.rank, set()).update(range(b.at[0], b.at[0] + b.shape[0]))
    return {rank: tuple(sorted(e)) for rank, e in held.items()}


def mixtral_truth(name):
    """The fixture's truth (fp32 masters, both moments) under transformers' Mixtral names and shapes, made here from
    the engine's packed experts: gate_up_proj is w1 then w3 along dim 1 (MixtralExperts' chunk(2) takes gate
    first), down_proj is w2, the router is mlp.gate."""
    truth, out = truth_tensors(name), {}
    for key, tensor in truth.items():
        state, _, param = key.partition("/")
        if state in ("module", "logits"):
            continue            # FSDP2 holds the masters; the 16-bit copies are the engine's
        layer, _, leaf = param.rpartition(".mlp.experts.")
        if leaf == "w1":
            up = truth[f"{state}/{layer}.mlp.experts.w3"]
            out[f"{state}/{layer}.mlp.experts.gate_up_proj"] = torch.cat([tensor, up], dim=1)
        elif leaf == "w2":
            out[f"{state}/{layer}.mlp.experts.down_proj"] = tensor
        elif leaf != "w3":
            out[f"{state}/{param.replace('.mlp.router.gate.weight', '.mlp.gate.weight')}"] = tensor
    return out
