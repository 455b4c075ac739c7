"""An Accelerate run moved between DeepSpeed and FSDP, resumed by accelerator.load_state at 3 processes
(tests/scripts/accelerate_strategies.py, torchrun, CPU, gloo; FSDP2 through the test-only shim
tests/helpers/cpu_fsdp.py); the sources, at 2, are fixtures by tools/fixture_accelerate_fsdp.py, one run saved under
each strategy:

- FSDP -> DeepSpeed: fixtures/accelerate_fsdp_sharded_dp2/state converted by `reshard convert --format deepspeed --to
  dp=3,zero=2` (DeepSpeed's tag `pytorch_model`, which load_state asks for); Accelerate with DeepSpeed ZeRO-2 loads
  it: the engine's fp32 params and both Adam moments equal torch's own reading of the source (`dcp_to_torch_save`)
  bit for bit, every step is 3, the scheduler's state_dict is torch.load of the source's scheduler.bin.
- DeepSpeed -> FSDP: fixtures/accelerate_deepspeed_z2_dp2/state converted by `--format fsdp --to dp=3`; Accelerate
  with FSDP2 loads it: torch's full model and optimizer state dicts equal the live engine's truth taken at the save,
  every parameter's step is 3, the scheduler is the source's.
- FSDP full state dict -> FSDP sharded: fixtures/accelerate_fsdp_full_dp2/state (the FSDP run saved with
  FULL_STATE_DICT in the same launch) converted by `--format fsdp --to dp=3`; Accelerate with FSDP2's sharded state
  dict loads it: weights and both moments equal torch.load of its pytorch_model_fsdp.bin and optimizer.bin.
Each then steps once more. Accelerate's files go by the per-process policy (random_states_2.pkl: none, fresh).
Negative controls: each comparison against the other run's truth fails; the unconverted folder does not load under
the other strategy.
"""
import json
from pathlib import Path

import pytest

from tests.helpers.accelerate_schedule import scheduled_lr
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fsdp_truths import full_truth, sharded_truth
from tests.helpers.repo import REPO

pytestmark = pytest.mark.engine
SCRIPT = "accelerate_strategies.py"
FSDP_SOURCE = REPO / "fixtures" / "accelerate_fsdp_sharded_dp2" / "state"
FULL_SOURCE = REPO / "fixtures" / "accelerate_fsdp_full_dp2" / "state"
DS_SOURCE = REPO / "fixtures" / "accelerate_deepspeed_z2_dp2" / "state"
DS_TRUTH = DS_SOURCE.parent / "truth.safetensors"
STEPS = 3
TRAINING_STEPS = 20     # tests/scripts/accelerate_strategies.py's linear schedule


def _load(strategy, folder, truth, negative, scheduler, **more):
    return {"mode": "load", "strategy": strategy, "dir": str(folder), "truth": str(truth), "negative": str(negative),
            "scheduler": str(scheduler), **more}


@shares(SCRIPT)
def loads(out):
    """Each source converted to the other strategy at 3 processes and loaded there; then each unconverted source
    loaded under the other strategy (which must fail): (3, None, job). FSDP's first: Accelerate's state, reset between
    jobs, takes an FSDP plugin after a DeepSpeed job no more ('AcceleratorState' object has no attribute
    'mixed_precision'), but DeepSpeed after FSDP. Last, the full state dict's source converted to the sharded layout
    (FSDP, so before the DeepSpeed jobs; its result is the last)."""
    truth, full = out / "fsdp-truth.safetensors", out / "full-truth.safetensors"
    sharded_truth(FSDP_SOURCE, truth)
    full_truth(FULL_SOURCE, full)
    run_cli("convert", FSDP_SOURCE, out / "to-ds", "--format", "deepspeed", "--to", "dp=3,zero=2", "--quiet", check=0)
    run_cli("convert", DS_SOURCE, out / "to-fsdp", "--format", "fsdp", "--to", "dp=3", "--quiet", check=0)
    run_cli("convert", FULL_SOURCE, out / "full-to-sharded", "--format", "fsdp", "--to", "dp=3", "--quiet", check=0)
    return [(3, None, _load("fsdp", out / "full-to-sharded", full, DS_TRUTH, FULL_SOURCE / "scheduler.bin")),
            (3, None, _load("fsdp", out / "to-fsdp", DS_TRUTH, truth, DS_SOURCE / "scheduler.bin")),
            (3, None, _load("fsdp", DS_SOURCE, DS_TRUTH, truth, DS_SOURCE / "scheduler.bin", fails=True)),
            (3, None, _load("deepspeed", out / "to-ds", truth, DS_TRUTH, FSDP_SOURCE / "scheduler.bin")),
            (3, None, _load("deepspeed", FSDP_SOURCE, truth, DS_TRUTH, FSDP_SOURCE / "scheduler.bin", fails=True))]


