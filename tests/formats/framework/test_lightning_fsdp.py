"""Lightning's FSDPStrategy (state_dict_type="sharded"): a real run at 2 CPU processes (tests/scripts/lightning_fsdp.py,
its FSDP1 on CPU by tests/helpers/cpu_fsdp.py) saves `step=3.ckpt/` (a DCP folder and Lightning's meta.pt); reshard
reads it whole and converts it for 3 processes, and `trainer.fit(model, ckpt_path=...)` resumes the converted folder
there with the weights, both Adam moments, each param's step, the global step and the scheduler of the source, read by
torch alone (dcp_to_torch_save, torch.load). Lightning resumes the unconverted folder at 3 too (DCP reshards on
load): recorded as such, not claimed as a failure reshard fixes.

Between strategies: a DeepSpeedStrategy ZeRO-2 save at 2 (tests/scripts/lightning_deepspeed.py, sharing its launches)
converted to FSDPStrategy's folder at 3 and resumed by FSDPStrategy, equal to the live engine at save time; the FSDP
save converted to DeepSpeedStrategy's folder at 3 and resumed by DeepSpeedStrategy, equal to torch's reading of it.
Neither unconverted folder resumes under the other strategy.

Thinned: ModelParallelStrategy's save (FSDP2) thinned by `reshard thin` to what ModelCheckpoint(save_weights_only=True)
writes, loaded by the strategy's own weights-only load (trainer.validate, "weights" jobs in the launch at 3)."""
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.engine_launches import shares
from tests.helpers.fsdp_truths import lightning_truth as truth_of, one_step_off as wrong_of
from tests.helpers.thin_runs import check_lifecycle, series

pytestmark = pytest.mark.engine

SCRIPT = "lightning_fsdp.py"
DEEPSPEED_SCRIPT = "lightning_deepspeed.py"
MODEL_PARALLEL = "model_parallel"
FSDP_REFUSES = "does not point to a valid checkpoint"         # FSDPStrategy.load_checkpoint, given DeepSpeed's folder
STEPS = 3
TARGET = 3
MP_CHANGED = "net.mix.weight"     # (not net.emb.weight: the live model ties net.head.weight to it)
MODEL_KEYS = 9          # 7 trainable, the tied head (FSDP1 saves it under its own name) and the buffer


@shares(SCRIPT)
def saves(out):
    """The run, saved by ModelCheckpoint at 2 processes; again with state_dict_type="full" (one file), and under
    ModelParallelStrategy (FSDP2)."""
    return [(2, None, {"mode": "save", "dir": str(out / "run"), "seed": 0, "steps": STEPS}),
            (2, None, {"mode": "save", "dir": str(out / "full"), "seed": 0, "steps": STEPS, "state_dict_type": "full"}),
            (2, None, {"mode": "save", "dir": str(out / "model-parallel"), "seed": 0, "steps": STEPS,
                       "strategy": MODEL_PARALLEL})]


def _converted(tmp: Path, kind: str = "") -> Path:
    return tmp / f"{kind}dp{TARGET}" / f"step={STEPS}.ckpt"


@shares(DEEPSPEED_SCRIPT)
def deepspeed_saves(out):
    """The same model, data and seed trained by DeepSpeedStrategy (ZeRO-2) at 2 processes; its truth is the live
    engine at save time (tests/scripts/lightning_deepspeed.py)."""
    return [(2, None, {"mode": "save", "dir": str(out / "run"), "seed": 0, "stage": 2,
                       "truth": str(out / "run.safetensors"), "steps": STEPS})]


def fsdp_truth_of_engine(engine_truth: Path, out: Path) -> Path:
    """The live DeepSpeed engine's truth in the FSDP resume's terms: model/<fqn> the fp32 master (the module's
    weights where there is none: the tied head, the buffer), both moments, and each param's step, which Adam keeps
    per param: the global step, as Lightning saved it."""
    engine, meta = load_file(engine_truth), json.loads(Path(f"{engine_truth}.json").read_text())
    tensors = {}
    for key, value in engine.items():
        kind, name = key.split("/", 1)
        if kind == "fp32":
            tensors[f"model/{name}"] = value
            tensors[f"step/{name}"] = torch.tensor(float(meta["global_step"]))
        elif kind in ("exp_avg", "exp_avg_sq"):
            tensors[key] = value
    for key, value in engine.items():
        kind, name = key.split("/", 1)
        if kind == "module":
            tensors.setdefault(f"model/{name}", value)
    torch.save({"tensors": tensors, "global_step": meta["global_step"], "scheduler": meta["scheduler"]}, out)
    return out


