"""Test-only: let Accelerate (and so the Hugging Face Trainer) run FSDP on CPU, as it does on GPUs.

Accelerate picks FSDP only for GPU-like devices: on CPU under torchrun its state is MULTI_CPU (gloo) and an FSDP
plugin given to it is dropped, so the Trainer trains plain DDP and saves DDP's files. `fsdp_on_cpu()` turns a
MULTI_CPU state given an FSDP plugin into FSDP with that plugin, exactly what the GPU branch of
AcceleratorState.__init__ does (accelerate 1.15, state.py); everything after it (wrapping the model, saving
`pytorch_model_fsdp_0/` and `optimizer_0/` with torch.distributed.checkpoint) is Accelerate's own code.
Never imported by the package.
"""
from __future__ import annotations


def fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # FSDP: the process's state still marked by an earlier Accelerator of this shim (a state reset keeps it)
        if fsdp_plugin is not None and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP):
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState.__init__ = __init__


def lightning_fsdp_on_cpu(strategy_class):
    """Lightning's FSDPStrategy on CPU, as on GPUs (lightning 2.6.6, torch 2.13): a subclass of `strategy_class`
    (FSDPStrategy), since Lightning refuses only the class itself off CUDA (the accelerator connector's
    `type(strategy) is FSDPStrategy` check), and FSDP1 told the CPU is its device where Lightning gives none (it
    passes the CPU device's index, None, and FSDP1 then looks for an accelerator and refuses to run without one).
    For state_dict_type="full", Lightning's full state dict context asks FSDP1 to offload to CPU, which on a CPU
    device frees the very storage it copies (a segfault in FSDP's state-dict hook): there the offload is off, the
    rest of the context (FULL_STATE_DICT, rank0_only) as Lightning sets it, and the tensors are on the CPU either
    way. Wrapping, stepping and saving (the sharded state dict through torch.distributed.checkpoint and meta.pt,
    or the full file) are Lightning's and torch's own code; the files are those a GPU run writes."""
    import lightning.pytorch.strategies.fsdp as lightning_fsdp
    import torch
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig
    init_handle = fsdp1._init_device_handle

    def _init_device_handle(state, module, ignored_params, device_id):
        return init_handle(state, module, ignored_params, torch.device("cpu") if device_id is None else device_id)
    fsdp1._init_device_handle = _init_device_handle

    def _get_full_state_dict_context(module, world_size, rank0_only=True):
        return fsdp1.FullyShardedDataParallel.state_dict_type(
            module=module, state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only))
    lightning_fsdp._get_full_state_dict_context = _get_full_state_dict_context

    class CpuFSDPStrategy(strategy_class):
        pass
    return CpuFSDPStrategy
