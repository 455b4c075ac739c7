"""Lightning's FSDPStrategy (state_dict_type="sharded"): a real run at 2 CPU processes (tests/lightning_fsdp.py, its
FSDP1 on CPU by tests/cpu_fsdp.py) saves `step=3.ckpt/` (a DCP folder and Lightning's meta.pt); reshard reads it
whole and converts it for 3 processes, and `trainer.fit(model, ckpt_path=...)` resumes the converted folder there
with the weights, both Adam moments, each param's step, the global step and the scheduler of the source, read by
torch alone (dcp_to_torch_save, torch.load). Lightning resumes the unconverted folder at 3 too (DCP reshards on
load): recorded as such, not claimed as a failure reshard fixes."""
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import run_cli
from engine_launches import shares

pytestmark = pytest.mark.engine

SCRIPT = "lightning_fsdp.py"
STEPS = 3
TARGET = 3
MODEL_KEYS = 9          # 7 trainable, the tied head (FSDP1 saves it under its own name) and the buffer


@shares(SCRIPT)
def saves(out):
    """The run and another run's (the control), each saved by ModelCheckpoint at 2 processes."""
    return [(2, None, {"mode": "save", "dir": str(out / name), "seed": seed, "steps": STEPS})
            for name, seed in (("run", 0), ("control", 1))]


def truth_of(ckpt: Path, out: Path) -> Path:
    """What the saved folder holds, read by torch alone: its DCP items gathered by dcp_to_torch_save, Lightning's
    global step and scheduler by torch.load of meta.pt; {"tensors": {"model/<fqn>", "<state>/<fqn>"}, ...}."""
    whole = out.with_suffix(".whole.pt")
    dcp_to_torch_save(ckpt, whole)
    saved = torch.load(whole)
    whole.unlink()
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    tensors = {f"model/{k}": v for k, v in saved["model"].items()}
    for fqn, states in saved["optimizer_0"]["state"].items():
        tensors.update({f"{s}/{fqn}": v for s, v in states.items()})
    torch.save({"tensors": tensors, "global_step": meta["global_step"], "scheduler": meta["lr_schedulers"][0]}, out)
    return out


def _converted(tmp: Path) -> Path:
    return tmp / f"dp{TARGET}" / f"step={STEPS}.ckpt"


@shares(SCRIPT, after=(saves,))
def resumes(out, saved_runs):
    """The run converted for 3 processes, and at 3: the unconverted folder, then reshard's, each resumed."""
    run, control = (Path(r["ckpt"]) for r in saved_runs)
    tmp = run.parent.parent
    truth, wrong = truth_of(run, tmp / "run.pt"), truth_of(control, tmp / "control.pt")
    run_cli("convert", run, _converted(tmp), "--to", f"dp={TARGET}", check=0)
    job = {"truth": str(truth), "control": str(wrong), "steps": STEPS}
    return [(TARGET, None, {**job, "mode": "fail", "ckpt": str(run), "dir": str(out / "unconverted")}),
            (TARGET, None, {**job, "mode": "resume", "ckpt": str(_converted(tmp)), "dir": str(out / "converted")})]


@dataclass(frozen=True)
class Run:
    ckpt: Path
    truth: dict
    converted: Path
    unconverted: dict       # Lightning's resume of the source folder at 3 processes
    resumed: dict           # of reshard's


@pytest.fixture(scope="module")
def run(engine_launches) -> Run:
    saved = engine_launches.results(saves)
    unconverted, resumed = engine_launches.results(resumes)
    ckpt = Path(saved[0]["ckpt"])
    tmp = ckpt.parent.parent
    return Run(ckpt, torch.load(tmp / "run.pt"), _converted(tmp), unconverted, resumed)


def test_the_folder_is_what_lightning_writes(run):
    assert {p.name for p in run.ckpt.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}
    assert {p.name for p in run.converted.iterdir()} == {".metadata", "meta.pt", "reshard-manifest.json",
                                                         *(f"__{r}_0.distcp" for r in range(TARGET))}
    assert (run.converted / "meta.pt").read_bytes() == (run.ckpt / "meta.pt").read_bytes()


