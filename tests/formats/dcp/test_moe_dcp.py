"""Mixture-of-experts saves into DCP (issue #29, deliverable 3): `convert --format dcp --names mixtral-autoep-fsdp` and
`reshard.dcp_reader.Reader(..., names="mixtral-autoep-fsdp")` give an AutoEP Mixtral under transformers' Mixtral names
and shapes (experts.gate_up_proj = w1 then w3 along dim 1, experts.down_proj = w2, mlp.gate = the router), every expert
in its global place. Here torch's own `dcp.load` in one process, into the state dict of a real MixtralForCausalLM,
against the engine's truth; the FSDP2 model at 2 ranks is tests/formats/dcp/test_dcp.py's (engine) test."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard
import reshard.dcp_reader
from fixture_moe import MoENet, mixtral_config
from reshard.errors import ReshardError
from tests.helpers.cli import run_cli
from tests.helpers.damage import edit_dcp_metadata
from tests.helpers.fixtures import fixture_dir, truth_tensors
from tests.helpers.moe import MOE_NAMES, mixtral_truth
from tests.helpers.repo import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STATES = ("exp_avg", "exp_avg_sq")
DSMOE_NAMES = "deepspeed-moe-ep1"


def _loaded(module=None, **where) -> dict:
    """{truth key: tensor} that dcp.load puts into the state dict of `module` (default a MixtralForCausalLM): params
    and both moments."""
    if module is None:
        from transformers import MixtralForCausalLM
        module = MixtralForCausalLM(mixtral_config())
    model = {k: torch.full_like(v, float("nan")) for k, v in module.state_dict().items()}
    state = {"model": model, "optim": {"state": {k: {s: torch.full_like(v, float("nan")) for s in STATES}
                                                 for k, v in model.items()}}}
    dcp.load(state, **where)
    out = {f"fp32/{k}": v for k, v in state["model"].items()}
    out.update({f"{s}/{k}": v for k, states in state["optim"]["state"].items() for s, v in states.items()})
    return out


def _differences(loaded: dict, truth: dict) -> list:
    assert loaded.keys() == truth.keys()
    return sorted(k for k, v in truth.items() if not (loaded[k].shape == v.shape and torch.equal(loaded[k], v)))


@pytest.mark.parametrize("name", ["autoep2_z1_fp32", "autoep2_z2_bf16", "autoep2_z2_fp32_dp2_datafirst",
                                  "autoep2_z3_fp32", "autoep2_z3_fp32_dp2"])
def test_the_output_and_the_reader_give_transformers_mixtral_the_engines_values(name, tmp_path):
    truth = mixtral_truth(name)
    run_cli("convert", fixture_dir(name), tmp_path / "dcp", "--format", "dcp", "--to", "dp=2", "--names", MOE_NAMES,
            "--quiet", check=0)
    assert _differences(_loaded(checkpoint_id=tmp_path / "dcp"), truth) == []
    reader = reshard.dcp_reader.Reader(fixture_dir(name), names=MOE_NAMES)
    assert _differences(_loaded(storage_reader=reader), truth) == []
    assert reshard.validate(tmp_path / "dcp").ok


def test_experts_at_the_wrong_index_are_caught(tmp_path):
    """Negative control: the output's two chunks of one expert tensor swapped in .metadata (experts 0-1 <-> 2-3)."""
    name, swapped = "autoep2_z1_fp32", "model.layers.1.mlp.experts.down_proj"
    reshard.convert(fixture_dir(name), tmp_path / "dcp", "dp=2", fmt="dcp", names=MOE_NAMES)

    def swap(meta):
        first, second = [index for index in meta.storage_data if index.fqn == f"model.{swapped}"]
        meta.storage_data[first], meta.storage_data[second] = meta.storage_data[second], meta.storage_data[first]
    edit_dcp_metadata(tmp_path / "dcp", swap)
    truth = mixtral_truth(name)
    loaded = _loaded(checkpoint_id=tmp_path / "dcp")
    assert _differences(loaded, truth) == [f"fp32/{swapped}"]
    assert torch.equal(loaded[f"fp32/{swapped}"], truth[f"fp32/{swapped}"][[2, 3, 0, 1]])


def _dsmoe_truth(name):
    """The fixture's truth (fp32 masters, both moments) under the names the engine's experts have in its layer files,
    the names the MoE layer holds at ep_size=1."""
    return {k: v for k, v in truth_tensors(name).items() if k.partition("/")[0] in ("fp32", *STATES)}


def test_deepspeed_moe_goes_into_the_model_built_at_ep_1(tmp_path):
    """deepspeed.moe (ep=2, ZeRO-2) as DCP: dcp.load into the same model built with ep_size=1 gets every expert,
    master and moment of the engine's truth; and the same through the Reader, with no output written."""
    name = "dsmoe_ep2_z2_fp32"
    run_cli("convert", fixture_dir(name), tmp_path / "dcp", "--format", "dcp", "--names", DSMOE_NAMES, "--quiet",
            check=0)
    truth = _dsmoe_truth(name)
    assert _differences(_loaded(MoENet(ep_size=1), checkpoint_id=tmp_path / "dcp"), truth) == []
    reader = reshard.dcp_reader.Reader(fixture_dir(name), names=DSMOE_NAMES)
    assert _differences(_loaded(MoENet(ep_size=1), storage_reader=reader), truth) == []
    # Negative control: the two ep ranks' experts taken in the other order (the numbering the rule file relies on)
    swapped = {k: truth[re.sub(r"deepspeed_experts\.(\d)", lambda m: f"deepspeed_experts.{(int(m[1]) + 2) % 4}", k)]
               for k in truth}
    assert {k.rsplit(".", 2)[0].split("/")[1] for k in _differences(_loaded(MoENet(ep_size=1), storage_reader=reader),
                                                                   swapped)} == {
        f"moe.deepspeed_moe.experts.deepspeed_experts.{e}" for e in range(4)}


