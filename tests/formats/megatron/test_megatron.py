"""Megatron-core torch_dist saves (fixtures/megatron_core/, made by the real megatron-core 0.16.1 on CPU:
tools/fixture_megatron_core.py): inspect, validate, export and diff against the truth taken from the live model and
optimizer at save time, bit for bit, for the plain optimizer and the distributed optimizer's fully_reshardable and
dp_reshardable sharding. Nothing here imports megatron: the fixtures are read as files.

Negative controls: a truncated or missing `.distcp` is named; a changed element is found by diff; a dp_reshardable
save whose stored per_bucket_numel disagrees with the recomputed buckets is refused in one line; a hostile pickle in
common.pt is refused and nothing runs. The export under Hugging Face Llama's names, loaded by transformers'
LlamaForCausalLM, gives the logits Megatron's own forward gave at save time; the same export with q/k/v cut without
the query groups, or gate and up swapped, gives other logits.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.errors import ReshardError, UnsafeCheckpointError
from tests.helpers.cli import run_cli
from tests.helpers.damage import write_in_zip
from tests.helpers.fixtures import FIXTURES
from tests.helpers.megatron_saves import bump_last_count, chunk_span, rewrite_in_span

ROOT = FIXTURES / "megatron_core"
NAMES = sorted(p.name for p in ROOT.iterdir() if (p / "truth.json").exists()) if ROOT.is_dir() else []
DP_RESHARDABLE = [n for n in NAMES if json.loads((ROOT / n / "truth.json").read_text())["sharding_type"]
                  == "dp_reshardable"]
# a mixture of experts' saves (tests/formats/megatron/test_megatron_moe.py): Llama's names and the plain DCP writer do
# not take them
DENSE = [n for n in NAMES if "ep" not in json.loads((ROOT / n / "truth.json").read_text())]
# the saves export's Llama is proven on (Megatron's own forward at save time: truth_forward.safetensors)
FORWARD = [n for n in DENSE if (ROOT / n / "truth_forward.safetensors").exists()]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
V019 = "mcore_dp_reshardable_tp2_dp2_v019"       # saved by megatron-core 0.19.2: its layout
V015 = "mcore_fully_sharded_model_space_tp2_dp2_v015"      # saved by 0.15.3: its default sharding


def _save(name):
    return ROOT / name / "save"


def _truth(name):
    return load_file(str(ROOT / name / "truth.safetensors"))


def _info(name):
    return json.loads((ROOT / name / "truth.json").read_text())


def _copy(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(_save(name), target)
    return target


def test_the_fixtures_are_small_and_cover_every_sharding():
    assert {_info(n)["sharding_type"] for n in NAMES} == {None, "fully_reshardable", "dp_reshardable",
                                                           "fully_sharded_model_space", "dp_zero_gather_scatter"}
    assert {_info(n)["megatron_core"] for n in NAMES} == {"0.15.3", "0.16.1", "0.19.2"}
    for name in NAMES:
        for path in (ROOT / name).rglob("*"):
            assert not path.is_file() or path.stat().st_size < 1 << 20, path


@pytest.mark.parametrize("name", NAMES)
def test_inspect_says_what_megatron_saved(name):
    info, truth = reshard.inspect(reshard.open_checkpoint(str(_save(name)))), _info(name)
    assert info.format == "megatron" and info.tag == f"iter_{truth['iteration']:07d}"
    assert (info.topology.tp, info.topology.pp, info.topology.dp) == (truth["tp"], truth["pp"], truth["dp"])
    assert info.options["sharding"] == (truth["sharding_type"] or "plain")
    assert info.options["optimizer"] == truth["optimizer"]
    assert info.options["iteration"] == truth["iteration"] == info.global_steps
    assert info.options["checkpoint_version"] == 3.0
    assert [info.step] == truth["step"]
    # (an fp32 run's params are its masters: float32 both, whether its optimizer keeps a copy or not)
    assert (info.dtype, info.master_dtype, info.optimizer) == (truth["model_dtype"], "float32", "AdamW")
    assert info.optimizer_states == ("exp_avg", "exp_avg_sq")
    names = {k.split("/", 1)[1] for k in _truth(name)}
    assert info.parameters == len(names) and info.trainable == len(names) and info.problems == 0
    assert sum(len(g["params"]) if isinstance(g["params"], list) else g["params"] for g in info.param_groups) \
        == len(names)


@pytest.mark.parametrize("name", NAMES)
def test_every_element_is_present_once(name):
    report = reshard.validate(str(_save(name)), deep=True)
    assert report.ok, report.problems
    catalog = reshard.open_checkpoint(str(_save(name)))
    truth = _truth(name)
    assert {f"{'fp32' if s == 'fp32' else s}/{n}" for n, s in catalog.tensors if s != "module"} == \
        {k for k in truth if not k.startswith("module/")}


@pytest.mark.parametrize("name", NAMES)
def test_export_is_the_truth(name, tmp_path):
    truth = _truth(name)
    reshard.export(str(_save(name)), str(tmp_path / "master.safetensors"), dtype="fp32")
    reshard.export(str(_save(name)), str(tmp_path / "module.safetensors"), weights="module", dtype="auto")
    reshard.export(str(_save(name)), str(tmp_path / "default.safetensors"))     # the training dtype
    master, module = load_file(str(tmp_path / "master.safetensors")), load_file(str(tmp_path / "module.safetensors"))
    default = load_file(str(tmp_path / "default.safetensors"))
    assert set(master) == set(module) == set(default) == {k[len("fp32/"):] for k in truth if k.startswith("fp32/")}
    for key, value in master.items():
        assert value.dtype == torch.float32 and torch.equal(value, truth[f"fp32/{key}"]), key
        assert module[key].dtype == truth[f"module/{key}"].dtype and torch.equal(module[key], truth[f"module/{key}"])
        assert default[key].dtype == truth[f"module/{key}"].dtype and torch.equal(default[key], truth[f"module/{key}"])
    reshard.export(str(_save(name)), str(tmp_path / "with-optimizer"), with_optimizer=True)
    for state in ("exp_avg", "exp_avg_sq"):
        saved = load_file(str(tmp_path / "with-optimizer" / f"optimizer-{state}.safetensors"))
        assert set(saved) == {k.split("/", 1)[1] for k in truth if k.startswith(f"{state}/")}
        for key, value in saved.items():
            assert torch.equal(value, truth[f"{state}/{key}"]), (state, key)


def test_the_two_distributed_shardings_of_one_run_are_equal(tmp_path):
    """The dp_reshardable and fully_reshardable saves come from the same run (seeds, data, tp=2, dp=2): the flat
    buckets mapped by the recomputed layout hold what the model-shaped tensors hold, element for element; an
    export of either (another format) is equal to both. The control: the pp=2 run's moments differ."""
    buckets, shaped = (str(_save(f"mcore_{s}_tp2_dp2")) for s in ("dp_reshardable", "fully_reshardable"))
    assert reshard.diff(buckets, shaped).equal
    reshard.export(shaped, str(tmp_path / "shaped.safetensors"), dtype="fp32")     # the masters, as diff compares
    assert reshard.diff(buckets, str(tmp_path / "shaped.safetensors")).equal
    other = reshard.diff(buckets, str(_save("mcore_dp_reshardable_tp2_pp2_dp2")))
    assert not other.equal and any("exp_avg" in str(d) for d in other.differences)


