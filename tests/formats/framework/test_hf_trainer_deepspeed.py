"""HF Trainer + DeepSpeed ZeRO-2 and ZeRO-3: a real transformers.Trainer run at 2 processes (torchrun, CPU, gloo) saves
checkpoint-3/; reshard converts the whole folder to 1 and 3 processes, and trainer.train(resume_from_checkpoint=)
at that size resumes exactly (tests/scripts/hf_trainer_deepspeed.py): the engine's fp32 params, both Adam moments and
the module weights equal the truth the live engine gave at save time, bit for bit; the global step, epoch and
lr go on as scheduled. Without reshard the same resume fails with DeepSpeed's error.
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.pickles import check_pickles, pickle_globals
from tests.helpers.repo import SCRIPTS
from tests.helpers.torchrun import torchrun

pytestmark = pytest.mark.engine
SCRIPT = "hf_trainer_deepspeed.py"
SAVE, STEPS = 3, 6      # the run saves checkpoint-3 and checkpoint-6; the resumes continue from checkpoint-3
# What the Trainer wrote beside DeepSpeed's `latest` and global_step3/ (transformers 5.24, DeepSpeed 0.19.8)
# (under ZeRO-3 the Trainer saves no model weights: the module's params are partitioned)
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}   # single_models.tiny_tokenizer
TRAINER_FILES = {"config.json", "generation_config.json", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
                 "trainer_state.json", "training_args.bin", *TOKENIZER_FILES}
WEIGHTS = {2: {"model.safetensors"}, 3: set()}
DEEPSPEED_FILES = {"latest", "global_step3", "zero_to_fp32.py", "zero_to_torch.py"}


@dataclass(frozen=True)
class Source:
    out: Path       # the run's output dir, truths and job files
    stage: int

    def __truediv__(self, name):
        return self.out / name


STAGES = (2, 3)
RESUMES = [(1, 2), (3, 1)]      # (dp, gradient_accumulation_steps)


@shares(SCRIPT)
def saves(out):
    """One Trainer run at 2 processes per ZeRO stage, in out/zero{stage}: (2, None, job)."""
    return [(2, None, {"mode": "save", "out": str(out / f"zero{stage}" / "run"), "stage": stage, "max_steps": STEPS,
                       "save_steps": SAVE, "truth": str(out / f"zero{stage}" / "truth-{step}.safetensors")})
            for stage in STAGES]


@pytest.fixture(scope="module", params=STAGES, ids=[f"zero{s}" for s in STAGES])
def source(request, engine_launches):
    """The run of one ZeRO stage, shared by every test here: its folder and truths."""
    result = engine_launches.results(saves)[STAGES.index(request.param)]
    assert result["problems"] == [] and result["world_size"] == 2, result
    return Source(Path(result["out"]).parent, request.param)


def _converted(source: Source, dp: int) -> Path:
    return source / f"dp{dp}" / f"checkpoint-{SAVE}"


def _resume_job(source, checkpoint, stem, gas=1):
    return {"mode": "resume", "out": str(source / f"resumed-{stem}"), "stage": source.stage, "max_steps": STEPS,
            "save_steps": 100, "checkpoint": str(checkpoint), "truth": str(source / f"truth-{SAVE}.safetensors"),
            "negative": str(source / f"truth-{STEPS}.safetensors"), "gradient_accumulation_steps": gas}


@shares(SCRIPT, after=(saves,))
def resumes(out, saved):
    """Each stage's checkpoint-3 converted by the command line to 1 and 3 processes, and resumed there; and resumed
    unconverted at 3 (which must fail): (dp, None, job)."""
    jobs = []
    for stage, run in zip(STAGES, saved, strict=True):
        source = Source(Path(run["out"]).parent, stage)
        for dp, gas in RESUMES:
            run_cli("convert", source / "run" / f"checkpoint-{SAVE}", _converted(source, dp), "--to", f"dp={dp}",
                    "--quiet", check=0)
            jobs.append((dp, None, _resume_job(source, _converted(source, dp), f"dp{dp}", gas)))
    for stage, run in zip(STAGES, saved, strict=True):     # last: the same resume of the unconverted folder must fail
        source = Source(Path(run["out"]).parent, stage)
        job = _resume_job(source, source / "run" / f"checkpoint-{SAVE}", "baseline")
        jobs.append((3, None, {**job, "fails": True}))
    return jobs


@pytest.fixture(scope="module")
def converted(source, engine_launches):
    """checkpoint-3 converted by the command line to 1 and 3 processes."""
    engine_launches.results(resumes)
    return {dp: _converted(source, dp) for dp, _ in RESUMES}


def logged(source, step: int) -> dict:
    """The source run's log entry of `step` (checkpoint-6's trainer_state.json holds every step's)."""
    state = json.loads((source / "run" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return next(e for e in state["log_history"] if e.get("step") == step and "loss" in e)


def test_the_trainers_folder_is_recognised(source):
    folder = source / "run" / f"checkpoint-{SAVE}"
    assert set(os.listdir(folder)) == TRAINER_FILES | WEIGHTS[source.stage] | DEEPSPEED_FILES
    info = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)
    assert info["framework"]["title"] == f"HF Trainer + DeepSpeed ZeRO-{source.stage}, dp=2"
    assert {f["path"] for f in info["framework"]["files"]} == TRAINER_FILES | WEIGHTS[source.stage]


# gradient_accumulation_steps 2 at one process keeps the global batch (plan's advice says so)
@pytest.mark.parametrize("dp, gas", RESUMES)
def test_trainer_resumes_the_converted_folder_exactly(source, converted, dp, gas, engine_launches):
    result = engine_launches.results(resumes)[len(RESUMES) * STAGES.index(source.stage) + RESUMES.index((dp, gas))]
    assert result["checkpoint"] == str(converted[dp])
    assert result["problems"] == [], result["problems"][:5]
    assert result["world_size"] == dp and result["compared"] > 0
    assert result["negative_differences"] > 0           # another state's truth fails the same comparison
    saved = json.loads((source / "run" / f"checkpoint-{SAVE}" / "trainer_state.json").read_text())
    assert (result["resumed_global_step"], result["resumed_epoch"]) == (SAVE, saved["epoch"])
    assert result["next_logged_step"] == SAVE + 1
    assert result["next_logged_lr"] == logged(source, SAVE + 1)["learning_rate"]    # the scheduled lr
    if dp * gas == 2:     # the same global batch: the same epoch arithmetic
        assert result["next_epoch"] == logged(source, SAVE + 1)["epoch"]


def test_resume_without_reshard_fails_with_deepspeeds_error(source, engine_launches):
    result = engine_launches.results(resumes)[len(STAGES) * len(RESUMES) + STAGES.index(source.stage)]
    assert result["checkpoint"] == str(source / "run" / f"checkpoint-{SAVE}") and "problems" not in result
    assert "Automatic adjustment of ZeRO's optimizer state partitioning" in result["error"], result


def test_converted_pickles_load_where_reshard_is_not_installed(source, converted, tmp_path):
    for folder in converted.values():
        assert check_pickles(source / "run" / f"checkpoint-{SAVE}", folder, tmp_path) >= 4
    assert pickle_globals(source / "run" / f"checkpoint-{SAVE}" / "training_args.bin") >= {
        "transformers.training_args.TrainingArguments"}     # what a reader that unpickled it would run


def test_fsdp2_loads_the_trainers_checkpoint_through_the_reader(source):
    """(issue #15) The GPT-2 under FSDP2, with the Trainer's two param groups, at 3 processes (ZeRO-2 source)
    or 2 (ZeRO-3) loads checkpoint-3 through reshard.dcp_reader.Reader (tests/scripts/dcp_fsdp2.py): fp32 masters and
    both Adam moments are the live engine's at save time, the hyper-parameters those torch.load finds in the
    optimizer file; then it trains a step."""
    import math

    import torch
    from safetensors.torch import load_file

    from tests.helpers.engine_state import fsdp2_differences, saved_param_groups
    folder, world = source / "run" / f"checkpoint-{SAVE}", 3 if source.stage == 2 else 2
    job = {"model": "gpt2", "optimizer": "AdamW", "source": str(folder), "reader_out": str(source / "fsdp2.pt")}
    (source / "fsdp2-jobs.json").write_text(json.dumps([job]))
    torchrun(world, SCRIPTS / "dcp_fsdp2.py", "load", source / "fsdp2-jobs.json", deepspeed=False)
    read = torch.load(job["reader_out"], weights_only=False)
    problems, compared = fsdp2_differences(read, load_file(str(source / f"truth-{SAVE}.safetensors")), SAVE)
    assert problems == [] and compared > 0, problems[:5]
    assert math.isfinite(read["next_loss"])
    saved = saved_param_groups(next((folder / f"global_step{SAVE}").glob("*optim_states.pt")))
    assert [(g["lr"], g["weight_decay"]) for g in read["optim"]["param_groups"]] == \
           [(g["lr"], g["weight_decay"]) for g in saved]
    # the comparison sees another state: the same run's three steps later
    assert fsdp2_differences(read, load_file(str(source / f"truth-{STEPS}.safetensors")), SAVE)[0]


def test_export_writes_a_folder_from_pretrained_loads(source, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import single_models
    folder = source / "run" / f"checkpoint-{SAVE}"
    run_cli("export", folder, tmp_path / "hf", "--quiet", check=0)
    assert {"config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES} <= \
        set(os.listdir(tmp_path / "hf"))
    text = "t1 t2 t30"
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text) == single_models.tiny_tokenizer()(text)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    truth = load_file(str(source / f"truth-{SAVE}.safetensors"))
    other = load_file(str(source / f"truth-{STEPS}.safetensors"))
    state = model.state_dict()
    names = [k.partition("/")[2] for k in truth if k.startswith("fp32/")]
    assert names and all(torch.equal(state[n], truth[f"fp32/{n}"]) for n in names)
    assert not all(torch.equal(state[n], other[f"fp32/{n}"]) for n in names)      # negative control
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()   # re-tied on load


def test_thinned_checkpoint_loads_with_from_pretrained(source, tmp_path):
    """(issue 39) `reshard thin --yes` of the real run's checkpoint-3 (a copy of the run: checkpoint-6 is the
    newest, kept full). ZeRO-2: the engine's save (`latest`, global_step3/, the scripts) is dropped, the Trainer's
    files stay, and from_pretrained of the thinned folder gives the full one's weights bit for bit in the training
    dtype (fp32 here), which are the live engine's module weights at the save. Controls: the same comparison
    with step 6's truth fails, and one element changed in the thinned model.safetensors is seen. ZeRO-3 (whose
    Trainer saves no model.safetensors) is refused in one line, nothing touched."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2LMHeadModel

    from tests.helpers.lifecycle_runs import age
    run = tmp_path / "run"
    shutil.copytree(source / "run", run)
    age(run)
    folder, full = run / f"checkpoint-{SAVE}", tmp_path / "full"
    shutil.copytree(folder, full)
    if source.stage == 3:
        refused = run_cli("thin", folder, "--yes", check=1).stderr
        assert len(refused.splitlines()) == 1 and "no model.safetensors" in refused, refused
        assert sorted(os.listdir(folder)) == sorted(os.listdir(full))
        return
    result = json.loads(run_cli("thin", folder, "--yes", "--json", check=0).stdout)
    assert result["executed"] and result["bytes_after"] < result["bytes_before"] / 2, result
    assert set(os.listdir(folder)) == TRAINER_FILES | WEIGHTS[2] | {"reshard-thinned.json"}
    assert [n for n in os.listdir(run) if n.startswith(".")] == []
    listed = json.loads(run_cli("list", run, "--json").stdout)["checkpoints"]
    assert {r["name"]: r["status"] for r in listed} == {f"checkpoint-{SAVE}": "complete",
                                                         f"checkpoint-{STEPS}": "complete"}
    a, b = (GPT2LMHeadModel.from_pretrained(p).state_dict() for p in (full, folder))
    assert a.keys() == b.keys() and all(a[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)
    truth, later = (load_file(str(source / f"truth-{s}.safetensors")) for s in (SAVE, STEPS))
    names = [k.partition("/")[2] for k in truth if k.startswith("module/")]
    assert names and all(torch.equal(b[n], truth[f"module/{n}"]) for n in names)
    assert not all(torch.equal(b[n], later[f"module/{n}"]) for n in names)      # control: another step's weights
    weights = load_file(folder / "model.safetensors")      # control: one element changed is seen
    name = next(iter(weights))
    weights[name].view(-1)[0] += 1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    c = GPT2LMHeadModel.from_pretrained(folder).state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)
