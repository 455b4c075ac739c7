"""The live DeepSpeed engine's state, whole, for the framework flows' truth (tests/*_deepspeed.py, under torchrun)."""

STATES = ("exp_avg", "exp_avg_sq")


def engine_tensors(engine, module=None) -> dict:
    """{"fp32/name", "exp_avg/name", "exp_avg_sq/name", "module/name": tensor} of the live engine (`module`: the
    one whose names to use, default engine.module). Collectives under ZeRO-3: every rank calls this at the same
    point."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    module = module or engine.module
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 links ZeRO-1/2 optimizer-state fragments lazily and never relinks (make_fixtures.py)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
        for state in STATES:
            out[f"{state}/{name}"] = safe_get_full_optimizer_state(p, state).detach().clone().contiguous()
    # ZeRO-3 holds each rank's partition of the weights: the module's full weights are gathered
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=engine.zero_optimization_stage() == 3):
        for name, value in module.state_dict().items():
            out[f"module/{name}"] = value.detach().clone().contiguous()
    return out


def differences(got: dict, truth: dict) -> list:
    """One line per truth tensor the engine lacks or holds other bits (or another dtype or shape) of."""
    import torch
    out = []
    for key, expected in truth.items():
        value = got.get(key)
        if value is None:
            out.append(f"{key}: not in the resumed engine")
        elif value.shape != expected.shape or value.dtype != expected.dtype or not torch.equal(value, expected):
            out.append(f"{key}: differs after resume")
    return out