def test_an_iteration_folder_and_a_tag_read_the_same(tmp_path):
    name = NAMES[0]
    tag = f"iter_{_info(name)['iteration']:07d}"
    whole = reshard.open_checkpoint(str(_save(name)))
    for catalog in (reshard.open_checkpoint(str(_save(name) / tag)), reshard.open_checkpoint(str(_save(name)), tag)):
        assert catalog.format == "megatron" and set(catalog.tensors) == set(whole.tensors)
    with pytest.raises(ReshardError, match="iter_0000009"):
        reshard.open_checkpoint(str(_save(name)), "iter_0000009")


def _distcp(save):
    return sorted((save / next(p.name for p in save.iterdir() if p.name.startswith("iter_"))).glob("*.distcp"))


@pytest.mark.parametrize("which", [0, -1])      # rank 0's first file also holds the buckets' stored counts
@pytest.mark.parametrize("broken", ["truncated", "missing"])
def test_a_damaged_distcp_is_named(broken, which, tmp_path):
    name = DP_RESHARDABLE[0]
    save = _copy(name, tmp_path)
    victim = _distcp(save)[which]
    if broken == "truncated":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    report = reshard.validate(str(save))
    assert not report.ok and any(victim.name in str(p) for p in report.problems), report.problems
    proc = run_cli("validate", str(save))
    assert proc.returncode == 1 and victim.name in proc.stdout + proc.stderr
    assert reshard.validate(str(_save(name))).ok          # the control: the fixture itself is whole


