"""inspect: the CLI's text and JSON views agree with the engine's truth."""
import json
import subprocess
import sys

from conftest import REPO, fixture_dir, run_cli, truth_json


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


def test_inspect_is_metadata_only_and_fast():
    """Opening needs no torch import and no tensor bytes: time it against bare Python start-up."""
    code = ("import sys, time; t=time.perf_counter(); import reshard.formats as f; "
            "c=f.read(sys.argv[1]); from reshard.inspect import inspect; inspect(c, params=True); "
            "print(time.perf_counter()-t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(fixture_dir("z3_fp32_dp4"))], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout.split()
    assert out[1] == "False", "reading metadata imported torch"
    assert float(out[0]) < 2.0
