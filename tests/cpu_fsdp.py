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