def test_a_metadata_rewritten_since_it_was_read_is_read_again(tmp_path):
    """The source's .metadata is kept once read (open and convert both need it): a file changed since is not."""
    save = _copy(DP_RESHARDABLE[0], tmp_path)
    assert reshard.validate(str(save)).ok
    meta = next(save.glob("iter_*/.metadata"))
    meta.write_bytes(meta.read_bytes()[:-10])
    with pytest.raises(ReshardError, match=r"\.metadata"):
        reshard.validate(str(save))




def test_a_changed_element_is_found_by_diff(tmp_path):
    name = NAMES[0]
    save = _copy(name, tmp_path)
    path, offset, length = chunk_span(save, "decoder.layers.mlp.linear_fc2.weight")

    def flip(part):
        with zipfile.ZipFile(part) as zf:
            member = next(i for i in zf.infolist() if "/data/" in i.filename)
        header = part.read_bytes()[member.header_offset:member.header_offset + 30]
        start = member.header_offset + 30 + sum(struct.unpack_from("<HH", header, 26))
        value = part.read_bytes()[start:start + 2]
        write_in_zip(part, start, bytes([value[0] ^ 1, value[1]]))
    rewrite_in_span(path, offset, length, flip)
    same = reshard.diff(str(_save(name)), str(_save(name)))
    assert same.equal
    changed = reshard.diff(str(_save(name)), str(save))
    assert not changed.equal
    assert any("linear_fc2" in str(d) for d in changed.differences), changed.differences


def test_wrong_per_bucket_numel_is_refused_in_one_line(tmp_path):
    name = DP_RESHARDABLE[0]
    save = _copy(name, tmp_path)
    path, offset, length = chunk_span(save, "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded")

    rewrite_in_span(path, offset, length, bump_last_count)
    with pytest.raises(ReshardError) as caught:
        reshard.open_checkpoint(str(save))
    message = str(caught.value)
    assert "\n" not in message and "per_bucket_numel_unpadded" in message and path.name in message
    proc = run_cli("inspect", str(save))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    reshard.open_checkpoint(str(_save(name)))       # the control: the fixture's own counts agree


class _Payload:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("name,pickle", [(NAMES[0], "common.pt"), ("mcore_legacy_plain_tp2_pp2",
                                                                   "mp_rank_00_000/model_optim_rng.pt")])
def test_a_hostile_common_pt_is_refused_and_nothing_runs(name, pickle, tmp_path):
    save = _copy(name, tmp_path)
    canary = tmp_path / "canary"
    common = next(save.glob(f"iter_*/{pickle}"))
    torch.save({"args": None, "iteration": 3, "model": {}, "evil": _Payload(os.system, f"touch {canary}")}, common)
    for command in (["inspect"], ["validate"], ["export"]):
        out = [str(tmp_path / "out.safetensors")] if command == ["export"] else []
        proc = run_cli(*command, str(save), *out)
        assert proc.returncode == 1 and pickle.split("/")[-1] in proc.stderr + proc.stdout and \
            "system" in proc.stderr + proc.stdout, proc.stderr
    with pytest.raises(UnsafeCheckpointError):
        reshard.open_checkpoint(str(save))
    assert not canary.exists()
    reshard.open_checkpoint(str(_save(name)))     # the control: the fixture's own file is read


