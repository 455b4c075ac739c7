"""`reshard thin` of the DCP-based frameworks' checkpoints, each into what the framework's model-only option writes,
loaded by the framework's own weights-only load, its weights bit for bit the full checkpoint's.

- torchtitan `step-N/` (copies of fixtures/torchtitan's, checkpoint/step-1..3): the model's state dict alone under
  its bare FQNs (`checkpoint.last_save_model_only`), loaded by torchtitan 0.3.0's CheckpointManager.load() with
  `checkpoint.initial_load_path` (its model-only load; tests/scripts/torchtitan_load.py at 2 ranks): every weight equals
  the full step's as torch's dcp_to_torch_save reads it; one weight element changed in a copy is named (the control).
- Lightning FSDPStrategy `step=K.ckpt/` (fixtures/lightning_fsdp_dp2): `{"model": ...}` alone and meta.pt less
  callbacks and schedulers (`save_weights_only=True`), loaded by the strategy itself in `trainer.validate(model,
  ckpt_path=)` at 2 processes (tests/scripts/lightning_fsdp.py "weights"): its weights are the full folder's, not a
  truth one step off, and a changed element is named.
- HF Trainer FSDP FULL_STATE_DICT (fixtures/hf_fsdp_full_dp2): pytorch_model_fsdp.bin and optimizer.bin dropped
  (save_only_model), `from_pretrained` of it equal to the full save's pytorch_model_fsdp.bin; a changed element in
  model.safetensors is named. (Its SHARDED_STATE_DICT folder, and Accelerate's: tests/commands/test_thin_fsdp.py.)
- a plain DCP save loop (real dcp.save of {"model", "optim"}): `{"model": ...}` alone, loaded by dcp.load into
  get_model_state_dict, equal to the full step's model as dcp_to_torch_save read it before; a changed element named.
Each: `list` shows it complete and weights-only, `export` of it is the full one's byte for byte, a flipped byte of
a weight is found by `validate --deep`, and the newest of its series is not thinned.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.damage import change_dcp_element
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.fsdp_truths import lightning_truth as truth_of, one_step_off as wrong_of
from tests.helpers.lifecycle_runs import age, dcp_loop
from tests.helpers.thin_runs import LIGHTNING, TITAN, check_lifecycle, series, thinned_lightning, thinned_titan

TITAN_CHANGED = "layers.1.feed_forward.w2.weight"
LIGHTNING_CHANGED = "net.mix.weight"     # (not net.emb.weight: the live model ties net.head.weight to it)
HF_FULL = FIXTURES / "hf_fsdp_full_dp2" / "checkpoint-3"


# -- torchtitan

def test_torchtitan_step_thinned_to_its_model_alone(tmp_path):
    run = thinned_titan(tmp_path)
    catalog = reshard.open_checkpoint(str(run / "step-1"))
    assert not catalog.param_groups and {k.state for k in catalog.tensors} == {"module"}
    meta = dcp.FileSystemReader(str(run / "step-1")).read_metadata()
    assert set(meta.state_dict_metadata) == set(catalog.params)        # bare FQNs, nothing beside them
    check_lifecycle(run, "step-1", "step-2", tmp_path, TITAN_CHANGED)
    refused = run_cli("thin", run / "step-3", check=1)
    assert "newest complete checkpoint" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    again = run_cli("thin", run / "step-1", check=1)
    assert "already weights-only" in again.stderr


@shares("torchtitan_load.py")
def titan_model_only_jobs(out):
    run = thinned_titan(out)
    changed = shutil.copytree(run / "step-1", out / "changed" / "step-1")
    change_dcp_element(changed, TITAN_CHANGED, state="module")
    return [(2, None, {"label": label, "model_only": True, "load": str(folder), "truth": str(TITAN)})
            for label, folder in (("thinned", run / "step-1"), ("thinned, changed", changed))]


@pytest.fixture(scope="module")
def titan_loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(titan_model_only_jobs)}


@pytest.mark.engine
def test_torchtitan_loads_the_thinned_step_model_only_as_the_full_one(titan_loaded):
    result = titan_loaded["thinned"]
    assert result["loaded"] and result["error"] is None, result
    assert result["compared"] == 21 and result["problems"] == [], result
    changed = titan_loaded["thinned, changed"]
    assert changed["loaded"] and changed["problems"] == [f"{TITAN_CHANGED}: differs from the truth"], changed


# -- Lightning FSDPStrategy (sharded)

def test_lightning_fsdp_folder_thinned_as_save_weights_only_writes_it(tmp_path):
    run = thinned_lightning(tmp_path)
    folder = run / "step=1.ckpt"
    meta = torch.load(folder / "meta.pt", weights_only=True)
    full = torch.load(LIGHTNING / "meta.pt", weights_only=True)
    assert set(full) - set(meta) == {"callbacks", "lr_schedulers"}
    assert all(meta[k] == full[k] for k in meta)
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys)
    name = next(iter(reshard.open_checkpoint(str(folder)).params))
    check_lifecycle(run, "step=1.ckpt", "step=2.ckpt", tmp_path, name)


@shares("lightning_fsdp.py")
def lightning_weights_jobs(out):
    run = thinned_lightning(out)
    truth = truth_of(LIGHTNING, out / "truth.pt")
    wrong = wrong_of(truth, out / "wrong.pt")
    changed = shutil.copytree(run / "step=1.ckpt", out / "changed" / "step=1.ckpt")
    change_dcp_element(changed, LIGHTNING_CHANGED, state="module")
    return [(2, "weights", {"mode": "weights", "ckpt": str(folder), "truth": str(truth), "control": str(wrong)})
            for folder in (run / "step=1.ckpt", changed)]


@pytest.fixture(scope="module")
def lightning_loaded(engine_launches):
    return engine_launches.results(lightning_weights_jobs)


@pytest.mark.engine
def test_lightning_validate_loads_the_thinned_folder_as_the_full_one(lightning_loaded):
    thinned, changed = lightning_loaded
    assert thinned["compared"] > 0 and thinned["problems"] == [], thinned
    assert len(thinned["control_problems"]) == thinned["compared"]
    assert changed["problems"] == [f"model/{LIGHTNING_CHANGED}: differs after resume"], changed


# -- HF Trainer with FSDP

def test_hf_trainer_fsdp_full_thinned_as_save_only_model_writes_it(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    run = series(HF_FULL, tmp_path / "hf", ("checkpoint-1", "checkpoint-2"))
    reshard.thin(str(run / "checkpoint-1"), yes=True)
    folder = run / "checkpoint-1"
    assert not (folder / "pytorch_model_fsdp.bin").exists() and not (folder / "optimizer.bin").exists()
    truth = torch.load(HF_FULL / "pytorch_model_fsdp.bin", weights_only=True)

    def problems(checkpoint):
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
        return [k for k, v in truth.items() if not torch.equal(loaded[k], v)]
    assert problems(folder) == []
    changed = shutil.copytree(folder, tmp_path / "changed")
    tensors = load_file(changed / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    assert problems(changed) == [name]
    rows = {r["name"]: r for r in json.loads(run_cli("list", run, "--json", check=0).stdout)["checkpoints"]}
    assert rows["checkpoint-1"]["status"] == "complete" and rows["checkpoint-1"]["weights_only"] is True
    run_cli("export", run / "checkpoint-2", tmp_path / "full.safetensors", check=0)
    run_cli("export", folder, tmp_path / "thin.safetensors", check=0)
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 0x40
    (tmp_path / "changed" / "model.safetensors").write_bytes(bytes(data))
    assert not reshard.validate(str(tmp_path / "changed"), deep=True).ok


# -- a plain DCP save loop

def test_plain_dcp_thinned_to_its_model_key_loaded_by_dcp_load(tmp_path):

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fixture_model import build_model
    run = dcp_loop(tmp_path, (1,))
    shutil.copytree(run / "step-1", run / "step-2")     # the same save again: its export the thinned one's
    age(run)
    dcp_to_torch_save(run / "step-1", tmp_path / "truth.pt")
    truth = torch.load(tmp_path / "truth.pt")["model"]
    reshard.thin(str(run / "step-1"), yes=True)
    age(run)
    keys = dcp.FileSystemReader(str(run / "step-1")).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys)

    def problems(folder):
        state = {"model": get_model_state_dict(build_model(tied=False))}
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        return [k for k, v in truth.items() if not torch.equal(state["model"][k], v)]
    assert problems(run / "step-1") == []
    name = next(k for k, v in truth.items() if v.dtype == torch.float32 and v.dim() == 2)
    changed = shutil.copytree(run / "step-1", tmp_path / "changed" / "step-1")
    change_dcp_element(changed, name, state="module")
    assert problems(changed) == [name]
    shutil.rmtree(tmp_path / "changed")
    check_lifecycle(run, "step-1", "step-2", tmp_path, name)
