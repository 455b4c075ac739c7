"""`reshard thin` of FSDP's saves in the frameworks' folders: each the folder less the optimizer's files, loaded by the
framework's own load of the model alone, its weights bit for bit the full checkpoint's.

- HF Trainer with FSDP's SHARDED_STATE_DICT (fixtures/hf_fsdp_sharded_dp2/checkpoint-3, the real Trainer at 2
  processes): less `optimizer_0/`. The Trainer's resume (`train(resume_from_checkpoint=)`;
  tests/scripts/hf_trainer_strategies.py "weights" at 3 processes, in the launch of
  tests/formats/framework/test_hf_fsdp_deepspeed.py's resumes) loads `pytorch_model_fsdp_0/` (`_load_from_checkpoint`)
  and, finding no optimizer folder, neither optimizer nor scheduler: every weight equals torch's own dcp_to_torch_save
  of the full folder, the global step is the checkpoint's.
- Accelerate's save_state with FSDP2 (fixtures/accelerate_fsdp_{sharded,full}_dp2/state, real at 2 processes): less
  `optimizer_0/`, or less `optimizer.bin` with FULL_STATE_DICT. `accelerator.load_state(dir)` with the model alone
  prepared (tests/scripts/accelerate_strategies.py "weights" at 3 processes, in
  tests/formats/framework/test_accelerate_fsdp_deepspeed.py's launch): every weight equals the full folder's
  (dcp_to_torch_save, torch.load), the registered object comes back.
Negative controls: each load compared with another run's weights at the same step (the DeepSpeed run's) differs in
every one; a thinned copy with one weight element changed loads with exactly that tensor named; a flipped byte of a
thinned weight file is caught by `validate --deep`; a folder whose `optimizer_0/` is missing without thin's record
(a save that stopped between model and optimizer) is not listed complete. Each thinned folder: `list` complete,
TIER weights; `inspect` weights-only; `export` the full one's byte for byte; `diff` only the optimizer one-sided;
`convert` to DeepSpeed or FSDP's folders (which resume training) refused in one line, nothing written.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element, flip_weight
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.fsdp_truths import full_truth, sharded_truth
from tests.helpers.thin_runs import series, thinned_lightning, thinned_titan
from tests.helpers.trainer_saves import deepspeed_trainer_saves

HF_SHARDED = FIXTURES / "hf_fsdp_sharded_dp2" / "checkpoint-3"
ACC_SHARDED = FIXTURES / "accelerate_fsdp_sharded_dp2" / "state"
ACC_FULL = FIXTURES / "accelerate_fsdp_full_dp2" / "state"
ACC_DEEPSPEED_TRUTH = FIXTURES / "accelerate_deepspeed_z2_dp2" / "truth.safetensors"
CHANGED = "model.layers.1.mlp.up_proj.weight"
# (source, run folder, its checkpoints' names, the files the thin drops)
SOURCES = {"hf-sharded": (HF_SHARDED, "hf", ("checkpoint-1", "checkpoint-2"), "optimizer_0"),
           "accelerate-sharded": (ACC_SHARDED, "acc", ("checkpoint_1", "checkpoint_2"), "optimizer_0"),
           "accelerate-full": (ACC_FULL, "acc-full", ("checkpoint_1", "checkpoint_2"), "optimizer.bin")}


def thinned(kind: str, root: Path) -> tuple[Path, Path]:
    """A run of two copies of the source, the older thinned by `reshard thin --yes`: (thinned, full)."""
    source, folder, names, _ = SOURCES[kind]
    run = series(source, root / folder, names)
    run_cli("thin", run / names[0], "--yes", check=0)
    return run / names[0], run / names[1]


def files(folder: Path) -> set:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def changed_copy(folder: Path, to: Path) -> Path:
    """A copy of the thinned `folder` with one element of CHANGED's weights changed, as a save of another value
    writes it (its CRC-32 matching)."""
    changed = Path(shutil.copytree(folder, to))
    if (changed / "pytorch_model_fsdp.bin").exists():
        weights = torch.load(changed / "pytorch_model_fsdp.bin", weights_only=True)
        weights[CHANGED].view(-1)[0] += 1
        torch.save(weights, changed / "pytorch_model_fsdp.bin")
    else:
        change_dcp_element(changed, CHANGED, state="module")
    return changed


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_thinned_folder_is_the_full_one_less_its_optimizer(kind, tmp_path):
    folder, full = thinned(kind, tmp_path)
    dropped = SOURCES[kind][3]
    assert files(folder) == {n for n in files(full) if n.split("/")[0] != dropped} | {"reshard-thinned.json"}
    rows = {r["name"]: r for r in json.loads(run_cli("list", folder.parent, "--json", check=0).stdout)["checkpoints"]}
    assert rows[folder.name]["status"] == "complete" and rows[folder.name]["weights_only"] is True
    assert rows[full.name]["weights_only"] is False and rows[folder.name]["bytes"] < rows[full.name]["bytes"]
    assert rows[folder.name]["bytes_by_kind"]["optimizer"] == 0
    assert rows[folder.name]["bytes_by_kind"]["weights"] == rows[full.name]["bytes_by_kind"]["weights"]
    table = {line.split()[-1]: line.split()[-2] for line in run_cli("list", folder.parent, check=0).stdout.splitlines()
             if line.rstrip().endswith((folder.name, full.name))}
    assert table == {folder.name: "weights", full.name: "full"}
    assert "tier          weights-only (thinned from a full" in run_cli("inspect", folder, check=0).stdout
    assert reshard.validate(str(folder), deep=True).ok
    run_cli("export", full, tmp_path / "full.safetensors", "--quiet", check=0)
    run_cli("export", folder, tmp_path / "thin.safetensors", "--quiet", check=0)
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()
    diff = run_cli("diff", full, folder, check=0).stdout
    assert "only A holds optimizer state (exp_avg, exp_avg_sq); weights compared" in diff and "no difference" in diff
    for target, spec in (("deepspeed", "dp=2,zero=2"), ("fsdp", "dp=3")):
        proc = run_cli("convert", folder, tmp_path / target, "--format", target, "--to", spec, check=1)
        assert proc.stderr.strip().splitlines() == [
            f"reshard: {folder}: no optimizer state (weights only); "
            f"{'a DeepSpeed checkpoint' if target == 'deepspeed' else 'a framework' + chr(39) + 's FSDP folder'} "
            "resumes training and needs the optimizer's state, so it is not written"]
        assert not (tmp_path / target).exists()


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_a_flipped_byte_of_a_thinned_weight_is_caught(kind, tmp_path):
    folder, _ = thinned(kind, tmp_path)
    flipped = Path(shutil.copytree(folder, tmp_path / "flipped" / folder.name))
    flip_weight(flipped, CHANGED)
    proc = run_cli("validate", "--deep", flipped)
    assert proc.returncode != 0 and "CRC" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_save_stopped_before_its_optimizer_is_not_weights_only(tmp_path):
    """The control of the reader's model-only form: without thin's record, a folder missing optimizer_0/ is no
    complete checkpoint, and never weights-only."""
    run = series(HF_SHARDED, tmp_path / "hf", ("checkpoint-1", "checkpoint-2"))
    shutil.rmtree(run / "checkpoint-1" / "optimizer_0")
    rows = {r["name"]: r for r in json.loads(run_cli("list", run, "--json", check=None).stdout)["checkpoints"]}
    assert rows["checkpoint-1"]["status"] != "complete" and rows["checkpoint-1"]["weights_only"] is False
    assert rows["checkpoint-2"]["status"] == "complete"
    refused = run_cli("thin", run / "checkpoint-1", check=1)
    assert len(refused.stderr.strip().splitlines()) == 1


def test_prune_with_tiers_thins_an_fsdp_folder(tmp_path):
    """`prune --keep-last 1 --keep-steps 1:weights` on three copies of the Trainer's sharded save: checkpoint-1
    thinned (complete, weights-only, less optimizer_0/), checkpoint-2 deleted, checkpoint-3 full. The control: at the
    full tier checkpoint-1 stays whole."""
    names = ("checkpoint-1", "checkpoint-2", "checkpoint-3")
    rules = ["--keep-last", "1", "--keep-steps", "1:weights"]
    run = series(HF_SHARDED, tmp_path / "hf", names)
    planned = json.loads(run_cli("prune", run, *rules, "--json", check=0).stdout)
    assert {d["name"]: d["action"] for d in planned["decisions"]} == \
        {"checkpoint-1": "thin", "checkpoint-2": "delete", "checkpoint-3": "keep"}
    run_cli("prune", run, *rules, "--yes", "--quiet", check=0)
    assert sorted(os.listdir(run)) == ["checkpoint-1", "checkpoint-3"]
    assert not (run / "checkpoint-1" / "optimizer_0").exists()
    rows = {r["name"]: r for r in json.loads(run_cli("list", run, "--json", check=0).stdout)["checkpoints"]}
    assert rows["checkpoint-1"]["status"] == "complete" and rows["checkpoint-1"]["weights_only"]
    assert not rows["checkpoint-3"]["weights_only"]
    again = series(HF_SHARDED, tmp_path / "again", names)
    run_cli("prune", again, "--keep-last", "1", "--keep-steps", "1", "--yes", "--quiet", check=0)
    assert (again / "checkpoint-1" / "optimizer_0").is_dir()


def test_thin_in_a_bucket_drops_the_optimizer_folder(s3, tmp_path):
    """The same form in the S3 server the tests start: checkpoint-1's optimizer_0/ objects deleted, every other
    object of it and its neighbour's kept; listed complete and weights-only; its export the full one's."""
    import s3_server as servers
    run = series(HF_SHARDED, tmp_path / "hf", ("checkpoint-1", "checkpoint-2"))
    url = servers.upload(s3, str(run), "thin-fsdp/run")
    before = sorted(servers.keys(s3, "thin-fsdp/run/"))
    run_cli("thin", f"{url}/checkpoint-1", "--yes", "--recent", "0", check=0)
    after = sorted(servers.keys(s3, "thin-fsdp/run/"))
    assert after == sorted([k for k in before if "checkpoint-1/optimizer_0/" not in k]
                           + ["thin-fsdp/run/checkpoint-1/reshard-thinned.json"])
    listed = {r["name"]: r for r in json.loads(run_cli("list", url, "--recent", "0", "--json").stdout)["checkpoints"]}
    assert listed["checkpoint-1"]["status"] == "complete" and listed["checkpoint-1"]["weights_only"]
    run_cli("export", run / "checkpoint-1", tmp_path / "full.safetensors", check=0)
    run_cli("export", f"{url}/checkpoint-1", tmp_path / "thin.safetensors", check=0)
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()


# -- the frameworks' own loads

@shares("hf_trainer_strategies.py", after=(deepspeed_trainer_saves,))
def trainer_weights_jobs(out, saved):
    """The Trainer resuming from the thinned folder and from a copy with CHANGED altered, at 3 processes (the FSDP
    resumes' launch): (3, "fsdp", job)."""
    folder, _ = thinned("hf-sharded", out)
    changed = changed_copy(folder, out / "changed" / folder.name)
    truth = out / "truth.safetensors"
    sharded_truth(HF_SHARDED, truth)
    other = Path(saved[0]["out"]).parent / "truth.safetensors"      # the DeepSpeed run's, at the same step
    return [(3, "fsdp", {"mode": "weights", "strategy": "fsdp", "out": str(out / f"resumed-{n}"), "max_steps": 4,
                         "save_steps": 100, "checkpoint": str(f), "truth": str(truth), "negative": str(other)})
            for n, f in (("thinned", folder), ("changed", changed))]


@pytest.fixture(scope="module")
def trainer_loaded(engine_launches):
    return engine_launches.results(trainer_weights_jobs)


@pytest.mark.engine
def test_the_trainers_resume_loads_the_thinned_folder_as_the_full_one(trainer_loaded):
    result, changed = trainer_loaded
    assert result["problems"] == [] and result["compared"] == 21, result
    assert result["world_size"] == 3 and result["distributed_type"] == "DistributedType.FSDP"
    # the global step is the checkpoint's; the optimizer's is not (a fresh AdamW: torch's get_optimizer_state_dict
    # initialises an empty one's state with a step of its own)
    assert result["resumed_global_step"] == 3 and 3.0 not in result["steps"]
    assert result["negative_differences"] > 0       # the DeepSpeed run's weights at the same step
    assert result["next_global_step"] == 4 and result["next_loss"] > 0
    assert changed["problems"] == [f"fp32/{CHANGED}: differs after resume"], changed


@shares("accelerate_strategies.py")
def accelerate_weights_jobs(out):
    """load_state of each thinned folder and of a copy with CHANGED altered, the model alone prepared, at 3
    processes (the FSDP loads' launch): (3, None, job)."""
    truths = {"accelerate-sharded": out / "sharded-truth.safetensors",
              "accelerate-full": out / "full-truth.safetensors"}
    sharded_truth(ACC_SHARDED, truths["accelerate-sharded"])
    full_truth(ACC_FULL, truths["accelerate-full"])
    jobs = []
    for kind, truth in truths.items():
        folder, _ = thinned(kind, out / kind)
        changed = changed_copy(folder, out / kind / "changed" / folder.name)
        state_dict_type = "FULL_STATE_DICT" if kind == "accelerate-full" else "SHARDED_STATE_DICT"
        jobs += [(3, None, {"mode": "weights", "strategy": "fsdp", "state_dict_type": state_dict_type, "dir": str(f),
                            "truth": str(truth), "negative": str(ACC_DEEPSPEED_TRUTH), "label": f"{kind} {n}"})
                 for n, f in (("thinned", folder), ("changed", changed))]
    return jobs


@pytest.fixture(scope="module")
def accelerate_loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(accelerate_weights_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["accelerate-sharded", "accelerate-full"])
def test_accelerate_load_state_loads_the_thinned_folder_as_the_full_one(accelerate_loaded, kind):
    result, changed = accelerate_loaded[f"{kind} thinned"], accelerate_loaded[f"{kind} changed"]
    assert result["problems"] == [] and result["compared"] == 21, result
    assert result["negative_differences"] > 0       # the DeepSpeed run's weights at the same step
    assert result["counter"] == 3       # the registered object's state, loaded beside the model
    assert changed["problems"] == [f"fp32/{CHANGED}: differs after resume"], changed


def thinned_dcp_form(kind: str, root: Path) -> tuple[Path, Path]:
    """(the thinned checkpoint, a full one of the same save) of a DCP-based form: torchtitan, Lightning's
    FSDPStrategy, or one of SOURCES."""
    if kind == "torchtitan":
        run = thinned_titan(root)
        return run / "step-1", run / "step-2"
    if kind == "lightning":
        run = thinned_lightning(root)
        return run / "step=1.ckpt", run / "step=2.ckpt"
    return thinned(kind, root)


@pytest.mark.parametrize("kind", ["torchtitan", "lightning", "hf-sharded", "accelerate-sharded"])
def test_inspect_of_a_thinned_dcp_form_says_what_the_source_trained(kind, tmp_path):
    """Its optimizer's groups, which said what was trained, are dropped: `inspect` gives the source's counts the
    record kept, said as such, never "0 trainable" (every parameter frozen). The control: a record without the
    counts (written before they were kept) says they are not recorded, and JSON gives null."""
    folder, full = thinned_dcp_form(kind, tmp_path)
    source = json.loads(run_cli("inspect", full, "--json", check=0).stdout)
    info = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)
    assert source["trainable"] > 0 and (info["trainable"], info["frozen"]) == (source["trainable"], source["frozen"])
    assert info["param_groups"] == [] and info["thinned"]["trainable"] == source["trainable"]
    line = next(t for t in run_cli("inspect", folder, check=0).stdout.splitlines() if "parameters" in t)
    assert line.endswith(f"{source['trainable']} trainable, {source['frozen']} frozen before thinning (weights "
                         f"only); {source['buffers']} buffer{'s' * (source['buffers'] != 1)}"), line
    record = folder / "reshard-thinned.json"
    older = {k: v for k, v in json.loads(record.read_text()).items() if k not in ("trainable", "frozen")}
    record.write_text(json.dumps(older))
    info = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)
    assert (info["trainable"], info["frozen"]) == (None, None)
    assert "trainable and frozen not recorded (weights only)" in run_cli("inspect", folder, check=0).stdout
