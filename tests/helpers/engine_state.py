"""The live DeepSpeed engine's state, whole, for the framework flows' truth (tests/*_deepspeed.py, under torchrun)."""

STATES = ("exp_avg", "exp_avg_sq")


def engine_tensors(engine, module=None, optimizer: bool = True) -> dict:
    """{"fp32/name", "exp_avg/name", "exp_avg_sq/name", "module/name": tensor} of the live engine (`module`: the
    one whose names to use, default engine.module; `optimizer` False: the module's alone, as after a module-only
    load, which leaves the optimizer no state). Collectives under ZeRO-3: every rank calls this at the same point."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    module = module or engine.module
    if optimizer and hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8 links ZeRO-1/2 optimizer-state fragments lazily and never relinks (make_fixtures.py)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in module.named_parameters() if optimizer else ():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
        for state in STATES:
            out[f"{state}/{name}"] = safe_get_full_optimizer_state(p, state).detach().clone().contiguous()
    # ZeRO-3 holds each rank's partition of the weights: the module's full weights are gathered
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=engine.zero_optimization_stage() == 3):
        for name, value in module.state_dict().items():
            if value is None:       # a module's empty extra state (megatron-core's layers keep one)
                continue
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


def fsdp2_differences(loaded: dict, truth: dict, step: int) -> tuple:
    """(one line per engine truth tensor that a gathered FSDP2 state — tests/scripts/dcp_fsdp2.py's {"model", "optim"}
    — lacks or holds other bits of, how many were compared). Params are compared with the fp32 masters, the
    module weights only where there is no master (buffers, frozen params, a tied name); every step must be
    `step`."""
    import torch
    model, optim = loaded["model"], loaded["optim"]
    out, compared = [], 0
    for key, expected in truth.items():
        kind, name = key.split("/", 1)
        if kind == "module" and f"fp32/{name}" in truth:
            continue
        got = model.get(name) if kind in ("fp32", "module") else optim["state"].get(name, {}).get(kind)
        if got is None:
            out.append(f"{key}: not loaded")
            continue
        expected = expected.to(got.dtype) if kind == "module" else expected
        if got.shape != expected.shape or not torch.equal(got, expected):
            out.append(f"{key}: differs")
        compared += 1
    steps = {float(s["step"]) for s in optim["state"].values() if "step" in s}
    if steps != {float(step)}:
        out.append(f"steps {sorted(steps)}, not {step}")
    return out, compared


def saved_param_groups(path) -> list:
    """The param groups (hyper-parameters) a DeepSpeed optimizer file holds, read with torch.load itself."""
    import torch

    def find(tree):
        if isinstance(tree, list) and tree and all(isinstance(g, dict) and "lr" in g for g in tree):
            return tree
        for child in tree.values() if isinstance(tree, dict) else ():
            found = find(child)
            if found is not None:
                return found
        return None
    return find(torch.load(path, weights_only=False))
