"""A tiny Megatron-style GPT trained with tensor parallelism through DeepSpeed's `mpu` interface.

Unlike AutoTP, nothing here publishes `universal_checkpoint_info`: the checkpoint says nothing about how
the tensors were cut, as with Megatron-DeepSpeed runs that do not set it. reshard reads it only with
`--layout-rules megatron-gpt`. The model uses Megatron's names and cuts:
vocabulary-parallel word embeddings padded to a multiple of 4*tp rows (37 -> 40) and tied to the output,
fused QKV laid out per head (column parallel), row-parallel attention output and MLP output (their biases
whole), SwiGLU gate and up fused along dim 0 with each rank holding [gate_r; up_r], LayerNorms whole.

Every parameter is initialised as a full tensor (same seed on every rank) and cut by `shard`; `unshard`
puts the ranks' shards back together: the model's own knowledge of its partitioning, which the fixture's
truth uses.
"""
import torch
import torch.distributed as tdist
import torch.nn.functional as F

VOCAB, PADDED, HIDDEN, HEADS, FFN, SEQ = 37, 40, 8, 2, 12, 6
HEAD_DIM = HIDDEN // HEADS
PREFIX = "language_model.encoder.layers.0."

# name -> how it is cut: ("vocab",), ("dim", d), ("heads_qkv",), ("swiglu",), ("whole",)
CUTS = {
    "language_model.embedding.word_embeddings.weight": ("vocab",),
    "language_model.embedding.position_embeddings.weight": ("whole",),
    PREFIX + "input_layernorm.weight": ("whole",),
    PREFIX + "input_layernorm.bias": ("whole",),
    PREFIX + "self_attention.query_key_value.weight": ("dim", 0),
    PREFIX + "self_attention.query_key_value.bias": ("dim", 0),
    PREFIX + "self_attention.dense.weight": ("dim", 1),
    PREFIX + "self_attention.dense.bias": ("whole",),
    PREFIX + "post_attention_layernorm.weight": ("whole",),
    PREFIX + "post_attention_layernorm.bias": ("whole",),
    PREFIX + "mlp.dense_h_to_4h.weight": ("swiglu",),
    PREFIX + "mlp.dense_h_to_4h.bias": ("swiglu",),
    PREFIX + "mlp.dense_4h_to_h.weight": ("dim", 1),
    PREFIX + "mlp.dense_4h_to_h.bias": ("whole",),
    "language_model.encoder.final_layernorm.weight": ("whole",),
    "language_model.encoder.final_layernorm.bias": ("whole",),
}


def full_shapes():
    return {
        "language_model.embedding.word_embeddings.weight": (PADDED, HIDDEN),
        "language_model.embedding.position_embeddings.weight": (SEQ, HIDDEN),
        PREFIX + "self_attention.query_key_value.weight": (3 * HIDDEN, HIDDEN),   # [heads, q|k|v, head_dim]
        PREFIX + "self_attention.query_key_value.bias": (3 * HIDDEN,),
        PREFIX + "self_attention.dense.weight": (HIDDEN, HIDDEN),
        PREFIX + "mlp.dense_h_to_4h.weight": (2 * FFN, HIDDEN),                   # [gate; up]
        PREFIX + "mlp.dense_h_to_4h.bias": (2 * FFN,),
        PREFIX + "mlp.dense_4h_to_h.weight": (HIDDEN, FFN),
    }


def shard(name, full, rank, tp):
    cut = CUTS[name]
    if cut[0] == "whole":
        return full.clone()
    if cut[0] == "vocab":
        return full.chunk(tp, dim=0)[rank].clone()
    if cut[0] == "dim":
        return full.chunk(tp, dim=cut[1])[rank].clone()
    gate, up = full.chunk(2, dim=0)                                   # swiglu
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).clone()


def unshard(name, shards):
    cut = CUTS[name]
    if cut[0] == "whole":
        assert all(torch.equal(shards[0], s) for s in shards), f"{name}: replicas differ"
        return shards[0]
    if cut[0] in ("vocab", "dim"):
        return torch.cat(shards, dim=0 if cut[0] == "vocab" else cut[1])
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


class MPU:
    """What DeepSpeed asks of a model-parallel unit: TP groups of consecutive ranks, DP groups across."""

    def __init__(self, tp):
        world, rank = tdist.get_world_size(), tdist.get_rank()
        self.tp, self.rank = tp, rank
        for start in range(0, world, tp):
            ranks = list(range(start, start + tp))
            group = tdist.new_group(ranks)
            if rank in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        for first in range(tp):
            ranks = list(range(first, world, tp))
            group = tdist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks

    def get_model_parallel_rank(self):
        return self.rank % self.tp

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_model_parallel_world_size(self):
        return self.tp

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.tp_ranks[0]

    def get_data_parallel_rank(self):
        return self.dp_ranks.index(self.rank)

    def get_data_parallel_world_size(self):
        return len(self.dp_ranks)

    def get_data_parallel_group(self):
        return self.dp_group

    def get_pipeline_model_parallel_world_size(self):
        return 1


