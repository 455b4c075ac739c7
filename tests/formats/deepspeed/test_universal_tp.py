"""Universal checkpoints from AutoTP (tensor-parallel) sources, proven with DeepSpeed 0.19.8's own tools.

ds_to_universal merges the TP slices into full tensors and, for a param AutoTP described by an affine
map, writes `{'param': full}` (plus `vocab_tensor` for the vocabulary param) and copies each TP rank's
model-states file. Our tree must hold the same files and bytes (its one known difference: a tied alias's
fp32.pt, which no loader reads, ds_to_universal takes from TP rank 0's 16-bit shard; ours is whole).
The engine then cuts each rank's slice from the full tensor by the live model's AutoTP metadata, so
the real engine with `load_universal` resumes our output at tp2-dp2, tp2-dp1 and tp1-dp2 with every
fp32 master and optimizer state equal to the fixture's truth bit for bit, and trains one more step
(tests/scripts/engine_tp_resume.py under torchrun); so does our `--to tp=1` output (one mp_rank file), the
output of the source first converted to tp=1 DeepSpeed files, and ds_to_universal's own.
"""

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES, fixture_dir
from tests.helpers.repo import REPO
from tests.helpers.universal import ds_to_universal

AUTOTP = ["autotp2_z1_fp32_dp2", "autotp2_z1_fp32_uneven_dp2", "autotp2_z1_bf16_tied_dp2",
          "autotp2_z2_fp32_tied_dp2"]
TIED = ("autotp2_z1_bf16_tied_dp2", "autotp2_z2_fp32_tied_dp2")
ENGINE_FIXTURE = "autotp2_z1_fp32_dp2"


def ours(name, out, to=""):
    run_cli("convert", fixture_dir(name), out, "--format", "universal", "--to", to, "--quiet", check=0)
    return out


def via_tp1(name, out):
    """The source converted to tp=1 DeepSpeed files first, then to universal."""
    run_cli("convert", fixture_dir(name), out / "tp1", "--to", "tp=1", "--quiet", check=0)
    run_cli("convert", out / "tp1", out / "universal", "--format", "universal", "--quiet", check=0)
    return out / "universal"


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _zero_tree(save_dir):
    tag = (save_dir / "latest_universal").read_text().strip()
    zero = save_dir / tag / "zero"
    return {str(p.relative_to(zero)): _load(p) for p in sorted(zero.rglob("*.pt")) if p.name != "optimizer_state.pt"}


