"""Import torchtitan (0.3.0) on a CPU-only torch: for the fixture tool and tests only; nothing in the reshard package
imports it.

torchtitan.models imports its MoE expert-parallel kernels (torchtitan/distributed/minimal_async_ep/kernels.py), which
import triton unconditionally; the CPU build of torch ships without triton (pip's wheel of it is 286 MB), and a
fake `triton` package breaks torch itself (torch._inductor imports triton.backends when it finds one). `install()`
puts a module in that kernels module's place whose functions refuse: a dense Llama never calls them (they serve
expert parallelism on GPUs). It must run before torchtitan.models is imported.

Why torchtitan's own Trainer does not run here (established on this machine with torch 2.13.0+cpu): its device is
`torchtitan.tools.utils.device_type`, which is `_get_available_device_type() or "cuda"`, so on a machine without an
accelerator the Trainer calls `torch.cuda.set_device` ("Torch not compiled with CUDA enabled"), builds its device
mesh on "cuda" and its process group with NCCL; its metrics need tensorboard and its data loader Hugging Face
datasets and a tokenizer. The fixture therefore drives torchtitan's own components below the Trainer (the model, its
FSDP2 wrapping, OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader, CheckpointManager).
"""
from __future__ import annotations

import sys
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
         "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
         "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def _refuse(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{KERNELS}.{name} is a triton kernel: not available on this CPU-only torch")
    return kernel


def install() -> None:
    if KERNELS in sys.modules:
        return
    module = types.ModuleType(KERNELS, "stand-in for torchtitan's triton expert-parallel kernels (CPU tests)")
    for name in NAMES:
        setattr(module, name, _refuse(name))
    sys.modules[KERNELS] = module


# The run the fixture saves and the tests resume: a tiny Llama 3 of torchtitan's own model code (grouped-query
# attention; QKV fused as every llama3 flavor has it, or three projections: `fuse_qkv`), fp32, FSDP2 over all ranks.
# Attention: torchtitan's own ScaledDotProductAttention module (causal), the maskless backend its Trainer supports
# (trainer.py: "the SDPA config used by the graph_trainer tests"), in place of the FlexAttention its llama3 flavors
# name: FlexAttention has no backward on CPU ("FlexAttention does not support backward on CPU", torch 2.13). On one
# document of causal tokens the two compute the same attention; the checkpoint's keys and shapes do not depend on it.
DIM, HEADS, KV_HEADS, LAYERS, HIDDEN, VOCAB, SEQ, BATCH = 16, 4, 2, 2, 32, 64, 8, 2
ROPE_THETA, NORM_EPS, LR, WARMUP, STEPS = 10000.0, 1e-5, 1e-2, 2, 10
SAMPLES = 64


def model_config(fuse_qkv: bool, dim: int = DIM, heads: int = HEADS):
    """The fixture's model config; `dim` and `heads` another width and head count (a head size other than 4)."""
    install()
    import torch
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    normal = {"weight": torch.nn.init.normal_}
    ones = {"weight": torch.nn.init.ones_}
    layers = _build_llama3_layers(n_layers=LAYERS, dim=dim, n_heads=heads, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN,
                                  rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=4 * SEQ, theta=ROPE_THETA,
                                                          scaling="none"),
                                  fuse_qkv=fuse_qkv, attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=normal),
        norm=RMSNorm.Config(normalized_shape=dim, eps=NORM_EPS, param_init=ones),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init={"weight": torch.nn.init.normal_, "bias": torch.nn.init.zeros_}),
        layers=layers)


def build_model(mesh, fuse_qkv: bool):
    """The model with torchtitan's own FSDP2 wrapping (apply_fsdp_to_decoder, as parallelize_llama calls it) on
    `mesh`; every rank draws the same initial weights (seed 0) before the wrapping shards them. torchtitan turns
    FSDP's gradient division off (disable_fsdp_gradient_division: factor 1.0, it scales by the global token count
    itself), which FSDP2 reduces with PREMUL_SUM, an op gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"):
    FSDP2's own switch to a plain SUM (set_force_sum_reduction_for_comms) is the same sum for a factor of 1."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
    torch.manual_seed(0)
    model = model_config(fuse_qkv).build()
    model.init_states()
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    disable_fsdp_gradient_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


class TrainState:
    """The Trainer's own checkpoint entry "train_state" (torchtitan/trainer.py: Trainer.state_dict and
    load_state_dict, the same two counters): the Trainer itself cannot be built on a CPU-only torch."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def components(folder: str, *, fuse_qkv: bool, exclude_from_loading=(), initial_load_path: str | None = None,
               last_save_model_only: bool = False):
    """(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer) at this process group's world size,
    the checkpoint manager saving to and loading from `folder`/step-N; with `initial_load_path` (a step-N folder) and
    no step in `folder`, its load() loads that folder's model alone (checkpoint.initial_load_model_only, its
    default); `last_save_model_only`: its save(step, last_step=True) writes the model's state dict alone."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build_model(mesh, fuse_qkv)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": LR, "weight_decay": 0.1, "betas": (0.9, 0.95),
                                                         "eps": 1e-8})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=WARMUP).build(optimizers=optimizers,
                                                                           training_steps=STEPS)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))
    dataset = [tokens[i] for i in range(rank, SAMPLES, world)]     # each data-parallel rank its own samples
    dataloader = ParallelAwareDataloader(dataset, dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                                            last_save_model_only=last_save_model_only,
                                            initial_load_path=initial_load_path,
                                            exclude_from_loading=list(exclude_from_loading)).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None)
    return model, optimizers, lr_schedulers, dataloader, train_state, checkpointer


def forward(model, tokens):
    """torchtitan's forward of `tokens` as its Trainer calls it with a maskless attention (positions for RoPE)."""
    import torch
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    return model(tokens, positions=positions)


def train_steps(model, optimizers, lr_schedulers, batches, train_state, steps: int) -> list:
    """`steps` training steps as the Trainer takes them (cross-entropy, optimizer then scheduler step); the losses."""
    import torch
    losses = []
    for _ in range(steps):
        batch = next(batches)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        optimizers.zero_grad()
        logits = forward(model, inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        train_state.step += 1
        train_state.ntokens_seen += labels.numel()
        losses.append(loss.item())
    return losses
