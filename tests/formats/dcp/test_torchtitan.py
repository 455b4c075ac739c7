"""torchtitan's step-N folders (fixtures/torchtitan/, saved by torchtitan 0.3.0's own CheckpointManager at 2 CPU
ranks: tools/fixture_torchtitan.py) read whole, and converted to another world size and resumed by torchtitan itself.

Reading: `inspect` names torchtitan, its step and dp, and lists its own entries (lr_scheduler, dataloader,
train_state); `validate --deep` finds model and optimizer complete, every optimizer state on a model parameter.
A fused-QKV save (every llama3 flavor's default) reads whole with `--config` (its key-value head count): the moments
of wq, wk, wv, exported or converted to DCP, are torchtitan's own save hook's split of the fused state torch's
dcp_to_torch_save reads, its weights give torchtitan's own logits in transformers, and it equals its unfused twin of
the same run (atol 1e-6); without `--config` it is refused naming what to give, a count that does not cut the rows is
refused in one line, and a wrong count that does (1) gives moments that differ from the truth (the controls);
`convert --format torchtitan` of it is refused in one line.

Export: `export --names torchtitan-llama --config config.json` writes a folder transformers' LlamaForCausalLM
loads, whose logits on the fixture's fixed batch equal torchtitan's own forward of the saved weights (the fixture's
truth_forward.safetensors), and its tensors are those torchtitan's own Llama3StateDictAdapter.to_hf gives; without
the rule's rotary reordering of q and k (the negative control) the logits differ.
`--with-optimizer` writes both moments as torch's dcp_to_torch_save reads them.

Resuming: `convert --format torchtitan --to dp=3` is loaded by torchtitan's `CheckpointManager.load` at 3 ranks
(tests/scripts/torchtitan_load.py: one 3-rank and one 2-rank launch): weights, both Adam moments, every parameter's
step, the LR scheduler and the train state equal the source as torch's own dcp_to_torch_save reads it, the dataloader
entries are carried as saved, and one more step runs; at 2 ranks (the size that saved it) the data loaders load too, at
their saved position. Negative controls: a conversion with one exp_avg element changed is found naming it; the true
conversion against a truth with one element changed fails.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest

import reshard
from reshard.core.catalog import TensorKey
from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.hf_sources import torchtitan_hf_config as hf_config

ROOT = FIXTURES / "torchtitan"
SOURCE = ROOT / "torchtitan_llama_fsdp2" / "checkpoint" / "step-3"
FUSED = ROOT / "torchtitan_llama_fused_fsdp2" / "checkpoint" / "step-3"
CHANGED = "layers.1.feed_forward.w2.weight"      # the element the negative controls change (its exp_avg)


def test_inspect_names_torchtitan_its_step_dp_and_own_entries():
    out = run_cli("inspect", SOURCE, check=0).stdout
    assert "format        torchtitan + FSDP2 (DCP), dp=2" in out
    assert "step          3 (global_steps 3" in out
    for key, value in [("train_state.step", "3"), ("train_state.ntokens_seen", "48"), ("lr_scheduler.last_epoch",
                       "3"), ("dataloader.world_size", "2"), ("dataloader.dp_rank_0", "bytes"),
                       ("dataloader.dp_rank_1", "bytes")]:
        assert any(line.split()[:1] == [key] and value in line for line in out.splitlines()), (key, out)
    data = json.loads(run_cli("inspect", SOURCE, "--json", check=0).stdout)
    assert data["framework"]["name"] == "torchtitan" and data["topology"]["dp"] == 2
    assert {e["key"] for e in data["entries"]} == {"train_state.step", "train_state.ntokens_seen",
                                                   "lr_scheduler.last_epoch", "dataloader.world_size",
                                                   "dataloader.dp_rank_0", "dataloader.dp_rank_1"}


def test_validate_deep_finds_model_and_optimizer_complete():
    assert run_cli("validate", "--deep", SOURCE, check=0).stdout.startswith("complete;")
    catalog = reshard.open_checkpoint(str(SOURCE))
    assert len(catalog.params) == 21 and all(p.kind == "trainable" for p in catalog.params.values())
    for name in catalog.params:     # the optimizer's FQN-keyed states, each on a model parameter
        assert {TensorKey(name, s) for s in ("exp_avg", "exp_avg_sq")} <= set(catalog.tensors)
        assert catalog.scalars_of_param(name)["step"].value == 3.0


def test_a_fused_qkv_save_without_a_config_is_refused_naming_what_to_give():
    proc = run_cli("validate", FUSED)
    assert proc.returncode != 0
    assert "the optimizer names layers.0.attention.qkv_linear.wqkv.weight, which the model state dict lacks " \
        "(torchtitan's fused q, k and v: --config, the model's config.json, gives its key-value head count)" \
        in proc.stdout + proc.stderr


def test_a_run_of_fused_qkv_saves_is_unverifiable_never_deleted_nor_thinned(tmp_path):
    """`list` has no --config: a fused save is not proven whole there, nor incomplete, so `prune
    --delete-incomplete --yes` keeps every one and `thin` refuses it in one line; the control: the same run of the
    unfused save is complete, and the same prune deletes the older one."""
    from tests.helpers.thin_runs import series
    for source, kept in ((FUSED, ["step-1", "step-2"]), (SOURCE, ["step-2"])):
        run = series(source, tmp_path / source.parent.parent.name / "checkpoint", ("step-1", "step-2"))
        rows = json.loads(run_cli("list", run, "--json", check=0).stdout)["checkpoints"]
        assert [r["status"] for r in rows] == ["unverifiable" if source == FUSED else "complete"] * 2, rows
        run_cli("prune", run, "--keep-last", "1", "--delete-incomplete", "--yes", check=0)
        assert sorted(os.listdir(run)) == kept
    refused = run_cli("thin", tmp_path / FUSED.parent.parent.name / "checkpoint" / "step-1", check=1).stderr
    assert "unverifiable" in refused and "--config" in refused and len(refused.strip().splitlines()) == 1


def _fused_config(tmp_path, kv_heads: int | None = None, head_dim: bool = False) -> str:
    """The fixture's Hugging Face config.json; where `kv_heads` is given (a wrong count), with it and without its
    head_dim (which would refuse it) unless `head_dim`."""
    config = hf_config(tmp_path / f"config-{kv_heads}-{head_dim}")
    if kv_heads is not None:
        values = json.loads(open(config).read())
        values["num_key_value_heads"] = kv_heads
        if not head_dim:
            del values["head_dim"]
        open(config, "w").write(json.dumps(values))
    return config


def test_a_fused_qkv_save_with_its_config_validates_deep_complete(tmp_path):
    config = _fused_config(tmp_path)
    assert run_cli("validate", "--deep", FUSED, "--config", config, check=0).stdout.startswith("complete;")
    catalog = reshard.open_checkpoint(str(FUSED), config=config)
    assert set(catalog.params) == set(reshard.open_checkpoint(str(SOURCE)).params)    # wq, wk, wv; no wqkv
    for name in catalog.params:
        assert {TensorKey(name, s) for s in ("exp_avg", "exp_avg_sq")} <= set(catalog.tensors)
        assert catalog.scalars_of_param(name)["step"].value == 3.0
    # no byte copied: wq's moments are row boxes of the stored wqkv chunks
    fragments = catalog.tensors[TensorKey("layers.0.attention.qkv_linear.wq.weight", "exp_avg")].fragments
    assert {f.shard.shape for f in fragments} == {(16, 16)} and all(len(f.shard.blocks) == 1 for f in fragments)


def _torchtitans_own_split(state: dict, kv_heads: int) -> dict:
    """{wq/wk/wv name: tensor} of each fused `wqkv` tensor of `state` (an optimizer state read by torch's
    dcp_to_torch_save), split by torchtitan's own save hook (FusedQKVLinear._split_qkv_on_save) as it splits the
    model's, for a module of the fixture's shape (truth.json) with `kv_heads` key-value heads."""
    from types import SimpleNamespace

    import torchtitan_cpu
    torchtitan_cpu.install()
    from torchtitan.models.common.attention import FusedQKVLinear
    m = json.loads((ROOT / "torchtitan_llama_fused_fsdp2" / "truth.json").read_text())["model"]
    module = SimpleNamespace(head_dim=m["dim"] // m["n_heads"], heads_per_kv=m["n_heads"] // kv_heads,
                             r_dim=m["n_heads"] // kv_heads + 2)
    out = {}
    for key, tensor in state.items():
        prefix, fused, param = key.rpartition("wqkv.")
        if fused:
            split = {f"{prefix}wqkv.{param}": tensor}
            FusedQKVLinear._split_qkv_on_save(module, split, prefix, None)
            out.update(split)
    return out


def test_a_fused_qkv_export_with_optimizer_is_torchtitans_own_split(tmp_path):
    """Both moments of wq, wk, wv as torchtitan's own hook splits the fused state torch's dcp_to_torch_save reads;
    the other tensors as torch reads them. The control: a config with one key-value head (the shapes still cut) gives
    other moments (without a head_dim; with the config's head_dim it is refused), and one with 3 is refused in one
    line."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(FUSED, tmp_path / "truth.pt")
    truth = torch.load(tmp_path / "truth.pt", weights_only=False)
    for kv_heads, equal in ((None, True), (1, False)):
        out = tmp_path / f"out-{kv_heads}"
        run_cli("export", FUSED, out, "--with-optimizer", "--config", _fused_config(tmp_path, kv_heads), "--quiet",
                check=0)
        for state in ("exp_avg", "exp_avg_sq"):
            got = load_file(out / f"optimizer-{state}.safetensors")
            moments = {k[len("state."):-len(f".{state}")]: v for k, v in truth["optimizer"].items()
                       if k.endswith(f".{state}")}
            expected = {**{k: v for k, v in moments.items() if "wqkv" not in k}, **_torchtitans_own_split(moments, 2)}
            assert set(got) == set(expected) == set(load_file(out / "model.safetensors")), state
            same = [torch.equal(got[k], expected[k]) for k in expected]
            assert all(same) if equal else not all(same), (kv_heads, state)
    for config, message in ((_fused_config(tmp_path, 3), "3 key-value heads do not cut k's 8 rows and q's 16 into "
                             "whole heads of one size"),
                            (_fused_config(tmp_path, 1, head_dim=True), "1 key-value heads make k's 8 rows heads of "
                             "8, not the config's head_dim 4")):
        proc = run_cli("validate", FUSED, "--config", config)
        assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, \
            proc.stderr


def test_a_fused_qkv_export_loads_in_transformers_with_torchtitans_own_logits(tmp_path):
    """The fused run's weights (saved split by its hook) under Hugging Face's names: LlamaForCausalLM gives the logits
    torchtitan's own forward of the fused model gave (the fixture's truth_forward)."""
    import torch
    run_cli("export", FUSED, tmp_path / "hf", "--names", "torchtitan-llama", "--config", _fused_config(tmp_path),
            "--quiet", check=0)
    logits, truth = _logits(tmp_path / "hf", "torchtitan_llama_fused_fsdp2")
    torch.testing.assert_close(logits, truth, rtol=1e-5, atol=1e-5)


def test_the_fused_save_equals_its_unfused_twin_of_the_same_run(tmp_path):
    """The two fixtures are one run (same seeds, same losses: truth.json), fused or not: equal up to the fused
    matmul's rounding (atol 1e-6); with a wrong key-value head count the moments of q, k and v differ."""
    truths = [json.loads((ROOT / n / "truth.json").read_text()) for n in ("torchtitan_llama_fsdp2",
                                                                          "torchtitan_llama_fused_fsdp2")]
    assert truths[0]["losses"] == truths[1]["losses"] and [t["fuse_qkv"] for t in truths] == [False, True]
    out = run_cli("diff", FUSED, SOURCE, "--config", _fused_config(tmp_path), "--atol", "1e-6", check=0).stdout
    assert "no difference (atol 1e-06): 63 tensors" in out, out
    proc = run_cli("diff", FUSED, SOURCE, "--config", _fused_config(tmp_path, 1), "--atol", "1e-6", check=1)
    assert "layers.1.attention.qkv_linear.wq.weight (exp_avg_sq)" in proc.stdout, proc.stdout


def test_a_fused_qkv_save_converted_to_dcp_holds_torchtitans_own_split_as_torch_reads_it(tmp_path):
    """convert --format dcp at 3 ranks writes wq, wk, wv with their moments and steps: torch's dcp_to_torch_save of the
    output holds torchtitan's own hook's split of the source's fused state (as torch reads it), the rest as saved."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    run_cli("convert", FUSED, tmp_path / "dcp", "--format", "dcp", "--to", "dp=3", "--config", _fused_config(tmp_path),
            "--quiet", check=0)
    dcp_to_torch_save(FUSED, tmp_path / "truth.pt")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "out.pt")
    truth, out = (torch.load(tmp_path / n, weights_only=False) for n in ("truth.pt", "out.pt"))
    for state in ("exp_avg", "exp_avg_sq"):
        moments = {k[len("state."):-len(f".{state}")]: v for k, v in truth["optimizer"].items()
                   if k.endswith(f".{state}")}
        expected = {**{k: v for k, v in moments.items() if "wqkv" not in k}, **_torchtitans_own_split(moments, 2)}
        assert set(out["optim"]["state"]) == set(expected) == set(out["model"])
        assert all(torch.equal(out["optim"]["state"][k][state], v) for k, v in expected.items()), state
    assert {float(s["step"]) for s in out["optim"]["state"].values()} == {3.0}


def test_a_fused_qkv_save_to_torchtitan_is_refused_in_one_line(tmp_path):
    proc = run_cli("convert", FUSED, tmp_path / "out", "--format", "torchtitan", "--config", _fused_config(tmp_path))
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert "torchtitan's fused q/k/v (2 wqkv parameters) is not written back to torchtitan yet" in proc.stderr and \
        len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _logits(folder, fixture: str = "torchtitan_llama_fsdp2"):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    truth = load_file(ROOT / fixture / "truth_forward.safetensors")
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(truth["tokens"]).logits, truth["logits"]


def test_export_loads_in_transformers_with_torchtitans_own_logits(tmp_path):
    import torch
    config = hf_config(tmp_path / "assets")
    run_cli("export", SOURCE, tmp_path / "hf", "--names", "torchtitan-llama", "--config", config, "--quiet",
            check=0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(open(config).read())
    logits, truth = _logits(tmp_path / "hf")
    torch.testing.assert_close(logits, truth, rtol=1e-5, atol=1e-5)
    # the control: the same names without the rotary reordering of q and k
    shipped = os.path.join(reshard.__path__[0], "layouts", "export-names", "torchtitan-llama.json")
    rules = json.loads(open(shipped).read())
    for rule in rules["rules"]:
        rule.pop("strided", None)
    (tmp_path / "plain.json").write_text(json.dumps(rules))
    run_cli("export", SOURCE, tmp_path / "plain", "--names", tmp_path / "plain.json", "--config", config, "--quiet",
            check=0)
    logits, truth = _logits(tmp_path / "plain")
    assert not torch.allclose(logits, truth, rtol=1e-5, atol=1e-5)


def test_export_holds_what_torchtitans_own_hf_adapter_gives(tmp_path):
    """torchtitan's Llama3StateDictAdapter.to_hf (its names, its q/k permutation) of the saved model state, read by
    torch's dcp_to_torch_save: the export holds the same tensors under the same names."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import torchtitan_cpu
    torchtitan_cpu.install()
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    run_cli("export", SOURCE, tmp_path / "hf", "--names", "torchtitan-llama", "--config", hf_config(tmp_path / "a"),
            "--quiet", check=0)
    dcp_to_torch_save(SOURCE, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    model = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    expected = Llama3StateDictAdapter(torchtitan_cpu.model_config(fuse_qkv=False), None).to_hf(model)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_export_without_the_config_is_refused_in_one_line(tmp_path):
    proc = run_cli("export", SOURCE, tmp_path / "hf", "--names", "torchtitan-llama")
    assert proc.returncode != 0 and not (tmp_path / "hf").exists()
    assert "block is head_dim, which the checkpoint does not record, not a whole number (export --config: a model " \
        "config giving it)" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_export_with_optimizer_holds_both_moments_as_torch_reads_them(tmp_path):
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    run_cli("export", SOURCE, tmp_path / "out", "--with-optimizer", "--quiet", check=0)
    dcp_to_torch_save(SOURCE, tmp_path / "truth.pt")
    truth = torch.load(tmp_path / "truth.pt", weights_only=False)
    for state in ("exp_avg", "exp_avg_sq"):
        got = load_file(tmp_path / "out" / f"optimizer-{state}.safetensors")
        assert set(got) == set(truth) - {"optimizer", "lr_scheduler", "dataloader", "train_state"}
        for name, tensor in got.items():
            assert torch.equal(tensor, truth["optimizer"][f"state.{name}.{state}"]), (state, name)


def _convert(dst, source=SOURCE, dp: int = 3) -> None:
    run_cli("convert", source, dst, "--format", "torchtitan", "--to", f"dp={dp}", "--quiet", check=0)



def test_diff_finds_the_conversion_equal_and_a_changed_element(tmp_path):
    _convert(tmp_path / "three" / "step-3")
    assert run_cli("diff", SOURCE, tmp_path / "three" / "step-3", check=0).stdout.startswith("no difference")
    run_cli("convert", SOURCE, tmp_path / "dcp", "--format", "dcp", "--to", "dp=1", "--quiet", check=0)
    out = run_cli("diff", SOURCE, tmp_path / "dcp", check=0).stdout     # another format: reshard's own DCP layout
    assert "no difference: 63 tensors" in out and "6 scalars only in A, not compared: train_state.step" in out, out
    changed = tmp_path / "changed" / "step-3"
    shutil.copytree(tmp_path / "three" / "step-3", changed)
    change_dcp_element(changed, CHANGED)
    proc = run_cli("diff", SOURCE, changed, check=1)
    assert f"{CHANGED}" in proc.stdout and "exp_avg" in proc.stdout, proc.stdout


def test_plan_advises_excluding_the_data_loaders_at_another_size():
    out = run_cli("plan", SOURCE, "--format", "torchtitan", "--to", "dp=3", check=0).stdout
    assert 'checkpoint.exclude_from_loading = ["dataloader"]' in out and "framework" not in out, out


@shares("torchtitan_load.py")
def torchtitan_load_jobs(out):
    """The conversion at 3 ranks (against the source and against a changed copy of it), and the conversion with one
    element changed: 3 ranks."""
    wrong = out / "wrong-truth" / "step-3"
    shutil.copytree(SOURCE, wrong)
    change_dcp_element(wrong, CHANGED)
    jobs = []
    for label in ("converted", "changed"):
        _convert(out / label / "step-3")
        if label == "changed":
            change_dcp_element(out / label / "step-3", CHANGED)
        jobs.append({"label": label, "folder": str(out / label), "step": 3, "exclude": ["dataloader"],
                     "truths": {"source": str(SOURCE), "wrong": str(wrong)}})
    _convert(out / "same-size" / "step-3", dp=2)      # the data loaders too: torchtitan loads them only at 2
    same = {"label": "same size", "folder": str(out / "same-size"), "step": 3, "exclude": [],
            "truths": {"source": str(SOURCE)}}
    return [(3, None, job) for job in jobs] + [(2, None, same)]


@pytest.fixture(scope="module")
def loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(torchtitan_load_jobs)}


@pytest.mark.engine
def test_torchtitan_resumes_the_conversion_at_3_ranks_as_the_truth_and_trains_on(loaded):
    result = loaded["converted"]
    assert result["loaded"] and result["error"] is None, result
    assert result["problems"]["source"] == [], result    # weights, moments, steps, scheduler, train state, loader
    assert result["step"] == 3 and result["last_epoch"] == 3
    assert len(result["losses"]) == 1 and all(math.isfinite(x) for x in result["losses"])
    assert result["step_after"] == [4.0]


@pytest.mark.engine
def test_torchtitan_resumes_a_conversion_at_the_same_size_with_its_data_loaders(loaded):
    result = loaded["same size"]
    assert result["loaded"] and result["problems"]["source"] == [], result
    assert result["step_after"] == [4.0]


@pytest.mark.engine
def test_a_changed_element_is_found_in_what_torchtitan_loaded(loaded):
    result = loaded["changed"]
    assert result["loaded"] and result["problems"]["source"] == [f"optimizer.state.{CHANGED}.exp_avg: differs from "
                                                                 "the truth"], result


@pytest.mark.engine
def test_a_wrong_truth_fails(loaded):
    result = loaded["converted"]
    assert result["loaded"] and result["problems"]["wrong"] == [f"optimizer.state.{CHANGED}.exp_avg: differs from "
                                                                "the truth"], result


def _rules(tmp_path, rule) -> str:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"kind": "reshard.export-names", "version": 1, "rules": [rule]}))
    return str(path)


