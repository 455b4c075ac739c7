"""A model alone (weights without optimizer state) converted to DeepSpeed: the weights-only ZeRO-1/2 tag folder that
DeepSpeed 0.19.8's `engine.load_checkpoint(dir, load_module_only=True, load_optimizer_states=False)` starts a run
from (reshard/formats/deepspeed/model_only.py).

Proof by the engine: the bf16 fixture model's weights (fixtures/z1_bf16_dp2's truth: bf16 weights, an fp32 and an
int64 buffer) saved as a safetensors folder, converted at dp=2 with zero=1 and zero=2, are loaded by the real engine
at dp=2 bf16 (tests/scripts/engine_resume.py's module-only job, in its shared launch; `latest` names the tag), and
every tensor of the live module equals the folder's, dtype and bits. Negative control: the same folder with one
element of l1.weight altered converts and loads, and exactly that weight differs. A Hugging Face Llama folder
(transformers' save_pretrained) converts the same way and reads back equal to its source (`diff`), weights-only,
every param in one group; ZeRO-3, tp > 1 are refused in one line, nothing written.
"""
from __future__ import annotations

import shutil

import pytest

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.hf_sources import make_llama

FIXTURE = "z1_bf16_dp2"
ALTERED = "l1.weight"


def weights_folder(folder, alter: bool = False) -> None:
    """The fixture's module weights (its truth) as a folder's model.safetensors; `alter`: one element of ALTERED
    changed."""
    from safetensors.torch import load_file, save_file
    truth = load_file(str(FIXTURES / FIXTURE / "truth.safetensors"))
    module = {k[len("module/"):]: v.clone() for k, v in truth.items() if k.startswith("module/")}
    if alter:
        module[ALTERED][0, 0] += 1
    folder.mkdir(parents=True)
    save_file(module, str(folder / "model.safetensors"), metadata={"format": "pt"})


@shares("engine_resume.py")
def model_only_jobs(out):
    jobs = []
    for name, zero, alter in (("zero1", 1, False), ("zero2", 2, False), ("altered", 1, True)):
        weights_folder(out / f"{name}-source", alter)
        run_cli("convert", out / f"{name}-source", out / name, "--format", "deepspeed", "--to", f"dp=2,zero={zero}",
                "--quiet", check=0)
        jobs.append((2, None, {"fixture": FIXTURE, "checkpoint": str(out / name), "tag": None, "stage": zero,
                               "fixtures": str(FIXTURES), "module_only": True, "label": name}))
    return jobs


@pytest.mark.engine
def test_deepspeed_starts_from_the_weights_bit_for_bit_and_an_altered_one_is_seen(engine_launches):
    results = {r["label"]: r for r in engine_launches.results(model_only_jobs)}
    assert results["zero1"]["problems"] == [] and results["zero2"]["problems"] == [], results
    assert results["altered"]["problems"] == [f"module/{ALTERED}: differs from the full checkpoint's weights"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "llama"
    make_llama(folder, "bf16-sharded")
    return folder


def test_a_hugging_face_folder_becomes_a_weights_only_tag_folder(llama, tmp_path):
    run_cli("convert", llama, tmp_path / "ds", "--format", "deepspeed", "--to", "dp=2,zero=2", "--quiet", check=0)
    tag = (tmp_path / "ds" / "latest").read_text()
    assert sorted(p.name for p in (tmp_path / "ds" / tag).iterdir()) == ["mp_rank_00_model_states.pt",
                                                                         "reshard-thinned.json"]
    catalog = reshard.open_checkpoint(str(tmp_path / "ds"))
    assert not catalog.param_groups and all(p.kind == "trainable" for p in catalog.params.values())
    assert catalog.layout.dp == 2 and reshard.inspect(catalog).zero_stage == 2
    proc = run_cli("diff", llama, tmp_path / "ds")
    assert proc.returncode == 0 and "no difference" in proc.stdout, proc.stdout
    # negative control: a weights-only folder whose record is gone is not taken for weights-only
    (tmp_path / "ds" / tag / "reshard-thinned.json").unlink()
    proc = run_cli("inspect", tmp_path / "ds")
    assert proc.returncode != 0 and "optim_states" in proc.stderr, proc.stderr


@pytest.mark.parametrize("to, says", [("dp=2,zero=3", "zero=3"), ("dp=1,tp=2,zero=1", "tp=2")])
def test_what_a_model_alone_is_not_written_as_is_refused_in_one_line(to, says, tmp_path):
    weights_folder(tmp_path / "source")
    proc = run_cli("convert", tmp_path / "source", tmp_path / "out", "--format", "deepspeed", "--to", to)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "source")
