"""Mixture-of-experts fixtures (run under torchrun by tools/make_fixtures.py).

* ``autoep``: a tiny random ``transformers`` Mixtral trained with DeepSpeed AutoEP
  (``"expert_parallel": {"enabled": true, "autoep_size": 2, "preset_model": "mixtral"}``): every rank holds its
  experts of each MoE layer packed as ``experts.w1/w2/w3`` of shape ``(local_experts, ...)``.
* ``moe``: a small ``nn.Module`` around the older ``deepspeed.moe.layer.MoE`` (one ``torch.nn.Sequential`` expert
  module per local expert).

Truth, taken from the live engine: the flat fp32 partitions and optimizer states of every param group are gathered
over that group's own data-parallel group (make_fixtures.py's ``_flat_truth``: over the world for the non-expert
group, over the expert-data-parallel group for an expert group), which gives each rank its local experts; those are
then gathered over the expert-parallel group and put in their global places (AutoEP: the layer's own
``expert_placement_descriptor``; deepspeed.moe: ``ep_rank * local + i``, how its layer files number experts).
Module weights likewise, from the engine's module ``state_dict``. Under ZeRO-3 (``autoep2_z3_*``) the flat fp32
partitions are the optimizer's own sub-groups (``fp32_partitioned_groups_flat``), each gathered over the process group
DeepSpeed partitions it over (``sub_group_process_groups``: the world for the dense params, the expert-data-parallel
group for an expert sub-group) and cut param by param by ``partition_numel`` (each param's padded part); the module
weights are read inside ``GatheredParameters``. Logits of a fixed probe are recorded (every rank
runs the forward: AutoEP exchanges tokens between the ranks).
"""
import re

import torch

STEPS = 3
TOKENS = 32
NUM_EXPERTS = 4


def mixtral_config():
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=TOKENS, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=NUM_EXPERTS,
                         num_experts_per_tok=2, max_position_embeddings=32)


def probe():
    """The fixed input whose logits the fixture records."""
    return torch.arange(2 * 10).reshape(2, 10) % TOKENS


# ------------------------------------------------------------------------------------------ deepspeed.moe model

HIDDEN = 8


class MoENet(torch.nn.Module):
    """Embedding -> deepspeed.moe MoE layer (4 experts, top-1) -> head."""

    def __init__(self, ep_size):
        from deepspeed.moe.layer import MoE
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(TOKENS, HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 12), torch.nn.GELU(), torch.nn.Linear(12, HIDDEN))
        self.moe = MoE(hidden_size=HIDDEN, expert=expert, num_experts=NUM_EXPERTS, ep_size=ep_size, k=1,
                       min_capacity=4, capacity_factor=2.0)
        self.head = torch.nn.Linear(HIDDEN, TOKENS)

    def forward(self, ids, labels=None):
        h, l_aux, _ = self.moe(self.emb(ids))
        logits = self.head(h)
        if labels is None:
            return logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, TOKENS), labels.reshape(-1))
        return loss + 0.01 * l_aux


# ------------------------------------------------------------------------------------------------ training

def _train(engine, rank, forward):
    generator = torch.Generator().manual_seed(300 + rank)     # every rank is a data-parallel rank of the dense part
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, TOKENS, (2, 10), generator=generator)
        loss = forward(ids)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def moe_worker(spec, out_dir, rank):
    """Train the fixture's model; (engine, losses). spec["truth_extra"] gets the probe's logits and topology."""
    import deepspeed

    ep = spec["ds_config"].get("expert_parallel", {}).get("autoep_size") or spec["ep"]
    if spec["kind"] == "autoep":
        from transformers import MixtralForCausalLM
        torch.manual_seed(0)
        model = MixtralForCausalLM(mixtral_config())
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=spec["ds_config"])
        losses = _train(engine, rank, lambda ids: engine(input_ids=ids, labels=ids).loss)
        run = lambda ids: engine.module(input_ids=ids).logits       # noqa: E731
    else:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        model = MoENet(ep)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=spec["ds_config"])
        losses = _train(engine, rank, lambda ids: engine(ids, ids))
        run = engine.module
    engine.module.eval()
    with torch.no_grad():
        logits = run(probe()).float().detach().cpu()
    engine.module.train()
    spec["truth_extra"] = {"ep": ep, "num_experts": NUM_EXPERTS, "logits": logits}
    return engine, losses


# ------------------------------------------------------------------------------------------------- truth

def _is_expert(p):
    return hasattr(p, "allreduce") and not p.allreduce


