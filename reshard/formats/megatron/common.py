"""What every Megatron save says of itself beyond its tensors — args, iteration, scheduler, counters — put into the
catalog the same way whichever layout holds it (torch_dist's common state, a legacy rank file)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from reshard.core.catalog import MASTER, MODULE, CatalogBuilder, TensorDraft, TensorKey, TrainingState
from reshard.core.layout import Layout
from reshard.formats.megatron.topology import MegatronNotes, MegatronTopology

COUNTERS = ("iteration", "checkpoint_version", "num_floating_point_operations_so_far")


def finish(catalog: CatalogBuilder, degrees: tuple[int, int, int], sharding: str, common: Mapping[str, Any],
           args: Mapping[str, Any], layout: str, notes: dict[str, dict[str, Any]],
           backend: str = "torch_dist", grad_buffers: tuple[tuple[str, str], ...] = ()) -> None:
    """The catalog's layout ((dp, tp, pp), dtypes, `sharding`, which `layout` of files, `backend`), training state
    and notes, from the save's `common` state and `args` (and the (param, grad) dtypes of its saved grad
    buffers)."""
    dp, tp, pp = degrees
    model_dtypes = {t.dtype for k, t in catalog.tensors.items() if k.state == MODULE}
    masters = {t.dtype for k, t in catalog.tensors.items() if k.state == MASTER}
    iteration, version = common.get("iteration"), common.get("checkpoint_version")
    catalog.layout = Layout.of(
        dp, tp, pp, dtype=model_dtypes.pop() if len(model_dtypes) == 1 else "",
        master_dtype=masters.pop() if len(masters) == 1 else "",
        format_topology=MegatronTopology(sharding, iteration if isinstance(iteration, int) else None,
                                         float(version) if isinstance(version, (int, float)) else None,
                                         layout, backend,
                                         ep=catalog.experts.ep if catalog.experts is not None else None))
    samples = args.get("consumed_train_samples")
    catalog.training = TrainingState(global_steps=iteration if isinstance(iteration, int) else None,
                                     global_samples=samples if isinstance(samples, int) else None,
                                     lr_scheduler=common.get("opt_param_scheduler"),
                                     optimizer=optimizer_name(args.get("optimizer")))
    counters = {k: common[k] for k in COUNTERS if isinstance(common.get(k), (int, float))}
    plain = tuple((k, v) for k, v in sorted(args.items()) if v is None or isinstance(v, (bool, int, float, str)))
    catalog.notes = MegatronNotes(notes, counters, plain, grad_buffers)


def params_as_masters(catalog: CatalogBuilder, trainable: Iterable[str]) -> None:
    """An fp32 run's params are its masters: megatron-core's plain FP32Optimizer keeps no copy of them (no
    optimizer.state.fp32_param), and its load takes each param itself as what Adam updates. Each trainable fp32 param
    saved without a master is given itself as one, so the catalog holds the same states whatever the optimizer
    sharding (the distributed optimizer saves a copy: optimizer.state.param, the buckets' `param`)."""
    for name in trainable:
        module = catalog.tensors.get(TensorKey(name, MODULE))
        if module is not None and module.dtype == "float32" and TensorKey(name, MASTER) not in catalog.tensors:
            catalog.add(TensorDraft(name, MASTER, module.shape, module.dtype, list(module.fragments)))


def optimizer_name(name) -> str:
    """Megatron's `--optimizer adam` is Adam with decoupled weight decay (torch's AdamW, TE's FusedAdam)."""
    return {"adam": "AdamW", "sgd": "SGD"}.get(name, "") if isinstance(name, str) else ""