def test_inspect_and_validate_read_it_whole(run):
    for folder, dp in ((run.ckpt, 2), (run.converted, TARGET)):
        out = run_cli("inspect", folder, check=0).stdout
        assert f"format        Lightning + FSDP (sharded), dp={dp}\n" in out
        assert "optimizer     AdamW: states exp_avg, exp_avg_sq\n" in out and "step          3 (global_steps 3" in out
        info = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)
        assert info["framework"]["name"] == "Lightning"
        assert [f["path"] for f in info["framework"]["files"]] == ["meta.pt"]
        deep = json.loads(run_cli("validate", folder, "--deep", "--json", check=0).stdout)
        assert deep["ok"] and deep["problems"] == [] and deep["missing_elements"] == 0


def test_every_optimizer_state_maps_onto_a_model_parameter(run):
    """The optimizer's FQN-keyed states (FSDP1's optim_state_dict) land on the model's params: 7 trainable, each
    with both moments and its step, as torch's own reading of the folder has them."""
    info = json.loads(run_cli("inspect", run.ckpt, "--json", check=0).stdout)
    torch_states = {k.split("/", 1)[1] for k in run.truth["tensors"] if k.startswith("exp_avg/")}
    assert len(torch_states) == 7
    assert (info["trainable"], info["frozen"], info["buffers"]) == (7, 1, 1)    # the tied head: frozen
    assert info["optimizer"] == "AdamW" and info["global_steps"] == STEPS
    assert len({k for k in run.truth["tensors"] if k.startswith("model/")}) == MODEL_KEYS


def test_diff_and_export_equal_torch_reading(run, tmp_path):
    assert "no difference" in run_cli("diff", run.ckpt, run.converted, check=0).stdout
    run_cli("export", run.ckpt, tmp_path / "out", "--with-optimizer", check=0)
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "out" / "model.safetensors")
    moments = load_file(tmp_path / "out" / "optimizer-exp_avg.safetensors")
    for key, value in run.truth["tensors"].items():
        kind, fqn = key.split("/", 1)
        if kind == "model" and fqn in weights:
            assert torch.equal(weights[fqn], value), key
        if kind == "exp_avg":
            assert torch.equal(moments[fqn], value), key
    assert {k for k in weights} >= {k.split("/", 1)[1] for k in run.truth["tensors"] if k.startswith("exp_avg/")}


def test_lightning_resumes_the_converted_folder_exactly(run):
    got = run.resumed
    assert got["world"] == TARGET and got["problems"] == [] and got["compared"] == len(run.truth["tensors"]) == 30
    # negative control: another run's truth fails in every weight and moment
    missed = {p.split(":")[0] for p in got["control_problems"]}
    assert {k for k in run.truth["tensors"] if not k.startswith(("step/", "model/net.positions"))} <= missed
    assert (got["global_step"], got["epoch"]) == (run.truth["global_step"], 0) == (STEPS, 0)
    assert got["scheduler"] == {k: run.truth["scheduler"][k] for k in got["scheduler"]}
    assert got["lr"] == run.truth["scheduler"]["_last_lr"][0]
    # one more step, the scheduler stepping on
    assert got["after_step"] == STEPS + 1 and got["scheduler_after"]["last_epoch"] == STEPS + 1


def test_lightning_itself_reshards_a_sharded_folder_on_load(run):
    """Not a failure reshard fixes: DCP reshards on load, so Lightning resumes the 2-process folder at 3 as
    exactly as reshard's (this records it; the conversion's value is another strategy's folder)."""
    assert run.unconverted["error"] is None
    assert run.unconverted["resumed"]["problems"] == [] and run.unconverted["resumed"]["world"] == TARGET


@pytest.mark.parametrize("fmt", ["deepspeed"])
def test_another_strategy_is_refused_in_one_line(tmp_path, fmt):
    """Lightning's meta.pt has no place in a DeepSpeed folder (DeepSpeedStrategy reads its state from the client
    state): refused, nothing written, rather than a folder Lightning would resume without its loops."""
    source = Path(__file__).parent.parent / "fixtures" / "lightning_fsdp_dp2" / f"step={STEPS}.ckpt"
    got = run_cli("convert", source, tmp_path / "out", "--format", fmt, "--to", "dp=2,zero=2")
    assert got.returncode == 1 and not (tmp_path / "out").exists()
    assert got.stderr.strip().splitlines() == [f"reshard: {source}: Lightning's state (meta.pt) is not carried into "
                                               f"a {fmt} folder yet: convert within fsdp, or export the weights"]