def _local_experts(engine):
    """{param name: (global expert ids of this rank's local experts, ep group)} for every expert param.

    AutoEP: the packed `experts.w*` of a layer hold the experts its placement descriptor gives this rank, in order.
    deepspeed.moe: local expert i of ep rank r is global expert r * local + i (its layer files' numbering).
    """
    from deepspeed.utils import groups
    out = {}
    for mname, module in engine.module.named_modules():
        desc = getattr(module, "expert_placement_descriptor", None)
        if desc is not None:        # an AutoEP layer
            from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
            ids = list(autoep_experts_for_rank(desc, module.ep_rank))
            for pname, p in module.experts.named_parameters():
                out[f"{mname}.experts.{pname}"] = (ids, groups._get_expert_parallel_group(p.group_name))
    for name, p in engine.module.named_parameters():
        if _is_expert(p) and name not in out:
            group = groups._get_expert_parallel_group(p.group_name)
            out[name] = (None, group)
    return out


_LOCAL_INDEX = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")


def _global_name(name, ep_rank, num_local):
    """deepspeed.moe: the name of local expert i of ep rank r as its layer files give it (expert r * local + i)."""
    m = _LOCAL_INDEX.search(name)
    return f"{name[:m.start()]}{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}{name[m.end():]}"


def _z3_flat_truth(engine, base, names_by_id, state_names):
    """Full fp32 masters and optimizer states of a ZeRO-3 engine's params, each expert param its rank's local tensor.

    Sub-group i's flat fp32 partition is its params' parts (``partition_numel`` each, the last rank's padded) in
    order; gathered over the sub-group's own process group, a param is its parts concatenated, cut to ``ds_numel``.
    """
    import torch
    import torch.distributed as tdist
    opt = engine.optimizer
    out = {}
    for i, params in enumerate(opt.fp16_groups):
        group = opt.sub_group_process_groups[i]
        world = tdist.get_world_size(group=group)
        flat = opt.fp32_partitioned_groups_flat[i]

        def gather(t, world=world, group=group):     # bound here: the loop rebinds both
            parts = [torch.empty_like(t) for _ in range(world)]
            tdist.all_gather(parts, t.contiguous(), group=group)
            return [part.detach().float().cpu() for part in parts]

        full = {"fp32": gather(flat.data)}
        for s in state_names:
            full[s] = gather(base.state[flat][s])
        offset = 0
        for p in params:
            n = p.partition_numel()
            for key, parts in full.items():
                whole = torch.cat([part[offset:offset + n] for part in parts])[:p.ds_numel]
                out[f"{key}/{names_by_id[id(p)]}"] = whole.view(p.ds_shape).clone().contiguous()
            offset += n
        assert offset == flat.numel(), (offset, flat.numel())
    return out


def _module_state(engine):
    """The module state_dict (under ZeRO-3 inside GatheredParameters: every param whole on every rank)."""
    if engine.zero_optimization_stage() != 3:
        return {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}


def moe_truth(engine, state_names, flat_truth):
    """Full fp32 masters, optimizer states and module weights of an MoE engine, every expert in its global place."""
    import torch.distributed as tdist
    named = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        flat_truth = _z3_flat_truth
    local = flat_truth(engine, engine.optimizer.optimizer, dict((id(p), n) for n, p in named), state_names)
    for k, v in _module_state(engine).items():
        local[f"module/{k}"] = v
    experts = _local_experts(engine)
    num_local = NUM_EXPERTS // tdist.get_world_size(next(iter(experts.values()))[1])
    out = {}
    for key, tensor in local.items():
        state, name = key.split("/", 1)
        if name not in experts:
            out[key] = tensor
            continue
        ids, group = experts[name]
        ep_world = tdist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(ep_world)]
        tdist.all_gather(parts, tensor.contiguous(), group=group)
        every_ids = [None] * ep_world
        tdist.all_gather_object(every_ids, ids, group=group)
        if ids is None:        # deepspeed.moe: one tensor per expert, renamed to its global number
            for r, part in enumerate(parts):
                out[f"{state}/{_global_name(name, r, num_local)}"] = part
        else:                  # AutoEP: packed (local, ...) -> (num_experts, ...)
            full = torch.zeros((NUM_EXPERTS,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
            seen = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
            for part, part_ids in zip(parts, every_ids, strict=True):
                full[torch.tensor(part_ids)] = part
                seen[torch.tensor(part_ids)] += 1
            assert bool((seen == 1).all()), (name, every_ids)
            out[key] = full
    return out