def test_the_command_line_shows_the_sharding_and_the_layout(tmp_path):
    for name, layout in (("mcore_dp_reshardable_tp2_dp2", "0.16 layout"), (V019, "0.19 layout"),
                         (V015, "0.15 layout"), ("mcore_legacy_distributed_tp2_dp2", "legacy torch format")):
        proc = run_cli("inspect", str(_save(name)))
        assert proc.returncode == 0 and "format        megatron (tag iter_0000003)" in proc.stdout
        assert f"sharding={_info(name)['sharding_type']}" in proc.stdout
        assert "topology      dp=2 tp=2 pp=1" in proc.stdout and f"megatron_core={layout}" in proc.stdout


def test_a_019_save_is_the_016_save_of_the_same_run():
    """megatron-core 0.19.2 and 0.16.1 ran the same configuration (seeds, data, tp=2, dp=2, dp_reshardable): the
    0.19 layout (common state a DCP object, one .distcp per rank) reads to the same tensors and scalars."""
    assert not list(_save(V019).glob("iter_*/common.pt")) and list(_save(V019).glob("iter_*/__3_0.distcp"))
    assert reshard.diff(str(_save(V019)), str(_save("mcore_dp_reshardable_tp2_dp2"))).equal


def test_a_015_state_without_its_flattening_is_not_taken_as_it_is_stored(tmp_path):
    """0.15 stores the distributed optimizer's states block-wise flattened ((blocks..., block numel); .metadata's
    mcore_data gives the global shape). The control: with mcore_data renamed away, no state is read in the shape it
    is stored in; each is a problem naming it."""
    save = _copy(V015, tmp_path)
    meta = next(save.glob("iter_*/.metadata"))
    meta.write_bytes(meta.read_bytes().replace(b"mcore_data", b"mcore_gone"))
    report = reshard.validate(str(save))
    assert not report.ok
    assert "optimizer.state.exp_avg.output_layer.weight: saved as [2, 1, 512], its model tensor as [64, 16]" in \
        "\n".join(str(p) for p in report.problems)
    assert reshard.validate(str(_save(V015))).ok


@pytest.mark.parametrize("legacy,same_run", [("mcore_legacy_plain_tp2_pp2", "mcore_plain_tp2_pp2"),
                                             ("mcore_legacy_distributed_tp2_dp2", "mcore_dp_reshardable_tp2_dp2")])
def test_a_legacy_save_is_the_torch_dist_save_of_the_same_run(legacy, same_run, tmp_path):
    """Megatron-LM's legacy format (mp_rank_*/model_optim_rng.pt, the distributed optimizer's distrib_optim.pt)
    of a run saved again as torch_dist: every param, master and moment equal, though nothing in the legacy files
    says how a tensor is cut (the tp rule file) or where a param lies in a flat buffer (the recomputed buckets).
    The control: two tensor-parallel ranks' files swapped read, and differ."""
    assert reshard.diff(str(_save(legacy)), str(_save(same_run))).equal
    save = _copy(legacy, tmp_path)
    folder = next(save.glob("iter_*"))
    name = "distrib_optim.pt" if "distributed" in legacy else "model_optim_rng.pt"
    first, second = sorted(folder.glob(f"mp_rank_*/{name}"))[:2]
    held = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(held)
    swapped = reshard.diff(str(save), str(_save(same_run)))
    assert not swapped.equal and any("fp32" in str(d) or "exp_avg" in str(d) for d in swapped.differences)


def test_a_missing_legacy_rank_is_named(tmp_path):
    save = _copy("mcore_legacy_plain_tp2_pp2", tmp_path)
    gone = next(save.glob("iter_*/mp_rank_01_001"))
    shutil.rmtree(gone)
    report = reshard.validate(str(save))
    assert not report.ok and any(str(gone) in str(p) and "missing" in str(p) for p in report.problems)