def test_gate_and_up_in_the_other_order_are_caught(tmp_path):
    """Negative control of the layout: a rule file joining w3 before w1 loads, and every gate_up_proj differs."""
    spec = json.loads((REPO / "reshard" / "layouts" / "module-names" / f"{MOE_NAMES}.json").read_text())
    for rule in spec["rules"]:
        if "join" in rule:
            rule["join"] = rule["join"][::-1]
    (tmp_path / "swapped.json").write_text(json.dumps(spec))
    reader = reshard.dcp_reader.Reader(fixture_dir("autoep2_z3_fp32"), names=str(tmp_path / "swapped.json"))
    wrong = _differences(_loaded(storage_reader=reader), mixtral_truth("autoep2_z3_fp32"))
    assert wrong == sorted(f"{s}/model.layers.{i}.mlp.experts.gate_up_proj" for s in ("fp32", *STATES) for i in (0, 1))


def test_moe_without_names_is_refused_in_one_line(tmp_path):
    proc = run_cli("convert", fixture_dir("autoep2_z3_fp32"), tmp_path / "out", "--format", "dcp", check=1)
    [line] = proc.stderr.strip().splitlines()
    assert "mixture-of-experts" in line and "--names RULES" in line and MOE_NAMES in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ReshardError, match="names="):
        reshard.dcp_reader.Reader(fixture_dir("autoep2_z3_fp32"))
    # deepspeed.moe's experts are no Mixtral's: the rule file names none of them
    proc = run_cli("convert", fixture_dir("dsmoe_ep2_z2_fp32"), tmp_path / "out", "--format", "dcp", "--names",
                   MOE_NAMES, check=1)
    assert "an expert param no rule names" in proc.stderr and not (tmp_path / "out").exists()
    proc = run_cli("convert", fixture_dir("dsmoe_ep2_z2_fp32"), tmp_path / "out", "--format", "dcp", check=1)
    assert f"shipped RULES: {DSMOE_NAMES}, {MOE_NAMES})" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("rules,needle", [
    ([{"match": "(.*)\\.mlp\\.experts\\.w1", "name": "\\1.x", "join": ["\\1.mlp.experts.w1", "\\1.mlp.experts.w2"],
       "dim": 1}], "cannot join"),
    ([{"match": "(.*)\\.mlp\\.experts\\.w1", "name": "\\1.x", "join": ["\\1.mlp.experts.w1", "\\1.nope"]}],
     "joins"),
    ([{"match": "(.*)\\.mlp\\.experts\\.w2", "name": "\\1.x", "dim": 1}], '"dim" is a dimension'),
    ([{"match": "x", "name": "y", "split": 0}], "unknown keys split"),
    ([{"match": "x", "drop": True, "name": "y"}], '"drop" goes alone'),
    ([{"match": ".*experts.*", "name": "same"}], "two params would be named same"),
])
def test_a_bad_rule_file_is_one_line_naming_it(rules, needle, tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"kind": "reshard.module-names", "version": 1, "rules": rules}))
    proc = run_cli("convert", fixture_dir("autoep2_z1_fp32"), tmp_path / "out", "--format", "dcp", "--names", path,
                   check=1)
    [line] = proc.stderr.strip().splitlines()
    assert str(path) in line and needle in line, line
    assert not (tmp_path / "out").exists()


def test_an_export_names_file_is_not_a_module_names_file(tmp_path):
    shutil.copy(REPO / "reshard" / "layouts" / "export-names" / "mixtral-autoep-hf.json", tmp_path / "hf.json")
    proc = run_cli("convert", fixture_dir("autoep2_z1_fp32"), tmp_path / "out", "--format", "dcp", "--names",
                   tmp_path / "hf.json", check=1)
    assert "not a module-names file" in proc.stderr


def test_plan_takes_the_names_convert_takes(tmp_path):
    """`reshard plan` of the conversion shows what convert writes (its files) and writes nothing; without
    --names it refuses as convert does."""
    source = fixture_dir("autoep2_z3_fp32")
    proc = run_cli("plan", source, "--format", "dcp", "--names", MOE_NAMES, "--json", check=0)
    planned = sorted(f["path"] for f in json.loads(proc.stdout)["files"])
    run_cli("convert", source, tmp_path / "out", "--format", "dcp", "--names", MOE_NAMES, "--quiet", check=0)
    written = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != "reshard-manifest.json")
    assert planned and [p.rsplit("/", 1)[-1] for p in planned] == written
    proc = run_cli("plan", source, "--format", "dcp", check=1)
    assert "--names RULES" in proc.stderr and MOE_NAMES in proc.stderr
