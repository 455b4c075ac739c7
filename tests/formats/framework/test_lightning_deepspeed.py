"""Lightning's DeepSpeedStrategy checkpoints: a real ZeRO-2 (and ZeRO-3) run at 2 devices saves `step=3.ckpt/`
(ModelCheckpoint), reshard converts the folder for 1 and 3 devices, and `trainer.fit(model, ckpt_path=...)` resumes it
there (tests/scripts/lightning_deepspeed.py; its ranks cannot import reshard). Without reshard the same resume fails
with
DeepSpeed's error."""
import filecmp
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import fixture_dir
from tests.helpers.pickles import load_without_reshard, pickle_globals

pytestmark = pytest.mark.engine

STEPS = 3
SIZES = (1, 3)
DEEPSPEED_REFUSES = "Automatic adjustment of ZeRO's optimizer state partitioning with a new world size"
# what Lightning adds to DeepSpeed's model states as client state (DeepSpeedStrategy.save_checkpoint)
LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers",
                  "hparams_name", "hyper_parameters")


@dataclass(frozen=True)
class Saved:
    stage: int
    tmp: Path
    ckpt: Path          # the *.ckpt/ folder Lightning wrote
    truth: Path         # the live engine at save time (safetensors)
    control: Path       # another run's (seed 1)
    meta: dict          # what Lightning saved: global_step, epoch, scheduler, ModelCheckpoint state; lr


STAGES = (2, 3)


@shares("lightning_deepspeed.py")
def saves(out):
    """Per ZeRO stage, the run and another run's (the control), in out/zero{stage}: (2, None, job)."""
    return [(2, None, {"mode": "save", "dir": str(out / f"zero{stage}" / name), "seed": seed, "stage": stage,
                       "truth": str(out / f"zero{stage}" / f"{name}.safetensors"), "steps": STEPS})
            for stage in STAGES for name, seed in (("run", 0), ("control", 1))]


@pytest.fixture(scope="module", params=STAGES, ids=[f"zero{s}" for s in STAGES])
def saved(request, engine_launches) -> Saved:
    stage = request.param
    run = engine_launches.results(saves)[2 * STAGES.index(stage)]
    ckpt = Path(run["ckpt"])
    tmp = ckpt.parent.parent
    meta = json.loads((tmp / "run.safetensors.json").read_text())
    return Saved(stage, tmp, ckpt, tmp / "run.safetensors", tmp / "control.safetensors", meta)


def _converted(ckpt: Path, size: int) -> Path:
    return ckpt.parent.parent / f"dp{size}" / f"step={STEPS}.ckpt"


@shares("lightning_deepspeed.py", after=(saves,))
def resumes(out, saved_runs):
    """Each stage's save converted to every size, and at each size the unconverted save (which must fail) and
    reshard's folder resumed: (size, None, job)."""
    jobs = []
    for stage, run in zip(STAGES, saved_runs[::2], strict=True):
        ckpt = Path(run["ckpt"])
        tmp = ckpt.parent.parent
        job = {"dir": str(ckpt.parent), "truth": str(tmp / "run.safetensors"),
               "control": str(tmp / "control.safetensors"), "stage": stage, "steps": STEPS}
        for size in SIZES:
            run_cli("convert", ckpt, _converted(ckpt, size), "--to", f"dp={size}", check=0)
            jobs += [(size, None, {**job, "mode": "fail", "ckpt": str(ckpt)}),
                     (size, None, {**job, "mode": "resume", "ckpt": str(_converted(ckpt, size))})]
    return jobs


@pytest.fixture(scope="module")
def converted(saved, engine_launches) -> dict:
    """{devices: the folder reshard wrote for them} (by the command line, before the resumes)."""
    engine_launches.results(resumes)
    return {size: _converted(saved.ckpt, size) for size in SIZES}


def test_inspect_says_lightning_around_deepspeed(saved, converted):
    for folder, dp in ((saved.ckpt, 2), *((converted[s], s) for s in SIZES)):
        line = f"format        Lightning + DeepSpeed ZeRO-{saved.stage}, dp={dp} (tag checkpoint)\n"
        assert line in run_cli("inspect", folder, check=0).stdout
        framework = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)["framework"]
        assert framework["name"] == "Lightning" and framework["files"] == []   # its state is DeepSpeed's client state
    # a DeepSpeed save whose client state is not Lightning's names no framework
    plain = json.loads(run_cli("inspect", fixture_dir("z2_fp32_dp2"), "--json", check=0).stdout)
    assert plain["framework"] is None
    assert "Lightning" not in run_cli("inspect", fixture_dir("z2_fp32_dp2"), check=0).stdout


