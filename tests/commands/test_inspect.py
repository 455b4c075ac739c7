"""inspect: the CLI's text and JSON views agree with the engine's truth."""
import json
import subprocess
import sys

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, truth_json
from tests.helpers.repo import REPO


def test_json_summary_matches_truth(fixture_name):
    meta = truth_json(fixture_name)
    info = json.loads(run_cli("inspect", fixture_dir(fixture_name), "--json", "--params", check=0).stdout)
    assert info["format"] == "deepspeed" and info["tag"] == meta["tag"]
    assert info["topology"]["dp"] == meta["world_size"] and info["zero_stage"] == meta["zero_stage"]
    assert info["step"] == meta["step"] and info["global_steps"] == meta["global_steps"]
    assert sorted(info["optimizer_states"]) == sorted(meta["state_names"])
    assert info["trainable"] == len(meta["trainable"]) and info["frozen"] == len(meta["frozen"])
    assert info["aliases"] == meta["tied"]
    rows = {row["name"]: row for row in info["parameter_table"]}
    assert set(rows) == set(meta["trainable"]) | set(meta["frozen"]) | set(meta["buffers"])
    for name in meta["trainable"]:
        assert "fp32" in rows[name]["states"] and all(s in rows[name]["states"] for s in meta["state_names"])
    assert info["bytes_per_state"]["fp32"] == 4 * sum(
        eval_numel(rows[n]["shape"]) for n in meta["trainable"])
    assert sum(f["bytes"] for f in info["files"]) > 0 and info["problems"] == 0


def eval_numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_text_output_names_the_essentials():
    out = run_cli("inspect", fixture_dir("z1_bf16_frozen_tied_dp2"), "--params", check=0).stdout
    for needle in ("deepspeed", "dp=2", "ZeRO stage 1", "bfloat16", "exp_avg_sq", "tied", "head.weight -> emb.weight",
                   "frozen", "group 1", "mp_rank_00_model_states.pt", "l2.weight"):
        assert needle in out, needle


def test_inspect_reads_metadata_without_torch():
    """Opening and inspecting need no torch import (what made them slow) and no tensor bytes."""
    code = ("import sys; import reshard.formats as f; "
            "c=f.read(sys.argv[1]); from reshard.commands.inspect import inspect; inspect(c, params=True); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(fixture_dir("z3_fp32_dp4"))], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout.split()
    assert out == ["False"], "reading metadata imported torch"


def test_an_export_is_inspected_in_the_dtype_it_was_written(tmp_path):
    """Weights only: the model dtype is the tensors', and there is no master copy to name."""
    for short, dtype in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        out = tmp_path / short
        run_cli("export", fixture_dir("z2_fp32_dp2"), out, "--dtype", short, "--quiet", check=0)
        info = json.loads(run_cli("inspect", out, "--json", "--params", check=0).stdout)
        floating = {row["dtype"] for row in info["parameter_table"] if row["dtype"].startswith(("float", "bfloat"))}
        assert floating == {dtype} and (info["dtype"], info["master_dtype"]) == (dtype, None), info
        assert f"dtypes        model {dtype}, master unknown\n" in run_cli("inspect", out, check=0).stdout


def test_deepspeed_to_dcp_to_deepspeed_keeps_the_optimizer_and_the_counters(tmp_path):
    name = "z2_fp32_dp2"
    meta = truth_json(name)
    dcp, ds = tmp_path / "dcp", tmp_path / "ds"
    run_cli("convert", fixture_dir(name), dcp, "--format", "dcp", "--quiet", check=0)
    run_cli("convert", dcp, ds, "--format", "deepspeed", "--to", "zero=2", "--quiet", check=0)
    want = (meta["optimizer_class"], meta["step"], meta["global_steps"], meta["global_samples"])
    assert want == ("AdamW", 3, 3, 12)       # DeepSpeed's "Adam" with its default adam_w_mode builds AdamW
    for path in (fixture_dir(name), dcp, ds):
        info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
        assert (info["optimizer"], info["step"], info["global_steps"], info["global_samples"]) == want, path
        out = run_cli("inspect", path, check=0).stdout
        assert "optimizer     AdamW: states exp_avg, exp_avg_sq" in out and "global_samples 12)" in out, out


def test_an_optimizer_that_cannot_be_told_apart_is_unknown(tmp_path):
    """RAdam keeps Adam's state names; only torch.optim.Adam/AdamW's own hyper-parameters tell those two."""
    import torch
    for cls, want in ((torch.optim.RAdam, None), (torch.optim.NAdam, None), (torch.optim.Adam, "Adam"),
                      (torch.optim.AdamW, "AdamW"), (torch.optim.SGD, "SGD")):
        model = torch.nn.Linear(3, 2)
        opt = cls(model.parameters(), lr=0.1, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        path = tmp_path / f"{cls.__name__}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
        assert info["optimizer"] == want, (cls, info["optimizer"])
        assert f"optimizer     {want or 'unknown'}: states" in run_cli("inspect", path, check=0).stdout
