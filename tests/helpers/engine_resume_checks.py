"""What the engine resume scripts (tests/scripts/engine_tp_resume.py, engine_moe_resume.py, engine_tp_pp_resume.py,
under torchrun) share: the ranks started on gloo with their jobs, the optimizer states a resumed engine holds, and
the lines naming where it differs from the fixture's truth (tensors bit for bit, counters, client state)."""
from __future__ import annotations

import json


def start_ranks(jobs_path) -> tuple:
    """DeepSpeed's process group on gloo, one thread a rank (the ranks share the machine's cores): (rank, world,
    the jobs of JOBS.json)."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    with open(jobs_path) as f:
        jobs = json.load(f)
    return dist.get_rank(), dist.get_world_size(), jobs


def optimizer_states(engine, make_fixtures) -> tuple:
    """(the names of the per-param optimizer state tensors, in the order the base optimizer holds them; every
    param's step), as tools/make_fixtures.py recorded them in the fixture's truth."""
    import torch
    state_names, steps = [], []
    for st in make_fixtures._base_optimizer(engine).state.values():
        for k, v in st.items():
            if k == "step":
                steps.append(make_fixtures._number(v))
            elif torch.is_tensor(v) and v.dim() > 0 and k not in state_names:
                state_names.append(k)
    return state_names, steps


def tensor_problems(tensors, truth) -> list:
    """One line per truth tensor the resumed engine lacks or holds other bits (dtype, shape) of; one for tensors
    beyond the truth."""
    import torch
    problems = []
    for key, expected in truth.items():
        got = tensors.get(key)
        if got is None:
            problems.append(f"{key}: not in the resumed engine")
        elif got.dtype != expected.dtype or got.shape != expected.shape:
            problems.append(f"{key}: {got.dtype}{list(got.shape)} vs saved {expected.dtype}{list(expected.shape)}")
        elif not torch.equal(got, expected):
            diff = (got.float() - expected.float()).abs().max().item()
            problems.append(f"{key}: differs from the saved engine's value (max abs diff {diff:g})")
    extra = sorted(set(tensors) - set(truth))
    if extra:
        problems.append(f"resumed engine has tensors the fixture's truth lacks: {extra[:5]}")
    return problems


def counter_problems(engine, steps, state_names, meta) -> list:
    """The optimizer's step and state names and the engine's counters against the fixture's truth.json (`meta`)."""
    info = {"step": steps[0] if steps else None, "state_names": state_names,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps}
    return [f"{key}: {value!r} after resume, {meta[key]!r} when saved" for key, value in info.items()
            if value != meta[key]]


def client_state_problems(client_state, meta) -> list:
    """The client state load_checkpoint returned against the one the fixture saved."""
    got = client_state or {}
    return [f"client state {key}: {got.get(key)!r} vs saved {value!r}" for key, value in meta["client_state"].items()
            if got.get(key) != value]
