"""Tensor- and pipeline-parallel fixtures (run under torchrun by tools/make_fixtures.py).

* ``autotp``: a tiny random ``transformers`` Llama trained with ``"tensor_parallel": {"autotp_size": 2}``
  at dp=2 (4 ranks). Every rank holds TP shards of the sharded layers.
* ``pipe``: a ``deepspeed.pipe.PipelineModule`` (a tied embedding via ``TiedLayerSpec`` at both ends) at
  pp=2, dp=2 (4 ranks), trained with ``train_batch``; with ``"model": "tied_head"`` the PipelineModule of
  ``tied_head_module`` (the tied embedding used again as the head through a ``forward_fn``, which saves no layer
  file; DeepSpeed's default ``partition_method="parameters"``).

Truth, taken from the live engine (see the docstring of ``autotp_truth`` / ``pipe_truth`` for how the
per-rank pieces are assembled with the engine's own knowledge of the partitioning).
"""
import contextlib
import os

import torch

STEPS = 3
TOKENS = 48


# --------------------------------------------------------------------------------------------- AutoTP Llama

def llama_config(tied, uneven=False):
    """uneven: 3 key-value heads (6 query heads) over tp=2, which AutoTP splits 2 + 1 heads."""
    from transformers import LlamaConfig
    heads, kv_heads, hidden = (6, 3, 24) if uneven else (4, 2, 16)
    return LlamaConfig(vocab_size=TOKENS, hidden_size=hidden, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                       tie_word_embeddings=tied)


def probe():
    """The fixed input whose logits the fixture records."""
    return torch.arange(2 * 10).reshape(2, 10) % TOKENS


def _gather(t, group):
    """Every rank's `t` (shapes may differ: uneven AutoTP shards), gathered over `group`."""
    import torch.distributed as tdist
    world = tdist.get_world_size(group=group)
    shapes = [None] * world
    tdist.all_gather_object(shapes, tuple(t.shape), group=group)
    longest = max(torch.Size(s).numel() for s in shapes)
    flat = torch.zeros(longest, dtype=t.dtype)
    flat[:t.numel()] = t.reshape(-1)
    parts = [torch.empty_like(flat) for _ in range(world)]
    tdist.all_gather(parts, flat, group=group)
    return [p[:torch.Size(s).numel()].reshape(s) for p, s in zip(parts, shapes, strict=True)]


def autotp_truth(engine, state_names):
    """Full fp32 masters, optimizer states and module weights of an AutoTP engine.

    Per parameter: `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` give this TP rank's
    shard gathered over its data-parallel group; the shards of all TP ranks are all-gathered over the
    TP group and put together with the affine map the AutoTP layer attached to the parameter
    (`ds_autotp_universal_checkpoint_meta`: the layer's own record of which block of the full tensor
    each rank holds); `ParamAffineMap.rebuild` checks that replicated blocks agree across ranks.
    Module weights come from `GatherReplacedLayerParams`, the engine's own gather for 16-bit saves, an
    independent path (cat along the partition dim) that the masters are compared with in fp32.
    """
    from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    tp_group = groups.get_tensor_model_parallel_group()
    out = {}
    for name, p in engine.module.named_parameters():
        meta = (getattr(p, "ds_autotp_universal_checkpoint_meta", None) or {}).get("conversion") or {}
        amap = meta.get("affine_map")
        pieces = {"fp32": safe_get_full_fp32_param(p)}
        for s in state_names:
            pieces[s] = safe_get_full_optimizer_state(p, s)
        for key, local in pieces.items():
            local = local.detach().float().cpu()
            shards = _gather(local, tp_group)
            if amap is None:   # untouched by AutoTP: replicated, must be equal on every TP rank
                assert all(torch.equal(shards[0], s) for s in shards), (name, key)
                full = shards[0]
            else:
                full = ParamAffineMap.from_dict(amap).rebuild(dict(enumerate(shards)),
                                                              scale_power=SCALE_POWER_BY_STATE.get(key, 1))
            out[f"{key}/{name}"] = full.clone().contiguous()
    with contextlib.ExitStack() as stack:      # every replaced layer gathers its own params (collective)
        gathered = set()    # a tied weight is gathered once, by the first module holding it
        for module in engine.module.modules():
            params = [p for p in module.parameters(recurse=False) if id(p) not in gathered]
            gathered.update(id(p) for p in params)
            stack.enter_context(GatherReplacedLayerParams(params, module, enabled=bool(params)))
        sd = {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}
    for k, v in sd.items():
        out[f"module/{k}"] = v
    return out


def autotp_worker(spec, out_dir, rank):
    import deepspeed
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(spec["tied"], spec.get("uneven", False)))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=spec["ds_config"])
    dp_rank = groups.get_data_parallel_rank()
    generator = torch.Generator().manual_seed(100 + dp_rank)    # TP ranks of a DP group see the same batch
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, TOKENS, (2, 10), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    engine.module.eval()
    with torch.no_grad():
        logits = engine.module(input_ids=probe()).logits.float()
    if logits.shape[-1] != TOKENS:   # a vocabulary-parallel lm_head (tied embeddings) gives each rank its columns
        logits = torch.cat(_gather(logits, groups.get_tensor_model_parallel_group()), dim=-1)
    engine.module.train()
    if rank == 0:
        engine.module.config.save_pretrained(os.path.join(out_dir, "hf_config"))
        torch.save(logits.detach().cpu(), os.path.join(out_dir, "logits.pt"))
    return engine, losses