def test_converted_folder_is_what_lightning_writes(saved, converted):
    beside = {p.name for p in saved.ckpt.iterdir()}
    assert beside == {"latest", "checkpoint", "zero_to_fp32.py", "zero_to_torch.py"}
    for size, folder in converted.items():
        assert {p.name for p in folder.iterdir()} == beside | {"reshard-manifest.json"}
        assert (folder / "latest").read_text() == (saved.ckpt / "latest").read_text()
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            assert filecmp.cmp(folder / script, saved.ckpt / script, shallow=False)
        models = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(size)] if saved.stage == 3
                  else ["mp_rank_00_model_states.pt"])
        assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == sorted(
            models + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(size)])
        run_cli("validate", folder, "--checksums", check=0)


def test_converted_pickles_load_without_reshard(saved, converted):
    """Lightning's client state (ModelCheckpoint's kth_value, best_model_score and best_k_models are tensors) loads
    with torch alone, equal to the source's, and no output pickle names a global its source did not."""
    sources = sorted((saved.ckpt / "checkpoint").glob("*model_states.pt"))   # ZeRO-3: one per rank, alike
    targets = [p for folder in converted.values() for p in sorted((folder / "checkpoint").glob("*model_states.pt"))]
    loaded = load_without_reshard({p: list(LIGHTNING_KEYS) for p in [*sources, *targets]}, cwd=saved.tmp)
    want = loaded[str(sources[0])]
    tensors = [v for _, v in want if isinstance(v, dict) and v.get("class") == "Tensor"]
    assert len(tensors) >= 4         # kth_value, best_model_score, current_score, best_k_models' score
    for target in targets:
        assert loaded[str(target)] == want, target

    def names(kind):
        return set().union(*(pickle_globals(p) for p in (saved.ckpt / "checkpoint").glob(f"*{kind}.pt")))
    origin = {kind: names(kind) for kind in ("model_states", "optim_states")}
    for folder in converted.values():
        for path in (folder / "checkpoint").iterdir():
            allowed = origin["model_states" if path.name.endswith("model_states.pt") else "optim_states"]
            assert pickle_globals(path) <= allowed, (path, pickle_globals(path) - allowed)


@pytest.fixture(scope="module")
def resumed(saved, engine_launches) -> dict:
    """{devices: (the resume of the unconverted save at that size, the resume of reshard's folder)}: one launch per
    size, for both stages."""
    results = iter(engine_launches.results(resumes))
    by_stage = {(stage, size): (next(results), next(results)) for stage in STAGES for size in SIZES}
    return {size: by_stage[(saved.stage, size)] for size in SIZES}


def scheduled_lr(scheduler: dict, steps: int) -> float:
    """The lr torch's StepLR gives after `steps` steps (a fresh one, independent of any checkpoint)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=scheduler["base_lrs"][0])
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=scheduler["step_size"], gamma=scheduler["gamma"])
    for _ in range(steps):
        optimizer.step()
        step_lr.step()
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("size", SIZES)
def test_deepspeed_alone_cannot_resume_at_another_size(resumed, size):
    baseline, _ = resumed[size]
    assert baseline["error"] and DEEPSPEED_REFUSES in baseline["error"], baseline


@pytest.mark.parametrize("size", SIZES)
def test_lightning_resumes_reshard_output_exactly(saved, resumed, size):
    _, got = resumed[size]
    with safe_open(str(saved.truth), "pt") as f:
        truth_keys = set(f.keys())
    # the live engine right after Lightning's restore: fp32 params, both Adam moments, module weights, bit for bit
    assert got["world"] == size and got["problems"] == [] and got["compared"] == len(truth_keys) >= 28
    # negative control: another run's truth fails in every fp32 param and moment
    missed = {p.split(":")[0] for p in got["control_problems"]}
    assert {k for k in truth_keys if not k.startswith("module/")} <= missed
    meta = saved.meta
    assert (got["global_step"], got["epoch"], got["scheduler"], got["lr"]) == (
        meta["global_step"], meta["epoch"], meta["scheduler"], meta["lr"])
    assert meta["global_step"] == STEPS
    # ModelCheckpoint restored with real tensors (its current_score is not restored by Lightning, by design)
    restored = {k: v for k, v in got["model_checkpoint"].items() if k != "current_score"}
    assert restored == {k: v for k, v in meta["model_checkpoint"].items() if k != "current_score"}
    assert restored["kth_value"] == {"tensor": float("inf")} and "tensor" in restored["best_model_score"]
    # one more step, at the scheduled lr
    assert got["after_step"] == STEPS + 1 and got["scheduler_after"]["last_epoch"] == STEPS + 1
    assert got["lr_after"] == scheduled_lr(meta["scheduler"], STEPS + 1) != meta["lr"]
