"""A reader fills a CatalogBuilder; freeze() makes the Catalog everyone else reads, which no one can change."""
from __future__ import annotations

import dataclasses

import pytest

import reshard
from reshard.core.catalog import (
    MASTER,
    MODULE,
    CatalogBuilder,
    Fragment,
    ParamInfo,
    PerParamScalar,
    ScalarTensor,
    TensorDraft,
    TensorKey,
)
from reshard.core.layout import Layout
from reshard.core.problems import READER, Problem
from reshard.core.storage_ref import StorageRef
from reshard.errors import CheckpointError
from tests.helpers.fixtures import fixture_dir


def _builder() -> CatalogBuilder:
    builder = CatalogBuilder(root="/ckpt", format="test", layout=Layout.of(1))
    builder.params["w"] = ParamInfo("w", (2, 3), "trainable", 0)
    builder.order.append("w")
    builder.param_groups.append({"lr": 0.1, "params": ["w"]})
    builder.group_scalars.append({})
    storage = StorageRef("/ckpt/a.bin", 0, 24, "float32")
    for state in (MASTER, MODULE):
        builder.add(TensorDraft("w", state, (2, 3), "float32")).fragments.append(Fragment(0, 3, storage, 0))
    builder.add(TensorDraft("w", MASTER, (2, 3), "float32")).fragments.append(Fragment(3, 6, storage, 3))
    builder.record_param_scalar(0, "w", "step", ScalarTensor(7.0, "float32"), "/ckpt/a.bin")
    builder.problem("/ckpt/a.bin", "a note")
    return builder


def test_freeze_keeps_what_was_built_in_tuples_and_read_only_maps():
    catalog = _builder().freeze()
    master = catalog.tensor("w", MASTER)
    assert master.key == TensorKey("w", MASTER) == ("w", MASTER) and catalog.tensors[("w", MASTER)] is master
    assert [(f.start, f.stop) for f in master.fragments] == [(0, 3), (3, 6)] and isinstance(master.fragments, tuple)
    assert catalog.order == ("w",) and catalog.problems == (Problem("/ckpt/a.bin", None, READER, "a note"),)
    assert catalog.contents().step == 7 and catalog.states() == [MASTER, MODULE]
    assert isinstance(catalog.group_scalars[0]["step"], PerParamScalar)


def test_a_frozen_catalog_cannot_be_changed():
    """Negative controls: every way a reader used to change a catalog after reading now raises."""
    catalog = _builder().freeze()
    with pytest.raises(dataclasses.FrozenInstanceError):
        catalog.tag = "other"                                          # type: ignore[misc]
    with pytest.raises(TypeError):
        catalog.tensors[TensorKey("v", MASTER)] = catalog.tensor("w", MASTER)   # type: ignore[index]
    with pytest.raises(TypeError):
        catalog.params["w"] = ParamInfo("w", (6,), "frozen")           # type: ignore[index]
    with pytest.raises(AttributeError):
        catalog.tensor("w", MASTER).fragments.append(None)             # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        catalog.params["w"].group = 1                                  # type: ignore[misc]
    with pytest.raises(TypeError):
        catalog.group_scalars[0]["step"].values["v"] = 1.0             # type: ignore[index, union-attr]


def test_freeze_copies_so_the_builder_can_go_on_without_changing_the_catalog():
    builder = _builder()
    catalog = builder.freeze()
    builder.tensors[TensorKey("w", MODULE)].fragments.append(Fragment(3, 6, StorageRef("/ckpt/b.bin", 0, 12,
                                                                                        "float32"), 0))
    builder.order.append("v")
    assert len(catalog.tensor("w", MODULE).fragments) == 1 and catalog.order == ("w",)


def test_add_refuses_a_second_shape_of_one_tensor():
    builder = _builder()
    with pytest.raises(CheckpointError, match=r"float32\[6\] here, float32\[2, 3\]"):
        builder.add(TensorDraft("w", MASTER, (6,), "float32"), "/ckpt/b.bin")


@pytest.mark.parametrize("name", ["z2_fp32_dp2", "autotp2_z1_fp32_dp2", "pipe2_z1_fp32_dp2"])
def test_readers_return_frozen_catalogs(name):
    catalog = reshard.open_checkpoint(fixture_dir(name))
    assert dataclasses.is_dataclass(catalog) and type(catalog).__dataclass_params__.frozen
    assert all(type(key) is TensorKey for key in catalog.tensors)
    assert all(isinstance(t.fragments, tuple) for t in catalog.tensors.values())
    assert all(isinstance(getattr(catalog, f), tuple) for f in ("order", "files", "problems", "replicas"))