def engine_truth_of(truth: Path, out: Path) -> Path:
    """torch's reading of an FSDP folder (truth_of) in the DeepSpeed resume's terms (tests/helpers/engine_state.py)."""
    tensors = torch.load(truth)["tensors"]
    engine = {}
    for key, value in tensors.items():
        kind, name = key.split("/", 1)
        if kind == "model":
            engine[f"module/{name}"] = value.contiguous()
            if f"exp_avg/{name}" in tensors:
                engine[f"fp32/{name}"] = value.clone()
        elif kind in ("exp_avg", "exp_avg_sq"):
            engine[key] = value.contiguous()
    save_file(engine, out)
    return out


@shares(SCRIPT, after=(saves, deepspeed_saves))
def resumes(out, saved_runs, deepspeed_runs):
    """At 3 processes under FSDPStrategy: the FSDP run unconverted and converted for 3; the DeepSpeed run
    unconverted (which must fail) and converted to FSDP's folder for 3."""
    run = Path(saved_runs[0]["ckpt"])
    tmp = run.parent.parent
    truth = truth_of(run, tmp / "run.pt")
    wrong = wrong_of(truth, tmp / "wrong.pt")
    run_cli("convert", run, _converted(tmp), "--to", f"dp={TARGET}", check=0)
    deepspeed = Path(deepspeed_runs[0]["ckpt"])
    run_cli("convert", deepspeed, _converted(tmp, "from-deepspeed-"), "--format", "fsdp", "--to", f"dp={TARGET}",
            check=0)
    engine_truth = fsdp_truth_of_engine(deepspeed.parent.parent / "run.safetensors", tmp / "deepspeed-run.pt")
    job = {"truth": str(truth), "control": str(wrong), "steps": STEPS}
    crossed = {**job, "truth": str(engine_truth)}
    parallel = Path(saved_runs[2]["ckpt"])
    run_cli("convert", parallel, _converted(tmp, "model-parallel-"), "--to", f"dp={TARGET}", check=0)
    sharded = {**job, "truth": str(truth_of(parallel, tmp / "model-parallel.pt")), "strategy": MODEL_PARALLEL}
    thinned = thinned_model_parallel(parallel, tmp)
    changed = shutil.copytree(thinned, tmp / "mp-changed" / thinned.name)
    change_dcp_element(changed, MP_CHANGED, state="module")
    weights = {"mode": "weights", "truth": sharded["truth"], "strategy": MODEL_PARALLEL,
               "control": str(wrong_of(Path(sharded["truth"]), tmp / "model-parallel-wrong.pt"))}
    return [(TARGET, None, {**job, "mode": "fail", "ckpt": str(run), "dir": str(out / "unconverted")}),
            (TARGET, None, {**job, "mode": "resume", "ckpt": str(_converted(tmp)), "dir": str(out / "converted")}),
            (TARGET, None, {**crossed, "mode": "fail", "ckpt": str(deepspeed), "dir": str(out / "ds-unconverted")}),
            (TARGET, None, {**crossed, "mode": "resume", "ckpt": str(_converted(tmp, "from-deepspeed-")),
                            "dir": str(out / "ds-converted")}),
            (TARGET, None, {**sharded, "mode": "resume", "ckpt": str(_converted(tmp, "model-parallel-")),
                            "dir": str(out / "mp-converted")}),
            # the strategy's weights-only load (trainer.validate) of the thinned folder, and of a changed copy
            *((TARGET, None, {**weights, "ckpt": str(folder)}) for folder in (thinned, changed))]


def thinned_model_parallel(saved: Path, tmp: Path) -> Path:
    """ModelParallelStrategy's save copied as step=1.ckpt and step=2.ckpt of a run, `reshard thin --yes` run on the
    first: the folder ModelCheckpoint(save_weights_only=True) writes."""
    run = tmp / "mp-run"
    if not run.exists():
        series(saved, run, ("step=1.ckpt", "step=2.ckpt"))
        run_cli("thin", run / "step=1.ckpt", "--yes", check=0)
    return run / "step=1.ckpt"


@shares(DEEPSPEED_SCRIPT, after=(saves,))
def deepspeed_resumes(out, saved_runs):
    """At 3 processes under DeepSpeedStrategy (ZeRO-2): the FSDP run unconverted (which must fail) and converted to
    DeepSpeed's folder for 3."""
    run = Path(saved_runs[0]["ckpt"])
    tmp = run.parent.parent
    target = _converted(tmp, "to-deepspeed-")
    run_cli("convert", run, target, "--format", "deepspeed", "--to", f"dp={TARGET},zero=2", check=0)
    truth = engine_truth_of(truth_of(run, tmp / "run.pt"), out / "run.safetensors")
    wrong = engine_truth_of(wrong_of(truth_of(run, tmp / "run.pt"), tmp / "wrong.pt"), out / "wrong.safetensors")
    job = {"truth": str(truth), "control": str(wrong), "stage": 2, "steps": STEPS}
    return [(TARGET, None, {**job, "mode": "fail", "ckpt": str(run), "dir": str(out / "unconverted")}),
            (TARGET, None, {**job, "mode": "resume", "ckpt": str(target), "dir": str(out / "converted")})]