class _CopyToTP(torch.autograd.Function):       # Megatron's f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):   # Megatron's g: all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        tdist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):  # every rank gets all columns; backward keeps its own
    @staticmethod
    def forward(ctx, x, group, rank, tp):
        ctx.rank, ctx.tp = rank, tp
        parts = [torch.empty_like(x) for _ in range(tp)]
        tdist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp, dim=-1)[ctx.rank].contiguous(), None, None, None


class MegatronGPT(torch.nn.Module):

    def __init__(self, mpu, seed=11):
        super().__init__()
        self.mpu, tp, rank = mpu, mpu.tp, mpu.get_model_parallel_rank()
        generator = torch.Generator().manual_seed(seed)
        shapes = full_shapes()
        self._names = {}
        for name in CUTS:
            leaf = name.rsplit(".", 1)[1]
            shape = shapes.get(name) or (HIDDEN,)
            if "layernorm" in name:
                full = torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
                full = full + 0.05 * torch.randn(shape, generator=generator)
            else:
                full = 0.2 * torch.randn(shape, generator=generator)
            param = torch.nn.Parameter(shard(name, full, rank, tp))
            attr = name.replace(".", "__")
            self.register_parameter(attr, param)
            self._names[attr] = name

    def state_dict(self, *args, **kwargs):       # Megatron's dotted names
        return type(super().state_dict())((self._names.get(k, k), v)
                                          for k, v in super().state_dict(*args, **kwargs).items())

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for k, v in super().named_parameters(prefix, recurse, remove_duplicate):
            yield self._names.get(k, k), v

    def p(self, name):
        return getattr(self, name.replace(".", "__"))

    def forward(self, tokens):
        group, tp, rank = self.mpu.tp_group, self.mpu.tp, self.mpu.get_model_parallel_rank()
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        # vocabulary-parallel embedding: look up the local rows, zero the others, sum over ranks
        emb = self.p("language_model.embedding.word_embeddings.weight")
        lo = rank * emb.shape[0]
        local = inp - lo
        outside = (local < 0) | (local >= emb.shape[0])
        h = F.embedding(local.clamp(0, emb.shape[0] - 1), emb) * (~outside).unsqueeze(-1)
        h = _ReduceFromTP.apply(h, group) + self.p("language_model.embedding.position_embeddings.weight")[:inp.shape[1]]
        # attention: heads split over ranks
        x = F.layer_norm(h, (HIDDEN,), self.p(PREFIX + "input_layernorm.weight"),
                         self.p(PREFIX + "input_layernorm.bias"))
        qkv = F.linear(_CopyToTP.apply(x, group), self.p(PREFIX + "self_attention.query_key_value.weight"),
                       self.p(PREFIX + "self_attention.query_key_value.bias"))
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, -1, 3, HEAD_DIM).unbind(3)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        att = att.transpose(1, 2).reshape(b, t, -1)
        h = h + _ReduceFromTP.apply(F.linear(att, self.p(PREFIX + "self_attention.dense.weight")), group) \
            + self.p(PREFIX + "self_attention.dense.bias")
        # SwiGLU MLP: [gate_r; up_r] column parallel, output row parallel
        x = F.layer_norm(h, (HIDDEN,), self.p(PREFIX + "post_attention_layernorm.weight"),
                         self.p(PREFIX + "post_attention_layernorm.bias"))
        gate, up = F.linear(_CopyToTP.apply(x, group), self.p(PREFIX + "mlp.dense_h_to_4h.weight"),
                            self.p(PREFIX + "mlp.dense_h_to_4h.bias")).chunk(2, dim=-1)
        h = h + _ReduceFromTP.apply(F.linear(F.silu(gate) * up, self.p(PREFIX + "mlp.dense_4h_to_h.weight")), group) \
            + self.p(PREFIX + "mlp.dense_4h_to_h.bias")
        h = F.layer_norm(h, (HIDDEN,), self.p("language_model.encoder.final_layernorm.weight"),
                         self.p("language_model.encoder.final_layernorm.bias"))
        logits = _GatherLastDim.apply(F.linear(_CopyToTP.apply(h, group), emb), group, rank, tp)[..., :VOCAB]
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), tgt.reshape(-1))


def megatron_truth(engine, mpu, state_names):
    """Full fp32 masters, optimizer states and module weights: each TP rank's (DP-gathered) tensors are
    gathered over the TP group and put together by the model's own `unshard`."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from fixture_parallel import _gather
    out = {}
    module = dict(engine.module.state_dict())
    for name, p in engine.module.named_parameters():
        pieces = {"fp32": safe_get_full_fp32_param(p), "module": module[name]}
        for s in state_names:
            pieces[s] = safe_get_full_optimizer_state(p, s)
        for key, local in pieces.items():
            local = local.detach().cpu() if key == "module" else local.detach().float().cpu()
            out[f"{key}/{name}"] = unshard(name, _gather(local, mpu.tp_group)).clone().contiguous()
    return out


def megatron_worker(spec, out_dir, rank):
    import deepspeed
    mpu = MPU(tp=2)
    model = MegatronGPT(mpu)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=spec["ds_config"], mpu=mpu)
    generator = torch.Generator().manual_seed(300 + mpu.get_data_parallel_rank())
    losses = []
    for _ in range(3):
        batch = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return engine, losses
