"""Layout: detected from checkpoints, written to and read from descriptor files, changed by specs."""
import json

import pytest

import reshard
from reshard.errors import ReshardError
from reshard.core.layout import Layout
from reshard.formats import target_layout
from reshard.formats.deepspeed import topology as ds
from reshard.formats.deepspeed.topology import DeepSpeedTopology
from conftest import FIXTURES, REPO, fixture_dir, run_cli, truth_json


def test_detected_layout_round_trips_through_a_descriptor(fixture_name, tmp_path):
    catalog = reshard.open_checkpoint(fixture_dir(fixture_name))
    layout = catalog.layout
    meta = truth_json(fixture_name)
    assert (layout.dp, layout.tp, layout.pp, ds.of(layout).zero) == (meta["world_size"], 1, 1, meta["zero_stage"])
    assert catalog.contents().optimizer == meta["optimizer_class"]      # what DeepSpeed built for its config's type
    n_trainable = len(meta["trainable"])
    assert catalog.contents().params == n_trainable + len(meta["frozen"])
    path = tmp_path / "layout.json"
    layout.save(path)
    assert ds.load(path) == layout
    assert json.loads(path.read_text())["kind"] == "reshard.core.layout"


def test_spec_changes_only_named_degrees():
    base = Layout.of(8, dtype="bfloat16", format_topology=DeepSpeedTopology(zero=3, sub_group_size=40))
    target = target_layout(base, "dp=4", "deepspeed")
    assert (target.dp, ds.of(target).zero, target.dtype, ds.of(target).options()) == \
        (4, 3, "bfloat16", ds.of(base).options()) == (4, 3, "bfloat16", {"sub_group_size": 40})
    assert target_layout(base, "dp=2, zero=1,tp=2", "deepspeed").topology() == "dp=2,tp=2,pp=1,zero=1"
    for bad in ("dp=0", "dp=x", "zero=5", "gpus=2", "dp"):
        with pytest.raises(ReshardError):
            target_layout(base, bad, "deepspeed")


def test_bad_descriptors_are_refused(tmp_path):
    path = tmp_path / "l.json"
    for content in ("{", json.dumps({"kind": "other"}),
                    json.dumps({**Layout.of(2).to_dict(), "colour": "red"}),
                    json.dumps({**Layout.of(2).to_dict(), "dp": -1})):
        path.write_text(content)
        with pytest.raises(ReshardError) as err:
            ds.load(path)
        assert str(path) in str(err.value)


def test_descriptors_saved_with_content_facts_still_load(tmp_path):
    """Descriptors saved while Layout also held optimizer, states, params, elements and step (facts of a
    checkpoint, now Catalog.contents) load as the topology they name; other unknown keys are still refused."""
    path = tmp_path / "old.json"
    zero1 = Layout.of(2, format_topology=DeepSpeedTopology(zero=1))
    path.write_text(json.dumps({**zero1.to_dict(), "optimizer": "Adam", "states": ["exp_avg"],
                                "params": 3, "elements": 10, "step": 4}))
    assert ds.load(path) == zero1
    path.write_text(json.dumps({**zero1.to_dict(), "step": 4, "colour": "red"}))
    with pytest.raises(ReshardError, match="unknown layout keys colour"):
        ds.load(path)


@pytest.mark.parametrize("descriptor,fixture", [("dp4-zero3", "z2_bf16_dp2"), ("tp1-dp4-zero1", "autotp2_z1_fp32_dp2"),
                                                ("pp2-dp2-parameters", "pipe2_z1_fp32_dp2")])
def test_example_topologies_convert_a_real_checkpoint(tmp_path, descriptor, fixture):
    """Each example descriptor shipped in reshard/layouts/topologies/ is a `--to` target by name: its degrees, the
    source's precision."""
    path = REPO / "reshard" / "layouts" / "topologies" / f"{descriptor}.json"
    run_cli("convert", FIXTURES / fixture / "checkpoint", tmp_path / "out", "--to", descriptor, "--quiet", check=0)
    source = reshard.open_checkpoint(FIXTURES / fixture / "checkpoint")
    out = reshard.open_checkpoint(tmp_path / "out")
    given = json.loads(path.read_text())
    assert {**out.layout.degrees, "zero": ds.of(out.layout).zero} == {k: given[k] for k in ("dp", "tp", "pp", "zero")}
    assert (out.layout.dtype, out.layout.master_dtype) == (source.layout.dtype, source.layout.master_dtype)
    assert reshard.validate(out).ok
    run_cli("diff", FIXTURES / fixture / "checkpoint", tmp_path / "out", check=0)


def test_a_descriptor_with_another_precision_is_refused(tmp_path):
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps({"kind": "reshard.core.layout", "version": 1, "dp": 2, "dtype": "bfloat16"}))
    proc = run_cli("convert", FIXTURES / "z2_fp32_dp2" / "checkpoint", tmp_path / "out", "--to", path, check=2)    # the --to the user gave: a usage error
    assert "dtype bfloat16 differs from the source's float32" in proc.stderr
