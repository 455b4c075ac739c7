"""Tensor AND pipeline parallel: a PipelineModule of Megatron-style tensor-parallel layers (GPTModelPipe's
layout) trained at tp2 x pp2 x dp2 through DeepSpeed's PipeModelDataParallelTopology.

Layers (uniform partition at pp=2: stage 0 = layers 0-2, stage 1 = layers 3-5):
  0  TiedLayerSpec("embed")  word_embeddings.weight, vocabulary parallel (37 -> 40 rows, cut by rows)
  1  PositionPipe            position_embeddings.weight, whole on every TP rank
  2  TransformerLayerPipe    fused QKV (column), dense (row), SwiGLU dense_h_to_4h ([gate_r; up_r]), dense_4h_to_h (row)
  3  TransformerLayerPipe
  4  FinalNormPipe           final_layernorm, whole
  5  TiedLayerSpec("embed")  the same word embeddings projecting back to the (gathered) vocabulary
Each parameter is initialised full (one seed per layer) and cut with fixture_megatron's `shard`; the truth puts
the TP ranks' tensors back together with its `unshard`, keyed by the Megatron name the local name ends with.
"""
import torch
import torch.distributed as tdist
import torch.nn.functional as F

from fixture_megatron import (
    CUTS,
    HEAD_DIM,
    HIDDEN,
    SEQ,
    VOCAB,
    _CopyToTP,
    _GatherLastDim,
    _ReduceFromTP,
    full_shapes,
    shard,
    unshard,
)

TP, PP, DP = 2, 2, 2
STEPS = 3
LAYER_TYPES = ["EmbeddingPipe", "PositionPipe", "TransformerLayerPipe", "TransformerLayerPipe", "FinalNormPipe",
               "EmbeddingPipe"]
_TP = {}     # the tensor-parallel rank, degree and group: set before the layers are built / run


def _copy(x):        # Megatron's f / g / gather; no collective at all without tensor parallelism
    return _CopyToTP.apply(x, _TP["group"]) if _TP["tp"] > 1 else x


def _reduce(x):
    return _ReduceFromTP.apply(x, _TP["group"]) if _TP["tp"] > 1 else x


def _gather_last(x):
    return _GatherLastDim.apply(x, _TP["group"], _TP["rank"], _TP["tp"]) if _TP["tp"] > 1 else x


def megatron_name(local):
    """The fixture_megatron CUTS key a layer's local parameter name ends with."""
    found = [k for k in CUTS if k.endswith("." + local)]
    assert len(found) == 1, local
    return found[0]


def _param(module, local, seed):
    name = megatron_name(local)
    shape = full_shapes().get(name) or (HIDDEN,)
    generator = torch.Generator().manual_seed(seed)
    if "layernorm" in name:
        full = (torch.ones(shape) if local.endswith("weight") else torch.zeros(shape)) + 0.05 * torch.randn(
            shape, generator=generator)
    else:
        full = 0.2 * torch.randn(shape, generator=generator)
    owner = module
    *path, leaf = local.split(".")
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    owner.register_parameter(leaf, torch.nn.Parameter(shard(name, full, _TP["rank"], _TP["tp"])))


class EmbeddingPipe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _param(self, "word_embeddings.weight", 101)

    def forward(self, x):
        emb = self.word_embeddings.weight
        if x.dtype == torch.long:         # first use: vocabulary-parallel lookup, summed over the TP ranks
            local = x - _TP["rank"] * emb.shape[0]
            outside = (local < 0) | (local >= emb.shape[0])
            return _reduce(F.embedding(local.clamp(0, emb.shape[0] - 1), emb) * (~outside).unsqueeze(-1))
        return _gather_last(F.linear(_copy(x), emb))[..., :VOCAB]      # last use: the tied output layer


class PositionPipe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _param(self, "position_embeddings.weight", 102)

    def forward(self, h):
        return h + self.position_embeddings.weight[:h.shape[1]]