def _differences(a, b):
    out = []
    if sorted(a) != sorted(b):
        out.append(f"files: {sorted(set(a) ^ set(b))}")
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, dict) or isinstance(y, dict):
            if not (isinstance(x, dict) and isinstance(y, dict)) or list(x) != list(y):
                out.append(f"{key}: keys {list(x) if isinstance(x, dict) else x} vs "
                           f"{list(y) if isinstance(y, dict) else y}")
                continue
            if [v for k, v in x.items() if k != "param"] != [v for k, v in y.items() if k != "param"]:
                out.append(f"{key}: {x} vs {y}")
            x, y = x["param"], y["param"]
        if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
            out.append(f"{key}: tensor {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
    return out


@pytest.mark.parametrize("name", AUTOTP)
def test_same_tree_as_ds_to_universal(tmp_path, name):
    mine, theirs = ours(name, tmp_path / "ours"), ds_to_universal(name, tmp_path / "ds")
    a, b = _zero_tree(mine), _zero_tree(theirs)
    if name in TIED:    # ds_to_universal's tied alias file is TP rank 0's 16-bit shard; ours is whole
        alias = "lm_head.weight/fp32.pt"
        shard = _load(fixture_dir(name) / "global_step3" / "mp_rank_00_model_states.pt")["module"]
        assert torch.equal(b[alias]["param"], shard["model.embed_tokens.weight"].float())
        assert a[alias]["param"].shape == a["model.embed_tokens.weight/fp32.pt"]["param"].shape
        assert torch.equal(a[alias]["param"], a["model.embed_tokens.weight/fp32.pt"]["param"])
        del a[alias], b[alias]
    assert _differences(a, b) == []
    # every param has an affine map: no cat_dim anywhere; the vocabulary param says so
    keys = [list(v) for k, v in a.items() if not k.endswith("step.pt")]
    assert all(k in (["param"], ["vocab_tensor", "param"]) for k in keys) and ["vocab_tensor", "param"] in keys
    # one model-states file per TP rank, each rank's universal_checkpoint_info as the engine saved it
    tag = (mine / "latest_universal").read_text().strip()
    for rank in range(2):
        file = f"mp_rank_{rank:02d}_model_states.pt"
        got, want = _load(mine / tag / file), _load(theirs / tag / file)
        assert got["universal_checkpoint_info"] == want["universal_checkpoint_info"]
        assert {k: v.shape for k, v in got["module"].items()} == {k: v.shape for k, v in want["module"].items()}
    assert not (mine / tag / "mp_rank_02_model_states.pt").exists()


def _tensors(tree):
    return {k: v["param"] if isinstance(v, dict) else v for k, v in tree.items()}


def test_tp1_conversion_gives_the_same_tensors(tmp_path):
    """Via tp=1 DeepSpeed files (no universal_checkpoint_info left) the tree is a non-TP one, `cat_dim`
    0 as ds_to_universal writes without TP, and every tensor the same bytes."""
    direct = _zero_tree(ours(ENGINE_FIXTURE, tmp_path / "direct"))
    via = _zero_tree(via_tp1(ENGINE_FIXTURE, tmp_path / "via"))
    assert _differences(_tensors(via), _tensors(direct)) == []
    assert all(list(v) == ["cat_dim", "param"] and v["cat_dim"] == 0 for k, v in via.items() if k.endswith("fp32.pt"))


def test_tensor_parallel_universal_refuses_zero3_and_pipelines():
    proc = run_cli("convert", fixture_dir(ENGINE_FIXTURE), "/nonexistent/out", "--format", "universal",
                   "--to", "zero=3", check=1)
    assert "tensor-parallel universal checkpoint is written for ZeRO-1/2 only" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("convert", fixture_dir(ENGINE_FIXTURE), "/nonexistent/out", "--format", "universal",
                   "--to", "pp=2", check=1)
    assert "universal checkpoints are written for pp=1 only" in proc.stderr


def test_megatron_style_tp_source_is_refused(tmp_path):
    """Without AutoTP's affine maps ds_to_universal writes cat_dim / sub-param keys a Megatron loader
    slices by; we do not write those, so such a source is refused in one line, nothing written."""
    proc = run_cli("convert", fixture_dir("megatron_tp2_z1_fp32_dp2"), tmp_path / "out", "--format", "universal",
                   "--layout-rules", REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json", check=1)
    assert proc.stderr.strip().endswith("no AutoTP affine map in its universal_checkpoint_info; universal "
                                        "checkpoints of tensor-parallel sources are written for AutoTP only")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# the real engine resumes them


# (engine tp, world); AutoTP's process groups outlive an engine, so each tp runs in its own torchrun (the group
# of its jobs; tests/formats/deepspeed/test_tp_pp_convert.py's jobs of the same world and tp share it)
TOPOLOGIES = [(2, 4), (2, 2), (1, 2)]
SOURCES = ["ours", "ours-via-tp1", "ours-to-tp1", "ds_to_universal"]   # -to-tp1: --to tp=1 (one mp_rank file)


@shares("engine_tp_resume.py")
def universal_tp_jobs(out):
    """Our universal trees (three ways) and ds_to_universal's at each (tp, world), the control: (world, tp, job)."""
    checkpoints = {"ours": ours(ENGINE_FIXTURE, out / "ours"), "ours-via-tp1": via_tp1(ENGINE_FIXTURE, out / "via"),
                   "ours-to-tp1": ours(ENGINE_FIXTURE, out / "to-tp1", "tp=1"),
                   "ds_to_universal": ds_to_universal(ENGINE_FIXTURE, out / "ds")}
    checkpoints["control"] = _control(out)
    jobs = []
    for tp, world in TOPOLOGIES:
        sources = SOURCES if world == 2 else SOURCES[:2]    # --to tp=1 and ds_to_universal's: at world 2 only
        sources = sources + ["control"] if (tp, world) == (2, 2) else sources
        jobs += [(world, tp, {"key": f"{s} tp{tp} dp{world // tp}", "fixture": ENGINE_FIXTURE, "tp": tp,
                              "checkpoint": str(checkpoints[s]), "fixtures": str(FIXTURES), "universal": True})
                 for s in sources]
    return jobs


@pytest.fixture(scope="module")
def resumed(engine_launches):
    return {result["key"]: result for result in engine_launches.results(universal_tp_jobs)}


def _control(out):
    """Our output with one param's exp_avg and exp_avg_sq files swapped: the check must see it."""
    import shutil
    control = out / "control"
    shutil.copytree(out / "ours", control)
    folder = control / "global_step3" / "zero" / "model.layers.0.self_attn.q_proj.weight"
    (folder / "exp_avg.pt").rename(folder / "tmp.pt")
    (folder / "exp_avg_sq.pt").rename(folder / "exp_avg.pt")
    (folder / "tmp.pt").rename(folder / "exp_avg_sq.pt")
    return control


@pytest.mark.engine
def test_engine_check_sees_a_swapped_state(resumed):
    problems = resumed["control tp2 dp1"]["problems"]
    assert "exp_avg/model.layers.0.self_attn.q_proj.weight: differs from the saved engine's value" in \
        "\n".join(problems), problems
    assert all("q_proj" in p for p in problems), problems


CASES = [f"{s} tp{tp} dp{world // tp}" for tp, world in TOPOLOGIES for s in (SOURCES if world == 2 else SOURCES[:2])]


@pytest.mark.engine
@pytest.mark.parametrize("key", CASES)
def test_engine_resumes_universal_from_autotp(resumed, key):
    assert resumed[key]["problems"] == [], "\n".join(resumed[key]["problems"])