def test_a_strided_rule_reorders_each_blocks_rows_by_their_stride(tmp_path):
    from reshard.commands.export import Entry
    from reshard.rules import export_names
    rules = export_names.load(_rules(tmp_path, {"match": "w", "name": "v", "strided": {"block": "head_dim",
                                                                                        "stride": 2}}))
    (entry,), _ = rules.apply([Entry("w", "float32", (8, 3), ("w", "fp32"))], {}, {"head_dim": 4})
    assert entry.key == "v" and entry.shard.shape == (8, 3)
    # output row <- input row: each head of 4 rows takes its even rows, then its odd ones
    assert [(b.local[0], b.at[0]) for b in entry.shard.blocks] == [(0, 0), (1, 2), (2, 1), (3, 3),
                                                                   (4, 4), (5, 6), (6, 5), (7, 7)]
    assert all(b.shape == (1, 3) for b in entry.shard.blocks)


@pytest.mark.parametrize("strided, message", [
    ({"block": 4, "stride": 1}, '"strided" is {"block": N, "stride": S >= 2}'),
    ({"block": 4}, '"strided" is {"block": N, "stride": S >= 2}'),
    ({"block": 3, "stride": 2}, "8 rows are not blocks of 3 rows whose rows go by 2"),
])
def test_a_bad_strided_rule_is_refused_naming_the_file(tmp_path, strided, message):
    from reshard.commands.export import Entry
    from reshard.errors import ReshardError
    from reshard.rules import export_names
    path = _rules(tmp_path, {"match": "w", "name": "v", "strided": strided})
    with pytest.raises(ReshardError, match=re.escape(message)) as caught:
        export_names.load(path).apply([Entry("w", "float32", (8, 3), ("w", "fp32"))], {}, {})
    assert path in str(caught.value)


@pytest.mark.parametrize("text", [None, "[1]", "{not json"])
def test_a_bad_model_config_is_refused_in_one_line_with_nothing_written(tmp_path, text):
    config = tmp_path / "config.json"
    if text is not None:
        config.write_text(text)
    proc = run_cli("export", SOURCE, tmp_path / "hf", "--names", "torchtitan-llama", "--config", config)
    assert proc.returncode == 2 and not (tmp_path / "hf").exists()
    assert proc.stderr.startswith(f"reshard: {config}: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
