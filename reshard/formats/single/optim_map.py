"""Which parameter each torch.optim state entry belongs to.

torch.optim's state_dict names parameters by integer index: param group 0's params get 0..n0-1,
group 1's the next ones, in the order the groups listed them. The names are saved only when the
optimizer was built from named_parameters() (`param_names`, used directly by model.py). What we
rely on (verified against real runs in tests/test_single_process.py):
- plain torch and Lightning usually build `Adam(model.parameters())`: one group, the model's
  parameter order, i.e. the state-dict order minus buffers and tied aliases;
- the Hugging Face Trainer builds two groups (weight decay / no weight decay), each the
  model's named_parameters() order filtered: each group is a subsequence of the model order.
So we look for the ways of reading the model's parameter order as an interleaving of the groups
where every per-element state has its parameter's shape (a parameter without state matches any),
and where the model entries no group takes are frozen params or buffers. Exactly one way: that is
the mapping. None, or more than one: we refuse, naming why.

Where the weights keep no model order (a safetensors file without a config.json transformers can build: Accelerate's
plain save_state), `by_shapes` proves the mapping only when each entry's shape is held by exactly one floating-point
tensor and by no other entry: then, whatever the order, that tensor is the entry's parameter.
"""
from __future__ import annotations

from reshard.errors import CheckpointError, UnprovenMappingError

WILDCARD = None
State = tuple[int, ...]                        # how far each group has got
Step = tuple[int, State | None, int | None]     # (ways, the previous state, the group that took the position)
MAX_STATES = 2_000_000      # ways of being part-way through the groups; many groups and spare entries explode


def assign(path: str, candidates: list, groups: list) -> dict:
    """{name: (group, position)} for `candidates` = [(name, shape)] in model order and
    `groups` = [[shape or WILDCARD per param]]; raises one line when it is impossible or ambiguous."""
    wanted = sum(len(g) for g in groups)
    if wanted > len(candidates):
        raise CheckpointError(path, f"the optimizer holds {wanted} parameters but the model state dict has only "
                              f"{len(candidates)} floating-point tensors: it does not belong to this model")
    spare = len(candidates) - wanted
    # Forward dynamic programme over model positions; a state is how far each group has got.
    # Each state keeps (number of ways, capped at 2; the previous state; the choice made).
    start = tuple(0 for _ in groups)
    layers: list[dict[State, Step]] = [{start: (1, None, None)}]
    explored = 0
    for i, (_, shape) in enumerate(candidates):
        nxt: dict[State, Step] = {}
        for state, (ways, _, _) in layers[-1].items():
            skipped = i - sum(state)
            options: list[tuple[int | None, State]] = [
                (g, state[:g] + (state[g] + 1,) + state[g + 1:]) for g in range(len(groups))
                if state[g] < len(groups[g]) and groups[g][state[g]] in (WILDCARD, shape)]
            if skipped < spare:
                options.append((None, state))
            for choice, new in options:
                old = nxt.get(new)
                nxt[new] = (min(2, ways + (old[0] if old else 0)), state, choice)
        if not nxt:
            name = candidates[i][0]
            raise CheckpointError(path, f"the optimizer state does not map to the parameters: no parameter order "
                                  f"fits at {name} (shapes of the optimizer's states differ from the model's)")
        layers.append(nxt)
        explored += len(nxt)
        if explored > MAX_STATES:
            raise UnprovenMappingError(path, f"cannot map the optimizer to the parameters: {len(groups)} param "
                                       f"groups and {spare} entries outside them leave too many possible orders to "
                                       "check")
    end = tuple(len(g) for g in groups)
    if end not in layers[-1]:
        raise CheckpointError(path, "the optimizer state does not map to the parameters: its states' shapes do "
                              "not follow the model's parameter order")
    if layers[-1][end][0] > 1:
        raise UnprovenMappingError(path, "the optimizer state maps to the parameters in more than one way "
                                   "(entries it does not train, frozen params or buffers, have the shape of ones it "
                                   "trains, or params have no state yet); refusing to guess")
    out: dict[str, tuple[int, int]] = {}
    state = end
    for i in range(len(candidates), 0, -1):
        _, previous, choice = layers[i][state]
        assert previous is not None     # only the start state, before position 0, has none
        if choice is not None:
            out[candidates[i - 1][0]] = (choice, previous[choice])
        state = previous
    return out


def by_shapes(path: str, candidates: list, groups: list) -> dict:
    """{name: (group, position)} for `candidates` = [(name, shape)] in no known order, each entry told by its
    shape; raises one line where a shape does not prove which parameter an entry is."""
    holders: dict = {}
    for name, shape in candidates:
        holders.setdefault(shape, []).append(name)
    entries: dict = {}
    for g, row in enumerate(groups):
        for pos, shape in enumerate(row):
            entries.setdefault(shape, []).append((g, pos))
    unordered = "the weights do not keep the model's parameter order (safetensors, no config.json the installed " \
                "transformers can build)"
    if WILDCARD in entries:
        raise UnprovenMappingError(path, f"cannot map the optimizer to parameter names: {unordered}, and "
                                   f"{len(entries[WILDCARD])} of its entries hold no state to tell them by shape")
    out = {}
    for shape, at in entries.items():
        names = holders.get(shape, [])
        if len(at) > len(names):
            raise CheckpointError(path, f"the optimizer state does not map to the parameters: {len(at)} of its "
                                  f"entries have the shape {list(shape)}, {len(names)} parameters")
        if len(names) > 1:
            raise UnprovenMappingError(path, f"cannot map the optimizer to parameter names: {unordered}, and "
                                       f"{len(names)} tensors have the shape {list(shape)} ({', '.join(names[:3])}"
                                       f"{', ...' if len(names) > 3 else ''}); refusing to guess (pytorch_model.bin, "
                                       "save_state(safe_serialization=False), keeps the order)")
        out[names[0]] = at[0]
    return out