@dataclass(frozen=True)
class Run:
    ckpt: Path
    truth: dict
    converted: Path
    unconverted: dict       # Lightning's resume of the source folder at 3 processes
    resumed: dict           # of reshard's
    full: Path              # the same run saved with state_dict_type="full"
    deepspeed: Path         # DeepSpeedStrategy's save of the same run
    crossed: dict           # {"to-fsdp"|"to-deepspeed": (the unconverted folder's resume, reshard's)}
    model_parallel: tuple   # ModelParallelStrategy's save, and reshard's folder's resume at 3


@pytest.fixture(scope="module")
def run(engine_launches) -> Run:
    saved = engine_launches.results(saves)
    unconverted, resumed, ds_unconverted, to_fsdp, mp_resumed = engine_launches.results(resumes)[:5]
    fsdp_unconverted, to_deepspeed = engine_launches.results(deepspeed_resumes)
    ckpt = Path(saved[0]["ckpt"])
    tmp = ckpt.parent.parent
    return Run(ckpt, torch.load(tmp / "run.pt"), _converted(tmp), unconverted, resumed, Path(saved[1]["ckpt"]),
               Path(engine_launches.results(deepspeed_saves)[0]["ckpt"]),
               {"to-fsdp": (ds_unconverted, to_fsdp), "to-deepspeed": (fsdp_unconverted, to_deepspeed)},
               (Path(saved[2]["ckpt"]), mp_resumed))


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
    # negative control: a truth one step off fails in every weight and moment
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


def test_a_deepspeed_run_goes_on_under_fsdp(run):
    """DeepSpeedStrategy ZeRO-2 at 2 -> FSDPStrategy at 3: every weight, both moments and each param's step equal
    the live engine's at save time; the global step, the scheduler and one more step as Lightning saved them."""
    unconverted, got = run.crossed["to-fsdp"]
    assert unconverted["error"] and FSDP_REFUSES in unconverted["error"], unconverted
    assert {p.name for p in _converted(run.ckpt.parent.parent, "from-deepspeed-").iterdir()} == {
        ".metadata", "meta.pt", "reshard-manifest.json", *(f"__{r}_0.distcp" for r in range(TARGET))}
    # diff across the two formats: DeepSpeed's save and FSDP's folder hold the same
    assert "no difference" in run_cli("diff", run.deepspeed, _converted(run.ckpt.parent.parent, "from-deepspeed-"),
                                      check=0).stdout
    assert got["world"] == TARGET and got["problems"] == [] and got["compared"] == 30
    missed = {p.split(":")[0] for p in got["control_problems"]}
    assert {k for k in run.truth["tensors"] if not k.startswith(("step/", "model/net.positions"))} <= missed
    meta = json.loads((run.deepspeed.parent.parent / "run.safetensors.json").read_text())
    assert (got["global_step"], got["epoch"], got["scheduler"], got["lr"]) == (
        meta["global_step"], meta["epoch"], meta["scheduler"], meta["lr"])
    assert got["after_step"] == STEPS + 1 and got["scheduler_after"]["last_epoch"] == STEPS + 1


def test_an_fsdp_run_goes_on_under_deepspeed(run):
    """FSDPStrategy at 2 -> DeepSpeedStrategy ZeRO-2 at 3: the engine's fp32 masters, both moments and module
    weights equal torch's reading of the FSDP folder; Lightning's state (meta.pt) is DeepSpeed's client state."""
    unconverted, got = run.crossed["to-deepspeed"]
    assert unconverted["error"], unconverted         # DeepSpeed finds no `latest` in FSDP's folder
    target = _converted(run.ckpt.parent.parent, "to-deepspeed-")
    assert "format        Lightning + DeepSpeed ZeRO-2, dp=3 (tag checkpoint)\n" in run_cli("inspect", target,
                                                                                              check=0).stdout
    assert "no difference" in run_cli("diff", run.ckpt, target, check=0).stdout
    assert got["world"] == TARGET and got["problems"] == [] and got["compared"] == 30
    missed = {p.split(":")[0] for p in got["control_problems"]}
    assert {k for k in missed if k.startswith(("fp32/", "exp_avg"))} and len(missed) >= 21
    assert (got["global_step"], got["epoch"]) == (run.truth["global_step"], 0) == (STEPS, 0)
    assert got["scheduler"] == {k: run.truth["scheduler"][k] for k in got["scheduler"]}
    assert got["after_step"] == STEPS + 1 and got["lr_after"] == run.truth["scheduler"]["_last_lr"][0] / 2


