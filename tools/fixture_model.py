"""Tiny model used to generate the DeepSpeed checkpoint fixtures in ``fixtures/``.

Shared by ``tools/make_fixtures.py`` (which trains it with the real DeepSpeed engine) and by tests that want
to rebuild the module from a converted state dict.  Only torch is needed to import this file.

Parameters (1399 trainable elements in the base variant)::

    emb   Embedding(37, 12)            emb.weight   (37, 12)
    l1    Linear(12, 19)               l1.weight    (19, 12), l1.bias (19,)
    l2    Linear(19, 12)               l2.weight    (12, 19), l2.bias (12,)
    norm  LayerNorm(12)                norm.weight  (12,),    norm.bias (12,)
    head  Linear(12, 37, bias=False)   head.weight  (37, 12)

Buffers: ``pos`` (int64, persistent), ``scale`` (float, persistent), ``tmp`` (float, non-persistent).

Variants: ``tied=True`` makes ``head.weight`` the very same Parameter as ``emb.weight``;
``frozen=True`` freezes ``l2`` (weight and bias).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 37
HIDDEN = 12
FFN = 19
NPOS = 5
SEQ_LEN = NPOS + 1  # tokens per sample; the model predicts tokens[:, 1:] from tokens[:, :-1]

MODEL_SEED = 1234
DATA_SEED = 4321


class FixtureModel(nn.Module):

    def __init__(self, tied: bool = False, frozen: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.l1 = nn.Linear(HIDDEN, FFN)
        self.l2 = nn.Linear(FFN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("pos", torch.arange(NPOS, dtype=torch.int64))
        self.register_buffer("scale", torch.tensor([1.0, 0.5, 0.25], dtype=torch.float32))
        self.register_buffer("tmp", torch.full((4, ), 7.0), persistent=False)
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.l2.requires_grad_(False)
        self.tied = tied
        self.frozen = frozen

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Returns the mean next-token cross-entropy loss of ``tokens`` (B, SEQ_LEN) int64."""
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        h = self.emb(inp)
        # use the buffers so they are part of the computation (pos: positional signal, scale: gain)
        posf = self.pos[:inp.shape[1]].to(h.dtype)
        h = h + 0.01 * posf[None, :, None]
        h = h * (self.scale.sum() / 1.75).to(h.dtype)
        h = h + self.l2(F.gelu(self.l1(h)))
        h = self.norm(h)
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), tgt.reshape(-1))


def build_model(tied: bool = False, frozen: bool = False, seed: int = MODEL_SEED) -> FixtureModel:
    """Deterministically initialised model (same on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FixtureModel(tied=tied, frozen=frozen)


def param_groups(model: nn.Module, two_groups: bool = False):
    """Optimizer param groups as passed to ``deepspeed.initialize(model_parameters=...)``.

    Returns ``(groups, names)``: ``groups`` is a list of dicts (or a plain list of params when
    ``two_groups`` is False) and ``names`` a list (one per group) of parameter names. Only trainable
    parameters are included; a tied parameter appears once under its first name (``emb.weight``).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not two_groups:
        return [p for _, p in named], [[n for n, _ in named]]
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    groups = [
        {"params": [p for _, p in decay], "weight_decay": 0.1},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    return groups, [[n for n, _ in decay], [n for n, _ in no_decay]]


def make_batch(step: int, rank: int, micro_batch: int = 2, seed: int = DATA_SEED) -> torch.Tensor:
    """Deterministic (micro_batch, SEQ_LEN) int64 token batch for a given step and data-parallel rank."""
    g = torch.Generator().manual_seed(seed * 100003 + step * 1009 + rank)
    return torch.randint(0, VOCAB, (micro_batch, SEQ_LEN), generator=g, dtype=torch.int64)