@pytest.fixture(scope="module")
def all_results(engine_launches):
    return engine_launches.results(loads)


@pytest.fixture(scope="module")
def results(all_results):
    """The four jobs between DeepSpeed and FSDP (the full state dict's first job left out)."""
    return all_results[1:]


@pytest.mark.parametrize("index, strategy", [(2, "deepspeed"), (0, "fsdp")], ids=["fsdp-to-deepspeed",
                                                                                  "deepspeed-to-fsdp"])
def test_load_state_resumes_the_converted_run_exactly(results, index, strategy):
    result = results[index]
    assert result["strategy"] == strategy and result["problems"] == [], result["problems"][:5]
    assert result["world_size"] == 3 and result["distributed_type"] == f"DistributedType.{strategy.upper()}"
    assert result["compared"] == 63                 # 21 params: fp32 weights, exp_avg, exp_avg_sq
    assert result["negative_differences"] > 0       # the other run's truth fails the same comparison
    assert result["steps"] == [float(STEPS)] and result["next_steps"] == [float(STEPS + 1)]
    # the param groups' hyperparameters as saved (DeepSpeed's ZeRO-2 flat groups keep the source's two)
    assert result["groups"] == [[0.01, scheduled_lr(2 * STEPS, TRAINING_STEPS)], [0.0, scheduled_lr(2 * STEPS,
                                                                                                     TRAINING_STEPS)]]
    # the scheduler, the registered object and process 0's accelerator step come back; the schedule goes on,
    # Accelerate stepping it once per process
    assert (result["lr"], result["counter"]) == (scheduled_lr(2 * STEPS, TRAINING_STEPS), STEPS)
    assert result["next_lr"] == scheduled_lr(2 * STEPS + 3, TRAINING_STEPS)


def test_the_converted_folders_are_the_other_strategys_layout(results):
    ds = json.loads(run_cli("inspect", Path(results[2]["dir"]), "--json", check=0).stdout)
    assert ds["framework"]["title"] == "Accelerate + DeepSpeed ZeRO-2, dp=3" and ds["tag"] == "pytorch_model"
    fsdp = json.loads(run_cli("inspect", Path(results[0]["dir"]), "--json", check=0).stdout)
    assert fsdp["framework"]["title"] == "Accelerate + FSDP (sharded state dict), dp=3"
    for result in results[::2]:      # Accelerate's files by the per-process policy: process 2 is new (fresh)
        files = {p.name for p in Path(result["dir"]).iterdir()}
        assert {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"} <= files
        assert "random_states_2.pkl" not in files


def test_unconverted_folders_do_not_load_under_the_other_strategy(results):
    fsdp, deepspeed = results[1::2]
    # DeepSpeed's SDLoader finds no model states under the tag pytorch_model/ (its bare `assert len(ckpt_list) > 0`)
    assert deepspeed["strategy"] == "deepspeed" and deepspeed["error"] == "AssertionError: ", deepspeed
    assert fsdp["error"].startswith("RuntimeError: CheckpointException") and \
        "pytorch_model_fsdp_0/.metadata" in fsdp["error"], fsdp["error"]


def test_load_state_resumes_the_full_state_dict_converted_to_the_sharded_layout(all_results):
    result = all_results[0]
    assert result["strategy"] == "fsdp" and result["problems"] == [], result["problems"][:5]
    assert result["world_size"] == 3 and result["distributed_type"] == "DistributedType.FSDP"
    assert result["compared"] == 63 and result["negative_differences"] > 0
    assert result["steps"] == [float(STEPS)] and result["next_steps"] == [float(STEPS + 1)]
    assert result["groups"] == [[0.01, scheduled_lr(2 * STEPS, TRAINING_STEPS)], [0.0, scheduled_lr(2 * STEPS,
                                                                                                     TRAINING_STEPS)]]
    assert (result["lr"], result["counter"]) == (scheduled_lr(2 * STEPS, TRAINING_STEPS), STEPS)
    info = json.loads(run_cli("inspect", Path(result["dir"]), "--json", check=0).stdout)
    assert info["framework"]["title"] == "Accelerate + FSDP (sharded state dict), dp=3"
