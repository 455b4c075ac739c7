"""Property tests: for random models, dtypes, ZeRO stages, dp degrees and paddings, every element of
every target tensor comes from the right source element exactly once, and A -> B -> A is the identity.

Each example builds a source whose every element holds a distinct value (raw files, one per logical
tensor), writes it as real DeepSpeed files at layout A, converts A -> B -> A with the real planner,
executor and reader, and compares values bit for bit and the two A's byte for byte.
"""
import os
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import reshard
from reshard.catalog import MASTER, MODULE, Catalog, Fragment, LogicalTensor, ParamInfo, ScalarTensor, TrainingState
from reshard.formats.deepspeed.notes import DeepSpeedNotes
from reshard.convert import make_plan
from reshard.executor import cast, execute
from reshard.formats import writer
from reshard.formats.torchzip import Storage
from reshard.layout import Layout
from reshard.planner import plan as make_copy_plan
from reshard.tensorio import MappedFiles, read_flat

LP = ["float32", "bfloat16", "float16"]


@st.composite
def models(draw):
    n = draw(st.integers(1, 6))
    params = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        kind = draw(st.sampled_from(["trainable", "trainable", "trainable", "frozen"])) if i else "trainable"
        params.append((f"p{i}.w", shape, kind))
    groups = draw(st.integers(1, 2))
    return {
        "params": params,
        "groups": groups,
        "buffer": draw(st.booleans()),
        "lp": draw(st.sampled_from(LP)),
        "states": draw(st.sampled_from([["exp_avg", "exp_avg_sq"], ["momentum_buffer"]])),
        "a": (draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 3]))),
        "b": (draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 3]))),
        "options": draw(st.sampled_from([{}, {"round_robin_gradients": True}, {"parameter_alignment": True},
                                         {"sub_group_size": 40}])),
    }


def _source(model, root):
    """A catalog whose tensors are raw files of distinct values: the truth to compare against."""
    src = os.path.join(root, "src", "global_step7")
    os.makedirs(src)
    catalog = Catalog(root=src, format="deepspeed",
                      layout=Layout(dp=1, zero=1, dtype=model["lp"],
                                    options=dict(model["options"])))
    zero_cfg = {"stage": 1, **{k: v for k, v in model["options"].items()}}
    precision = {"bfloat16": {"bf16": {"enabled": True}}, "float16": {"fp16": {"enabled": True}}}.get(model["lp"], {})
    catalog.notes = DeepSpeedNotes(ds_config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_cfg,
                                              **precision}, ds_version="0.19.8")
    catalog.tag, catalog.training = "global_step7", TrainingState(global_steps=7, global_samples=7, skipped_steps=0)
    values = {}
    counter = [1]

    def add(name, state, shape, dtype, data=None):
        numel = int(np.prod(shape))
        if data is None:
            data = (np.arange(counter[0], counter[0] + numel) * 0.5).astype("<f4")
            counter[0] += numel
        raw = data.tobytes() if dtype == "float32" else (
            np.arange(numel, dtype="<i8").tobytes() if dtype == "int64" else cast(data.tobytes(), "float32", dtype))
        path = os.path.join(src, f"t{len(values)}.bin")
        with open(path, "wb") as f:
            f.write(raw)
        tensor = catalog.add(LogicalTensor(name, state, shape, dtype))
        tensor.fragments.append(Fragment(0, numel, Storage(path, 0, len(raw), dtype), 0))
        values[(name, state)] = raw
        return data

    trainable = [p for p in model["params"] if p[2] == "trainable"]
    for g in range(model["groups"]):
        members = [name for i, (name, _, _) in enumerate(trainable) if i % model["groups"] == g]
        if members:
            catalog.param_groups.append({"lr": 0.1 * (g + 1), "weight_decay": 0.0, "params": members})
            catalog.group_scalars.append({"step": ScalarTensor(7.0, "float32")})
    group_of = {n: g for g, grp in enumerate(catalog.param_groups) for n in grp["params"]}
    for name, shape, kind in model["params"]:
        catalog.params[name] = ParamInfo(name, shape, kind, group_of.get(name))
        catalog.order.append(name)
        if kind == "trainable":     # as in training, the 16-bit copy is the master cast down
            add(name, MODULE, shape, model["lp"], add(name, MASTER, shape, "float32"))
            for state in model["states"]:
                add(name, state, shape, "float32")
        else:
            add(name, MODULE, shape, model["lp"])
    if model["buffer"]:
        catalog.params["buf"] = ParamInfo("buf", (3,), "buffer")
        catalog.order.append("buf")
        add("buf", MODULE, (3,), "int64")
    return catalog, values


def _write(catalog, spec, dst):
    dp, zero = spec
    target = catalog.layout.with_spec(f"dp={dp},zero={zero}")
    targets = writer("deepspeed").target_files(catalog, target, "global_step7")
    execute(make_copy_plan(catalog, target, targets, "global_step7"), dst, progress=False)
    return reshard.open_checkpoint(dst)


def _check_values(catalog, values, zero):
    assert reshard.validate(catalog).ok
    for (name, state), raw in values.items():
        if state == MODULE and zero == 3 and catalog.params[name].kind == "trainable":
            continue    # ZeRO-3 keeps no 16-bit copy of trainable params
        with MappedFiles() as files:
            assert read_flat(files, catalog.tensors[(name, state)]).tobytes() == raw, (name, state)


def _files(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files if f != "reshard-manifest.json"}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_conversions_move_every_element_to_its_place(model):
    with tempfile.TemporaryDirectory() as root:
        source, values = _source(model, root)
        a = _write(source, model["a"], os.path.join(root, "a"))
        _check_values(a, values, model["a"][1])
        dp_b, zero_b = model["b"]
        execute(make_plan(a, f"dp={dp_b},zero={zero_b}"), os.path.join(root, "b"), progress=False)
        b = reshard.open_checkpoint(os.path.join(root, "b"))
        _check_values(b, {k: v for k, v in values.items() if k in b.tensors or k[1] != MODULE}, zero_b)
        dp_a, zero_a = model["a"]
        execute(make_plan(b, f"dp={dp_a},zero={zero_a}"), os.path.join(root, "a2"), progress=False)
        assert _files(os.path.join(root, "a")) == _files(os.path.join(root, "a2"))