def test_without_its_common_state_a_save_is_refused_in_one_line(tmp_path):
    """0.16 without common.pt, and 0.19 with the file holding the DCP object common_state cut short: one line each,
    naming where the common state should be."""
    save = _copy("mcore_dp_reshardable_tp2_dp2", tmp_path)
    folder = next(save.glob("iter_*"))
    (folder / "common.pt").unlink()
    proc = run_cli("inspect", str(save))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and str(folder / "common.pt") in lines[0] and "0.19" in lines[0]
    save = _copy(V019, tmp_path)
    folder = next(save.glob("iter_*"))
    for distcp in folder.glob("*.distcp"):
        os.truncate(distcp, 0)
    proc = run_cli("inspect", str(save))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "common_state" in lines[0], lines


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", DENSE)
def test_a_dcp_conversion_loads_in_torch_as_the_truth(name, tmp_path):
    """No Megatron writer yet, but the generic DCP writer takes the catalog: torch's own dcp.load of the output
    (one rank) gives the fp32 masters and both moments of the truth; nothing is left NaN."""
    import torch.distributed.checkpoint as dcp
    out = tmp_path / "dcp"
    reshard.convert(str(_save(name)), str(out), "dp=1,tp=1,pp=1", fmt="dcp")
    reader = dcp.FileSystemReader(str(out))
    flat = {k: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype)
            for k, m in reader.read_metadata().state_dict_metadata.items()
            if hasattr(m, "size") and len(m.size) and m.properties.dtype.is_floating_point}
    dcp.load(flat, storage_reader=reader, no_dist=True)
    truth, seen = _truth(name), set()
    for key, value in flat.items():
        if key.startswith("model."):
            expected = f"fp32/{key[len('model.'):]}"
        else:
            param, state = key[len("optim.state."):].rsplit(".", 1)
            expected = f"{state}/{param}"
        assert torch.equal(value, truth[expected]), key
        seen.add(expected)
    assert seen == {k for k in truth if not k.startswith("module/")}


# -- export under Hugging Face Llama's names (reshard/layouts/export-names/megatron-core-llama.json) --

LLAMA = "megatron-core-llama"
SHIPPED_LLAMA = os.path.join(os.path.dirname(reshard.__file__), "layouts", "export-names", f"{LLAMA}.json")


def _forward(name):
    """Megatron's own fp32 forward of the saved weights at save time: the fixed tokens and their logits."""
    return load_file(str(ROOT / name / "truth_forward.safetensors"))


def _llama_logits(folder, tokens):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def _rules(tmp_path, change):
    """The shipped Llama rule file with `change(spec)` applied, as a file of its own."""
    spec = json.loads(open(SHIPPED_LLAMA).read())
    change(spec)
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _rule(spec, what):
    return next(r for r in spec["rules"] if what in r["match"])


@pytest.mark.parametrize("name", FORWARD)
def test_llama_export_gives_megatrons_logits(name, tmp_path):
    """`export --names megatron-core-llama` into a folder: LlamaForCausalLM.from_pretrained loads it (weights and the
    config.json built from the save's args), and its logits of the fixture's tokens are Megatron's own, in fp32."""
    run_cli("export", str(_save(name)), str(tmp_path / "hf"), "--names", LLAMA, "--dtype", "fp32", "--quiet", check=0)
    info = _info(name)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]) == \
        (info["hidden"], info["heads"], info["query_groups"], info["ffn"], info["layers"], info["vocab"])
    forward = _forward(name)
    logits = _llama_logits(tmp_path / "hf", forward["tokens"])
    torch.testing.assert_close(logits, forward["logits"], rtol=1e-5, atol=1e-5)


