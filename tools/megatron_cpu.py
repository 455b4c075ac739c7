"""Run megatron-core (0.16) on CPU over gloo: the CUDA calls its training and checkpointing code makes, answered
on the CPU. For the fixture tool and tests only; nothing in the reshard package imports it.

`install()` must run before megatron.core is imported. What it patches, each found necessary on this machine:
1. the CUDA RNG (Megatron's RNG tracker: torch.cuda.get_rng_state / manual_seed, tensor_parallel.random's
   _get/_set_cuda_rng_state) backed by a CPU generator of its own;
2. torch.cuda.current_device -> 0 (the param and grad buffers allocate on it);
3. torch.cuda.synchronize / empty_cache -> no-ops (pipeline p2p communication);
4. a TorchFunctionMode mapping device='cuda' (or a device index) to the CPU, Tensor.cuda() a no-op, and
   Tensor.type() reporting torch.cuda.*Tensor (the optimizer checks that params are CUDA tensors);
5. torch.cuda streams and events as no-op objects; the backward pass under the mode of 4 too (a mode is off while
   its handler runs, and torch.autograd.backward reaches it);
6. a `fully_reshardable` load into torch's AdamW (megatron-core's fallback without Transformer Engine or Apex): the
   distributed optimizer copies every state its local optimizer holds from the loaded ones, and torch's AdamW holds a
   per-parameter `step` the save does not (TE's and Apex's FusedAdam keep it in the param groups): KeyError 'step'.
   The parameter keeps the step it has (the load restores it from the param groups).
7. the MoE router without Transformer Engine: 0.16.1's moe_utils names `te_general_gemm` only where TE imports, and
   its router gating asks `te_general_gemm is not None` (NameError): it is made None, the torch matmul path.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_GENERATOR = torch.Generator()     # stands in for the CUDA default generator
_installed = False


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _OnCpu(TorchFunctionMode):
    """Every `device=` a torch function is given that names CUDA (or a bare index) becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _cpu(args[1]) if not isinstance(args[1], torch.dtype) else args[1], *args[2:])
        return func(*args, **kwargs)


class _NoOp:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _type(original):
    def patched(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)       # (through the mode, which may call this again: once is enough)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)
    return patched


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda *a, **k: _GENERATOR.get_state()
    cuda.set_rng_state = lambda state, *a, **k: _GENERATOR.set_state(state)
    cuda.manual_seed = lambda seed: _GENERATOR.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: _GENERATOR.manual_seed(seed)
    cuda.current_stream = lambda *a, **k: _NoOp()
    cuda.default_stream = lambda *a, **k: _NoOp()
    cuda.Stream = _NoOp
    cuda.Event = _NoOp
    cuda.stream = lambda *a, **k: _NoOp()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = _type(torch.Tensor.type)
    _OnCpu().__enter__()      # for the life of the process
    # A mode is off while its handler runs, and torch.autograd.backward reaches the handler: the backward pass (where
    # the MoE dispatcher's gathers allocate on the current device) runs under a mode of its own
    from torch import autograd
    engine = autograd._engine_run_backward

    def run_backward(*args, **kwargs):
        with _OnCpu():
            return engine(*args, **kwargs)
    autograd._engine_run_backward = run_backward
    from megatron.core.optimizer import distrib_optimizer
    setter = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group, order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group]["params"][order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return setter(self, model_param, tensors)
    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: _GENERATOR.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: _GENERATOR.set_state(state)
