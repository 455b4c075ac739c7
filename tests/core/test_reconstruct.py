"""The catalog rebuilds every fixture bit-exactly against the live engine's truth."""
import torch

import reshard
from reshard.core.catalog import MASTER, MODULE
from reshard.formats.deepspeed import topology as ds
from tests.helpers.fixtures import FIXTURE_NAMES, fixture_dir, truth_json, truth_tensors

EXPECTED = {"z1_fp32_dp2", "z1_fp32_dp4", "z1_bf16_dp2", "z1_bf16_dp4", "z2_fp32_dp2", "z2_fp32_dp4",
            "z2_bf16_dp2", "z2_bf16_dp4", "z3_fp32_dp2", "z3_fp32_dp4", "z3_bf16_dp2", "z3_bf16_dp4",
            "z2_fp16_dp2", "z1_bf16_frozen_tied_dp2", "z2_fp32_frozen_tied_dp2", "z3_fp32_frozen_tied_dp2",
            "z3_fp32_subgroup_dp2", "z2_fp32_roundrobin_dp4", "bf16opt_z1_dp2", "z2_fp32_sgd_dp2",
            "z2_fp32_elastic_dp2"}


def test_every_required_fixture_is_committed():
    assert EXPECTED <= set(FIXTURE_NAMES)


def test_every_truth_tensor_is_rebuilt_bit_exactly(fixture_name):
    catalog = reshard.open_checkpoint(fixture_dir(fixture_name))
    truth = truth_tensors(fixture_name)
    meta = truth_json(fixture_name)
    assert truth, "empty truth"
    for key, expected in truth.items():
        state, name = key.split("/", 1)
        if state == MODULE and meta["zero_stage"] == 3 and name in meta["trainable"] + list(meta["tied"]):
            # ZeRO-3 saves no 16-bit copy of trainable params: it is the master copy cast down
            assert (name, MODULE) not in catalog.tensors
            got = reshard.full_tensor(catalog, name, MASTER).to(expected.dtype)
        else:
            got = reshard.full_tensor(catalog, name, state)
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bool else got, expected), key
    # and nothing the engine did not have: every catalog tensor is in the truth
    for name, state in catalog.tensors:
        assert f"{state}/{name}" in truth, (name, state)
    # every trainable param has its master copy and each optimizer state the engine holds
    for name in meta["trainable"]:
        for state in [MASTER, *meta["state_names"]]:
            assert f"{state}/{name}" in truth and (name, state) in catalog.tensors or \
                name in catalog.aliases, (name, state)


def test_scalars_hyper_parameters_and_training_state(fixture_name):
    catalog = reshard.open_checkpoint(fixture_dir(fixture_name))
    meta = truth_json(fixture_name)
    layout = catalog.layout
    assert layout.dp == meta["world_size"] and ds.of(layout).zero == meta["zero_stage"]
    assert catalog.contents().step == meta["step"]
    assert sorted(catalog.contents().states) == sorted(meta["state_names"])
    assert catalog.training.global_steps == meta["global_steps"]
    assert catalog.training.global_samples == meta["global_samples"]
    assert catalog.training.skipped_steps == meta["skipped_steps"]
    assert catalog.notes.client_state == meta["client_state"]
    assert catalog.training.lr_scheduler == meta["lr_scheduler"]
    assert catalog.aliases == meta["tied"]
    kinds = {p.name: p.kind for p in catalog.params.values()}
    assert sorted(n for n, k in kinds.items() if k == "trainable") == sorted(meta["trainable"])
    assert sorted(n for n, k in kinds.items() if k == "frozen") == sorted(meta["frozen"])
    assert sorted(n for n, k in kinds.items() if k == "buffer") == sorted(meta["buffers"])
    if ds.of(layout).elastic:
        return  # DeepSpeed's elastic files do not save param_groups; nothing to compare
    assert len(catalog.param_groups) == len(meta["param_groups"])
    for ours, theirs in zip(catalog.param_groups, meta["param_groups"], strict=True):
        assert sorted(ours["params"]) == sorted(theirs["param_names"])
        for key, value in theirs.items():
            if key not in ("param_names", "params"):
                ours_value = list(ours[key]) if isinstance(ours[key], tuple) else ours[key]
                assert ours_value == value, (key, ours_value, value)


def test_module_copy_dtype_matches_training_precision(fixture_name):
    catalog = reshard.open_checkpoint(fixture_dir(fixture_name))
    meta = truth_json(fixture_name)
    expected = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[meta["dtype"]]
    assert catalog.layout.dtype == expected
    for (name, state), tensor in catalog.tensors.items():
        if state == MASTER:
            assert tensor.dtype == "float32"
        if state == MODULE and catalog.params[name].kind != "buffer":
            assert tensor.dtype == expected, name