def test_llama_export_cuts_qkv_by_query_group_and_fc1_into_gate_and_up(tmp_path):
    """The geometry itself, against the truth: q/k/v are each group's rows of linear_qkv (groups of q heads, k, v),
    gate and up the halves of linear_fc1; everything else renamed whole."""
    name = NAMES[0]
    info, truth = _info(name), _truth(name)
    reshard.export(str(_save(name)), str(tmp_path / "hf.safetensors"), names=LLAMA, dtype="fp32")
    hf = load_file(str(tmp_path / "hf.safetensors"))
    head = info["hidden"] // info["heads"]
    per_group = info["heads"] // info["query_groups"]
    for layer in range(info["layers"]):
        qkv = truth[f"fp32/decoder.layers.{layer}.self_attention.linear_qkv.weight"]
        groups = qkv.view(info["query_groups"], (per_group + 2) * head, info["hidden"])
        q, k, v = groups.split([per_group * head, head, head], dim=1)
        prefix = f"model.layers.{layer}"
        assert torch.equal(hf[f"{prefix}.self_attn.q_proj.weight"], q.reshape(-1, info["hidden"]))
        assert torch.equal(hf[f"{prefix}.self_attn.k_proj.weight"], k.reshape(-1, info["hidden"]))
        assert torch.equal(hf[f"{prefix}.self_attn.v_proj.weight"], v.reshape(-1, info["hidden"]))
        gate, up = truth[f"fp32/decoder.layers.{layer}.mlp.linear_fc1.weight"].chunk(2)
        assert torch.equal(hf[f"{prefix}.mlp.gate_proj.weight"], gate)
        assert torch.equal(hf[f"{prefix}.mlp.up_proj.weight"], up)
        assert torch.equal(hf[f"{prefix}.input_layernorm.weight"],
                           truth[f"fp32/decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight"])
    assert torch.equal(hf["lm_head.weight"], truth["fp32/output_layer.weight"])
    assert len(hf) == 2 + 1 + 9 * info["layers"]         # embed, norm, lm_head; 9 per layer


@pytest.mark.parametrize("wrong", ["qkv without groups", "gate and up swapped"])
def test_llama_export_with_wrong_geometry_gives_other_logits(wrong, tmp_path):
    """The negative control: the same export with q/k/v cut as three contiguous blocks (the query groups ignored:
    the shapes still fit) or with gate and up swapped loads, and its logits are not Megatron's."""
    name = "mcore_dp_reshardable_tp2_dp2"

    def change(spec):
        if wrong == "qkv without groups":
            rows = _rule(spec, "linear_qkv\\.weight")["rows"]
            rows["groups"] = 1
            for part in rows["parts"][1:]:
                part["rows"] = 8        # 2 groups × 4 rows: the k and v shapes Llama expects
        else:
            parts = _rule(spec, "linear_fc1\\.weight")["rows"]["parts"]
            parts.reverse()
    run_cli("export", str(_save(name)), str(tmp_path / "hf"), "--names", _rules(tmp_path, change), "--dtype", "fp32",
            "--quiet", check=0)
    forward = _forward(name)
    logits = _llama_logits(tmp_path / "hf", forward["tokens"])
    assert (logits - forward["logits"]).abs().max() > 1e-3


def test_llama_rules_refuse_a_save_of_another_model(tmp_path):
    """A save whose args say otherwise than the rule file requires is refused in one line naming the rule file; a
    parameter no rule knows is refused naming it; a group count that does not divide the rows is refused."""
    save = str(_save(NAMES[0]))
    other = _rules(tmp_path, lambda spec: spec["requires"].update(swiglu=False))
    with pytest.raises(ReshardError, match=r"rules\.json: requires swiglu = False; the checkpoint has True"):
        reshard.export(save, str(tmp_path / "a"), names=other)
    strict = _rules(tmp_path, lambda spec: spec["rules"].insert(0, {"match": ".*linear_proj.*", "refuse": "no"}))
    with pytest.raises(ReshardError, match=r"rules\.json: decoder\.layers\.0\.self_attention\.linear_proj\.weight: no"):
        reshard.export(save, str(tmp_path / "b"), names=strict)
    three = _rules(tmp_path, lambda spec: _rule(spec, "linear_qkv\\.weight")["rows"].update(groups=3))
    with pytest.raises(ReshardError, match=r"32 rows are not 3 equal groups"):
        reshard.export(save, str(tmp_path / "c"), names=three)
    assert not any((tmp_path / d).exists() for d in "abc")