class TransformerLayerPipe(torch.nn.Module):
    LOCALS = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.query_key_value.weight",
              "self_attention.query_key_value.bias", "self_attention.dense.weight", "self_attention.dense.bias",
              "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_h_to_4h.weight",
              "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"]

    def __init__(self, seed):
        super().__init__()
        for i, local in enumerate(self.LOCALS):
            _param(self, local, seed * 100 + i)

    def forward(self, h):
        attn, mlp = self.self_attention, self.mlp
        x = F.layer_norm(h, (HIDDEN,), self.input_layernorm.weight, self.input_layernorm.bias)
        qkv = F.linear(_copy(x), attn.query_key_value.weight, attn.query_key_value.bias)
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, -1, 3, HEAD_DIM).unbind(3)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        att = att.transpose(1, 2).reshape(b, t, -1)
        h = h + _reduce(F.linear(att, attn.dense.weight)) + attn.dense.bias
        x = F.layer_norm(h, (HIDDEN,), self.post_attention_layernorm.weight, self.post_attention_layernorm.bias)
        gate, up = F.linear(_copy(x), mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias).chunk(2, -1)
        return h + _reduce(F.linear(F.silu(gate) * up, mlp.dense_4h_to_h.weight)) + mlp.dense_4h_to_h.bias


class FinalNormPipe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _param(self, "final_layernorm.weight", 103)
        _param(self, "final_layernorm.bias", 104)

    def forward(self, h):
        return F.layer_norm(h, (HIDDEN,), self.final_layernorm.weight, self.final_layernorm.bias)


def topology(tp=TP, pp=PP, dp=DP):
    """Megatron's 3D grid; without tensor parallelism a PipelineModule's plain pipe x data grid (no model axis:
    layer files without `-model_TT`)."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
    if tp == 1:
        return PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def pipe_module(topo, partition_method="uniform"):
    """The PipelineModule on `topo` (any tp/pp/dp: the layers cut themselves by the topology's model axis)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))

    tp = topo.get_dim("model") if "model" in topo.get_axis_names() else 1
    _TP.update(tp=tp, rank=topo.get_coord(tdist.get_rank()).model if tp > 1 else 0)
    layers = [TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr=["word_embeddings.weight"]),
              LayerSpec(PositionPipe), LayerSpec(TransformerLayerPipe, 1), LayerSpec(TransformerLayerPipe, 2),
              LayerSpec(FinalNormPipe),
              TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr=["word_embeddings.weight"])]
    net = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method=partition_method)
    _TP["group"] = net.mpu().get_slice_parallel_group() if tp > 1 else None
    return net


def batches(dp_rank, count):
    generator = torch.Generator().manual_seed(400 + dp_rank)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator) for _ in range(count)]


def data_iter(items):
    for b in items:
        yield b[:, :-1].contiguous(), b[:, 1:].contiguous()


def megatron_pipe_worker(spec, out_dir, rank):
    import deepspeed
    net = pipe_module(topology())
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                           config=spec["ds_config"])
    it = data_iter(batches(engine.grid.data_parallel_id, STEPS * spec["ds_config"]["gradient_accumulation_steps"]))
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(STEPS)]
    return engine, losses


def unshard_name(name):
    """The Megatron cut of a PipelineModule parameter name ('2.mlp.dense_h_to_4h.weight',
    'tied_modules.embed.word_embeddings.weight')."""
    local = name.split(".", 2)[2] if name.startswith("tied_modules.") else name.split(".", 1)[1]
    return megatron_name(local)


def megatron_pipe_truth(engine, state_names, flat_truth):
    """Full tensors: each stage's DP-gathered local tensors (flat_truth, as fixture_parallel.pipe_truth) are
    gathered over the TP group and unsharded, then the stages' dicts are gathered on every rank."""
    from fixture_parallel import _gather
    named = list(engine.module.named_parameters())
    local = flat_truth(engine, engine.optimizer.optimizer, dict((id(p), n) for n, p in named), state_names)
    for k, v in engine.module.state_dict().items():
        local[f"module/{k}"] = v.detach().cpu().clone().contiguous()
    if _TP["tp"] > 1:
        full = {k: unshard(unshard_name(k.split("/", 1)[1]), _gather(v, _TP["group"])).clone().contiguous()
                for k, v in sorted(local.items())}
    else:
        full = local
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, full)
    out = {}
    for part in every:
        for k, v in part.items():
            if k in out:
                assert torch.equal(out[k], v), f"{k} differs between ranks"
            out[k] = v
    return out
