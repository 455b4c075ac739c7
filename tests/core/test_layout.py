"""Layout: detected from checkpoints, written to and read from descriptor files, changed by specs."""
import dataclasses
import json
import re

import pytest

import reshard
from reshard.core.layout import Degrees, Layout
from reshard.errors import ReshardError
from reshard.formats import target_layout
from reshard.formats.deepspeed import topology as ds
from reshard.formats.deepspeed.topology import DeepSpeedTopology
from reshard.formats.unpartitioned import UNPARTITIONED
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES, fixture_dir, truth_json
from tests.helpers.repo import REPO


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
    # the --to the user gave: a usage error
    proc = run_cli("convert", FIXTURES / "z2_fp32_dp2" / "checkpoint", tmp_path / "out", "--to", path, check=2)
    assert "dtype bfloat16 differs from the source's float32" in proc.stderr


def test_degrees_are_a_frozen_mapping_that_starts_with_the_mesh():
    degrees = Degrees.of(4, tp=2)
    assert dict(degrees) == {"dp": 4, "tp": 2, "pp": 1} and list(degrees) == ["dp", "tp", "pp"]
    assert degrees.replaced({"pp": 2, "cp": 3}) == Degrees((("dp", 4), ("tp", 2), ("pp", 2), ("cp", 3)))
    assert Layout(degrees.replaced({"cp": 3})).world_size == 8      # a format's own degree cuts within the mesh
    with pytest.raises(dataclasses.FrozenInstanceError):
        degrees.named = ()
    with pytest.raises(ValueError):                                 # negative control: no mesh without dp, tp, pp
        Degrees((("tp", 2), ("dp", 4), ("pp", 1)))


def test_the_topology_line_is_the_mesh_then_the_format_s_terms():
    """One topology string: a plan's and a manifest's whole, a list row's brief; what a format adds, in its words."""
    plain = Layout.of(2)
    assert (plain.topology(), plain.topology(brief=True)) == ("dp=2,tp=1,pp=1", "dp=2")
    moe = Layout.of(4, pp=2, format_topology=DeepSpeedTopology(zero=2, ep=2))
    assert (moe.topology(), moe.topology(brief=True)) == ("dp=4,tp=1,pp=2,zero=2,ep=2", "dp=4,pp=2,zero=2")
    dcp = Layout.of(2, format_topology=UNPARTITIONED)       # reshard's line has always said zero=0 for these
    assert (dcp.topology(), dcp.topology(brief=True)) == ("dp=2,tp=1,pp=1,zero=0", "dp=2")


def test_the_core_layout_names_no_format(tmp_path):
    """reshard/core/layout.py knows named degrees and dtypes; ZeRO, experts, pipeline partitions and kv heads are
    DeepSpeed's (formats/deepspeed/topology.py). The scan refuses a module that names one (negative control)."""
    words = {"zero", "zero_stage", "experts", "expert", "ep", "kv_heads", "partition_method", "layer_types",
             "deepspeed", "options"}

    def named(path) -> set:
        return {w for w in re.findall(r"[a-z_]+", path.read_text().lower()) if w in words}

    assert named(REPO / "reshard" / "core" / "layout.py") == set()
    control = tmp_path / "control.py"
    control.write_text('zero: int = 0  # ZeRO stage\n')
    assert named(control) == {"zero"}


def test_a_writer_s_declaration_is_what_help_and_the_parser_take(monkeypatch):
    """The registry tells --help, the parser and the refusals from the writers' declarations: a writer declaring
    a key makes it a --to key, listed and parsed into that writer's own topology, refused for the others."""
    from reshard.cli import args as cli
    from reshard.commands.convert import _refuse_keys_without_meaning
    from reshard.core.layout import SpecKey
    from reshard.errors import UsageError
    from reshard.formats import WRITERS, WriterEntry, formats_taking
    from reshard.formats.protocol import TargetKeys

    @dataclasses.dataclass(frozen=True)
    class Shards:
        shards: int

        def terms(self, brief=False):
            return (("shards", self.shards),)

        def descriptor(self):
            return {"shards": self.shards}

    source = Layout.of(2)
    with pytest.raises(UsageError, match="'shards' is not a key"):     # negative control: no writer declares it
        target_layout(source, "shards=3", "dcp")
    toy = TargetKeys((SpecKey("shards", "N", "files per rank", minimum=1),),
                     lambda source, given: Shards(given.get("shards", 1)), lambda source, data: Shards(1))
    monkeypatch.setitem(WRITERS, "toy", WriterEntry("reshard.formats.dcp.writer", toy))
    assert "shards=N" in cli._spec_help() and "files per rank (1 or more; toy output)" in cli._spec_help()
    assert formats_taking(["shards"]) == ["toy"]
    assert target_layout(source, "shards=3,dp=4", "toy").topology() == "dp=4,tp=1,pp=1,shards=3"
    with pytest.raises(UsageError, match="shards is a whole number, 1 or more"):
        target_layout(source, "shards=0", "toy")
    catalog = reshard.open_checkpoint(FIXTURES / "z2_fp32_dp2" / "checkpoint")
    with pytest.raises(UsageError, match="deepspeed output has no shards .*; --format toy takes shards"):
        _refuse_keys_without_meaning(catalog, "shards=3", None)


def test_every_deepspeed_setting_round_trips_through_a_descriptor(tmp_path):
    """DeepSpeed's own part of a layout keeps the descriptor's format: zero, then dtypes, then its options."""
    own = DeepSpeedTopology(zero=2, bf16_optimizer=True, elastic=True, round_robin_gradients=True,
                            parameter_alignment=True, sub_group_size=8, ep=2, partition_method="type:Block",
                            layer_types=("Embed", "Block"), kv_heads=4)
    layout = Layout.of(4, tp=2, dtype="bfloat16", format_topology=own)
    layout.save(tmp_path / "l.json")
    saved = json.loads((tmp_path / "l.json").read_text())
    assert list(saved) == ["kind", "version", "dp", "tp", "pp", "zero", "dtype", "master_dtype", "options"]
    assert saved["options"]["layer_types"] == ["Embed", "Block"] and ds.load(tmp_path / "l.json") == layout
    saved["options"]["colour"] = "red"          # negative control: an option DeepSpeed has not is refused
    (tmp_path / "l.json").write_text(json.dumps(saved))
    with pytest.raises(ReshardError, match="unknown layout options colour"):
        ds.load(tmp_path / "l.json")
