"""A Hugging Face Trainer run moved between DeepSpeed and FSDP, resumed by the Trainer
(tests/scripts/hf_trainer_strategies.py, torchrun, CPU, gloo; FSDP through the test-only shim
tests/helpers/cpu_fsdp.py).

- FSDP -> DeepSpeed: fixtures/hf_fsdp_sharded_dp2/checkpoint-3 (the Trainer with FSDP's sharded state dict at 2
  processes) converted by `reshard convert --format deepspeed --to dp=3,zero=2`; the Trainer with DeepSpeed ZeRO-2
  at 3 processes resumes it: the engine's fp32 params and both Adam moments equal torch's own reading of the source
  (`dcp_to_torch_save`) bit for bit, every step is 3, the scheduler's state_dict is the source's scheduler.pt.
- DeepSpeed -> FSDP: a Trainer run with DeepSpeed ZeRO-2 at 2 processes saves checkpoint-3 (the live engine's truth
  taken at the save); `reshard convert --format fsdp --to dp=3` writes pytorch_model_fsdp_0/ and optimizer_0/; the
  Trainer with FSDP at 3 processes resumes it: torch's full model and optimizer state dicts equal the truth, every
  parameter's step is 3, the scheduler is the source's.
- FSDP's full state dict -> its sharded layout: fixtures/hf_fsdp_full_dp2/checkpoint-3 (pytorch_model_fsdp.bin,
  optimizer.bin) converted by `--format fsdp --to dp=3`, resumed by the Trainer with FSDP's sharded state dict at 3
  processes: equal to torch.load of the two files, the Trainer's files carried.
Each then trains one more step. Negative controls: each comparison against the other run's truth fails; the
unconverted folder does not resume under the other strategy.
"""
import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fsdp_truths import full_truth, sharded_truth
from tests.helpers.repo import REPO
from tests.helpers.trainer_saves import SAVE, deepspeed_trainer_saves

pytestmark = pytest.mark.engine
SCRIPT = "hf_trainer_strategies.py"
FSDP_SOURCE = REPO / "fixtures" / "hf_fsdp_sharded_dp2" / "checkpoint-3"
FULL_SOURCE = REPO / "fixtures" / "hf_fsdp_full_dp2" / "checkpoint-3"
RESUMED_TO = 4


def _resume(out, strategy, checkpoint, truth, negative, scheduler, **more):
    return {"mode": "resume", "strategy": strategy, "stage": 2, "out": str(out), "max_steps": RESUMED_TO,
            "save_steps": 100, "checkpoint": str(checkpoint), "truth": str(truth), "negative": str(negative),
            "scheduler": str(scheduler), **more}


@shares(SCRIPT, after=(deepspeed_trainer_saves,))
def resumes(out, saved):
    """Each folder converted to the other strategy at 3 processes and resumed there; then each unconverted folder
    resumed under the other strategy (which must fail): (3, strategy, job)."""
    ds_run = Path(saved[0]["out"])
    ds_source, ds_truth = ds_run / f"checkpoint-{SAVE}", ds_run.parent / "truth.safetensors"
    truth = out / "fsdp-truth.safetensors"
    sharded_truth(FSDP_SOURCE, truth)
    run_cli("convert", FSDP_SOURCE, out / "to-ds" / f"checkpoint-{SAVE}", "--format", "deepspeed", "--to",
            "dp=3,zero=2", "--quiet", check=0)
    run_cli("convert", ds_source, out / "to-fsdp" / f"checkpoint-{SAVE}", "--format", "fsdp", "--to", "dp=3",
            "--quiet", check=0)
    full = out / "full-truth.safetensors"
    full_truth(FULL_SOURCE, full)
    run_cli("convert", FULL_SOURCE, out / "full-to-sharded" / f"checkpoint-{SAVE}", "--format", "fsdp", "--to",
            "dp=3", "--quiet", check=0)
    return [
        (3, "deepspeed", _resume(out / "resumed-ds", "deepspeed", out / "to-ds" / f"checkpoint-{SAVE}", truth,
                                 ds_truth, FSDP_SOURCE / "scheduler.pt")),
        (3, "fsdp", _resume(out / "resumed-fsdp", "fsdp", out / "to-fsdp" / f"checkpoint-{SAVE}", ds_truth, truth,
                            ds_source / "scheduler.pt")),
        (3, "fsdp", _resume(out / "resumed-full", "fsdp", out / "full-to-sharded" / f"checkpoint-{SAVE}", full,
                            ds_truth, FULL_SOURCE / "scheduler.pt")),
        (3, "deepspeed", _resume(out / "unconverted-ds", "deepspeed", FSDP_SOURCE, truth, ds_truth,
                                 FSDP_SOURCE / "scheduler.pt", fails=True)),
        (3, "fsdp", _resume(out / "unconverted-fsdp", "fsdp", ds_source, ds_truth, truth,
                            ds_source / "scheduler.pt", fails=True)),
    ]


@pytest.fixture(scope="module")
def results(engine_launches):
    return engine_launches.results(resumes)


@pytest.mark.parametrize("index, strategy", [(0, "deepspeed"), (1, "fsdp"), (2, "fsdp")],
                         ids=["fsdp-to-deepspeed", "deepspeed-to-fsdp", "fsdp-full-to-sharded"])
def test_the_trainer_resumes_the_converted_run_exactly(results, index, strategy):
    result = results[index]
    assert result["strategy"] == strategy and result["problems"] == [], result["problems"][:5]
    assert result["world_size"] == 3 and result["distributed_type"] == f"DistributedType.{strategy.upper()}"
    assert result["compared"] == 63                 # 21 params: fp32 weights, exp_avg, exp_avg_sq
    assert result["negative_differences"] > 0       # the other run's truth fails the same comparison
    assert result["resumed_global_step"] == SAVE and result["steps"] == [float(SAVE)]
    assert result["next_global_step"] == SAVE + 1 and result["next_loss"] > 0


def test_the_converted_folders_are_the_other_frameworks_layout(results):
    ds = json.loads(run_cli("inspect", Path(results[0]["checkpoint"]), "--json", check=0).stdout)
    assert ds["framework"]["title"] == "HF Trainer + DeepSpeed ZeRO-2, dp=3"
    fsdp = json.loads(run_cli("inspect", Path(results[1]["checkpoint"]), "--json", check=0).stdout)
    assert fsdp["framework"]["title"] == "HF Trainer + FSDP (sharded state dict), dp=3"
    # the Trainer's files by the per-process policy: rng_state_2.pth is a new process's, which has none (fresh)
    assert {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"} <= \
        {f["path"] for f in fsdp["framework"]["files"]}
    assert not (Path(results[1]["checkpoint"]) / "rng_state_2.pth").exists()


def test_unconverted_folders_do_not_resume_under_the_other_strategy(results):
    deepspeed, fsdp = results[3:]
    assert deepspeed["error"] == f"ValueError: Can't find a valid checkpoint at {FSDP_SOURCE}"
    assert fsdp["error"].startswith("RuntimeError: CheckpointException") and \
        "pytorch_model_fsdp_0/.metadata" in fsdp["error"], fsdp["error"]