# ------------------------------------------------------------------------------------------------- Pipeline

VOCAB, HIDDEN = 29, 12


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)
        self.register_buffer("rb", torch.arange(3, dtype=torch.int64))

    def forward(self, x):
        if x.dtype == torch.long:           # the first occurrence embeds tokens
            return torch.nn.functional.embedding(x, self.weight)
        return x @ self.weight.t()            # the last one projects back to the vocabulary


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, width)
        self.out = torch.nn.Linear(width, HIDDEN)

    def forward(self, h):
        return h + self.out(torch.nn.functional.gelu(self.fc(h)))


def pipe_module(num_stages, partition_method="uniform"):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))

    torch.manual_seed(7)
    layers = [TiedLayerSpec("emb", Embed, tied_weight_attr="weight"),
              LayerSpec(Block, 10),
              LayerSpec(torch.nn.LayerNorm, HIDDEN),
              LayerSpec(Block, 6),
              TiedLayerSpec("emb", Embed, tied_weight_attr="weight")]
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn,
                          partition_method=partition_method)


def embed_head(module, h):
    """The head of tied_head_module: the embedding's weight projects back to the vocabulary."""
    return h @ module.weight.t()


class TiedEmbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

    def forward(self, x):
        return torch.nn.functional.embedding(x, self.weight)


TIED_HEAD_WIDTHS = (2, 4, 6, 20)


def tied_head_specs():
    """The layers of tied_head_module: the embedding tied to the head on the last stage (Megatron-DeepSpeed's
    GPT pattern), layer 6 a `forward_fn` of the tied module, which the engine saves no layer file for. 4 blocks
    of uneven width and a LayerNorm weigh [348, 62, 112, 162, 512, 24, 348] trainable elements: 'parameters'
    cuts pp=2 as 'uniform' does ([0, 4, 7]) but pp=4 otherwise ([0, 1, 4, 5, 7] against [0, 2, 4, 6, 7])."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    layers = [TiedLayerSpec("emb", TiedEmbed, tied_weight_attr="weight")]
    layers += [LayerSpec(Block, width) for width in TIED_HEAD_WIDTHS]
    return layers + [LayerSpec(torch.nn.LayerNorm, HIDDEN),
                     TiedLayerSpec("emb", TiedEmbed, forward_fn=embed_head, tied_weight_attr="weight")]


def tied_head_module(num_stages, partition_method="parameters"):
    from deepspeed.pipe import PipelineModule

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))

    torch.manual_seed(11)
    return PipelineModule(layers=tied_head_specs(), num_stages=num_stages, loss_fn=loss_fn,
                          partition_method=partition_method)


def pipe_model(spec, num_stages, partition_method=None):
    """The PipelineModule of a pipe fixture, cut into `num_stages` (by its own partition method unless named)."""
    if spec.get("model") == "tied_head":
        return tied_head_module(num_stages, partition_method or "parameters")
    return pipe_module(num_stages, partition_method or "uniform")


def pipe_truth(engine, state_names, flat_truth):
    """Full fp32 masters, optimizer states and module weights of a PipelineModule engine.

    Each stage's ZeRO-1/2 optimizer only holds that stage's params: `flat_truth` (the reader of the
    live flat buffers of make_fixtures.py) gathers them over the stage's data-parallel group, under the
    stage's PipelineModule names (`1.fc.weight`, `tied_modules.emb.weight`). The stages' dictionaries are
    then gathered on every rank (all_gather_object over the world); a tied weight held by several
    stages must be equal everywhere (the engine all-reduces its gradient over the tied group).
    """
    import torch.distributed as tdist
    named = list(engine.module.named_parameters())
    local = flat_truth(engine, engine.optimizer.optimizer, dict((id(p), n) for n, p in named), state_names)
    for k, v in engine.module.state_dict().items():
        local[f"module/{k}"] = v.detach().cpu().clone().contiguous()
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, local)
    out = {}
    for part in every:
        for k, v in part.items():
            if k in out:
                assert torch.equal(out[k], v), f"{k} differs between stages"
            out[k] = v
    return out


def pipe_worker(spec, out_dir, rank):
    import deepspeed
    net = pipe_model(spec, num_stages=2)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                           config=spec["ds_config"])
    dp_rank = engine.grid.data_parallel_id
    generator = torch.Generator().manual_seed(200 + dp_rank)
    batches = [torch.randint(0, VOCAB, (2, 7), generator=generator) for _ in range(STEPS * 2)]

    def data():
        for b in batches:
            yield b[:, :-1].contiguous(), b[:, 1:].contiguous()
    it = data()
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(STEPS)]
    return engine, losses
