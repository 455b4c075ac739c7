"""A catalog's entries under the keys DCP uses for `get_state_dict(model, optimizer)`: what the DCP writer
writes and what reshard's DCP StorageReader serves.

`dcp.save({"model": ..., "optim": ...})` flattens the two state dicts (torch's `flatten_state_dict`):
`model.<fqn>` for every state_dict entry (a tied name too, as torch keeps both), `optim.state.<fqn>.<state>`
and `.step` for every trainable param (its own step: Adam counts them per param), and
`optim.param_groups.<g>.<hyper>` / `optim.param_groups.<g>.params` for each group. Weights are the fp32
master copy where there is one (the optimizer's view of the param), frozen params and buffers as saved.
"""
from __future__ import annotations

from dataclasses import dataclass

from reshard.core.catalog import MASTER, MODULE, Catalog, ScalarTensor, TensorKey
from reshard.errors import ReshardError
from reshard.formats.dcp.chunks import CARRIED, CARRIED_PREFIX

MODEL, OPTIM = "model", "optim"


@dataclass(frozen=True)
class TensorEntry:
    key: str                # the flat DCP key
    name: str               # the parameter (or buffer) it belongs to
    source: tuple[str, str] | ScalarTensor  # (name, state) of the catalog tensor holding it, or a ScalarTensor (a step)
    shape: tuple
    dtype: str
    sharded: bool           # FSDP2 shards it over the data-parallel ranks (params and their states)


@dataclass(frozen=True)
class ValueEntry:
    key: str
    path: tuple             # where flatten_state_dict found it in the nested state dict
    value: object           # plain data: a hyper-parameter, a group's FQNs, a carried counter


def tensor_entries(catalog: Catalog):
    """Every tensor entry, in get_state_dict's order."""
    for name in catalog.tensor_order():
        holder = catalog.aliases.get(name, name)
        info = catalog.params[holder]
        source = (holder, MASTER) if info.kind == "trainable" and (holder, MASTER) in catalog.tensors \
            else (holder, MODULE)
        if source not in catalog.tensors:
            raise ReshardError.at(catalog.root, f"no weights for {name} ({source[1]})")
        yield TensorEntry(f"{MODEL}.{name}", name, source, tuple(info.shape), catalog.tensors[TensorKey(*source)].dtype,
                          info.kind != "buffer")
    for group in catalog.param_groups:
        for name in group["params"]:
            step = catalog.scalars_of_param(name).get("step")
            if step is not None:
                value = step if isinstance(step, ScalarTensor) else ScalarTensor(float(step), "float32")
                yield TensorEntry(f"{OPTIM}.state.{name}.step", name, value, (), value.dtype, False)
            for state in catalog.optimizer_states():
                tensor = catalog.tensors.get(TensorKey(name, state))
                if tensor is not None:
                    yield TensorEntry(f"{OPTIM}.state.{name}.{state}", name, tensor.key, tuple(tensor.shape),
                                      tensor.dtype, True)


def value_entries(catalog: Catalog):
    """Every optimizer hyper-parameter, then each group's FQNs, then what the source knew of its optimizer
    and training counters (chunks.CARRIED), when it knew it."""
    for g, group in enumerate(catalog.param_groups):
        for hyper, value in group.items():
            if hyper != "params":
                yield ValueEntry(f"{OPTIM}.param_groups.{g}.{hyper}", (OPTIM, "param_groups", g, hyper), value)
        yield ValueEntry(f"{OPTIM}.param_groups.{g}.params", (OPTIM, "param_groups", g, "params"),
                         list(group["params"]))
    for key, kind in CARRIED.items():
        value = catalog.contents().optimizer if key == "optimizer" else getattr(catalog.training, key)
        if isinstance(value, kind) and not isinstance(value, bool) and value != "":
            yield ValueEntry(f"{CARRIED_PREFIX}.{key}", (CARRIED_PREFIX, key), value)


def planner_path(key: str) -> tuple:
    """flatten_state_dict's record of where a flat tensor key sits in the nested state dict."""
    head, _, rest = key.partition(".")
    if head == OPTIM:
        _, _, rest = rest.partition(".")             # "state."
        fqn, _, state = rest.rpartition(".")
        return (OPTIM, "state", fqn, state)
    return (MODEL, rest)