def test_the_full_file_is_a_lightning_ckpt_read_whole(run, tmp_path):
    """state_dict_type="full": one torch.save file of Lightning's checkpoint dict, the whole module's state dict
    and the optimizer rekeyed by FSDP to parameter ids (FSDP.rekey_optim_state_dict). Nothing in it says FSDP (a
    one-process save looks the same), so reshard reads it as a Lightning .ckpt; its ids map onto the parameters in
    the module's order: the same run's sharded folder, as torch reads it, holds the same weights and moments."""
    assert run.full.is_file() and run.full.name == f"step={STEPS}.ckpt"
    saved = torch.load(run.full, weights_only=False)
    assert set(saved) == {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
                          "optimizer_states", "lr_schedulers", "hparams_name", "hyper_parameters"}
    assert sorted(saved["optimizer_states"][0]["state"]) == list(range(7))      # ids, not names
    info = json.loads(run_cli("inspect", run.full, "--json", check=0).stdout)
    assert (info["format"], info["trainable"], info["global_steps"]) == ("lightning", 7, STEPS)
    assert json.loads(run_cli("validate", run.full, "--deep", "--json", check=0).stdout)["ok"]
    assert "no difference" in run_cli("diff", run.full, run.ckpt, check=0).stdout
    run_cli("export", run.full, tmp_path / "out", "--with-optimizer", check=0)
    compared = 0
    for state, file in (("model", "model"), ("exp_avg", "optimizer-exp_avg"), ("exp_avg_sq", "optimizer-exp_avg_sq")):
        exported = load_file(tmp_path / "out" / f"{file}.safetensors")
        for key, value in run.truth["tensors"].items():
            if key.startswith(f"{state}/") and key.split("/", 1)[1] in exported:
                assert torch.equal(exported[key.split("/", 1)[1]], value), key
                compared += 1
    assert compared >= 7 * 3


def test_model_parallel_strategy_is_read_and_resumed_at_another_size(run):
    """ModelParallelStrategy (FSDP2 through fully_shard, DCP): the same folder with the model under `state_dict`;
    read whole, converted for 3 processes in its own layout, resumed there by the strategy equal to torch's reading
    of the source (the same run as the FSDPStrategy one: equal to it too). Like FSDPStrategy's, its unconverted
    folder would resume at 3 as well (DCP reshards on load; not launched again here)."""
    saved, got = run.model_parallel
    converted = _converted(run.ckpt.parent.parent, "model-parallel-")
    for folder, dp in ((saved, 2), (converted, TARGET)):
        assert f"format        Lightning + ModelParallelStrategy (FSDP2, sharded), dp={dp}\n" in run_cli(
            "inspect", folder, check=0).stdout
        assert json.loads(run_cli("validate", folder, "--deep", "--json", check=0).stdout)["ok"]
    assert "no difference" in run_cli("diff", saved, run.ckpt, check=0).stdout
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(converted)).read_metadata().state_dict_metadata
    assert {k.split(".", 1)[0] for k in keys} == {"state_dict", "optimizer_0"}
    assert got["world"] == TARGET and got["problems"] == [] and got["compared"] == 30
    assert {p.split(":")[0] for p in got["control_problems"]} >= {k for k in run.truth["tensors"]
                                                                 if k.startswith("exp_avg")}
    assert (got["global_step"], got["after_step"]) == (STEPS, STEPS + 1)
    assert got["scheduler"] == {k: run.truth["scheduler"][k] for k in got["scheduler"]}


def test_model_parallel_folder_thinned_loads_with_the_strategys_weights_only_load(run, engine_launches, tmp_path):
    """ModelParallelStrategy's folder thinned as save_weights_only writes it: `{"state_dict": ...}` alone by DCP and
    meta.pt less callbacks and schedulers; `list` calls it complete and weights-only, its export is the full one's,
    a flipped byte is caught by `validate --deep`; the strategy's own load in trainer.validate at 3 processes gives
    the full folder's weights bit for bit, not those one step off, and names the one changed element of a copy."""
    saved = run.model_parallel[0]
    thinned = thinned_model_parallel(saved, saved.parent.parent)
    meta, full = (torch.load(f / "meta.pt", weights_only=True) for f in (thinned, saved))
    assert set(full) - set(meta) == {"callbacks", "lr_schedulers"} and all(meta[k] == full[k] for k in meta)
    keys = dcp.FileSystemReader(str(thinned)).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("state_dict.") for k in keys)
    check_lifecycle(thinned.parent, "step=1.ckpt", "step=2.ckpt", tmp_path, MP_CHANGED)
    loaded, changed = engine_launches.results(resumes)[5:]
    assert loaded["ckpt"] == str(thinned) and loaded["compared"] > 0 and loaded["problems"] == [], loaded
    assert len(loaded["control_problems"]) == loaded["compared"]
    assert changed["problems"] == [f"model/{MP_CHANGED}: differs after resume"], changed
