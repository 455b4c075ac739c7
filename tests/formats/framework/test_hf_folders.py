"""Hugging Face folders made by a real transformers.Trainer run (CPU, one process, tests/helpers/single_models.py): its
checkpoint-N/ and the folder of trainer.save_model (save_pretrained), both with the run's tokenizer.

- export into a folder writes the model's config, generation config and tokenizer files beside the weights, byte
  for byte: transformers loads it with AutoModelForCausalLM.from_pretrained (the live model's weights) and
  AutoTokenizer (the run's tokenizer). So does the same run's checkpoint at 2 processes under DDP (torchrun,
  tests/scripts/hf_trainer_ddp.py); the DeepSpeed-driven Trainer's folder:
  tests/formats/framework/test_hf_trainer_deepspeed.py.
- inspect and validate import torch and transformers exactly where README says: for safetensors weights beside a
  config.json naming an architecture (the model class gives the parameter order and ties), nowhere else.
"""
import filecmp
import shutil
import subprocess
import sys

import pytest
import torch

import reshard.cli
from tests.helpers import single_models as sm
from tests.helpers.repo import SCRIPTS
from tests.helpers.torchrun import torchrun

MODEL_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Trainer run given a tokenizer: its checkpoint-3/ and the model it saved with save_model."""
    tmp = tmp_path_factory.mktemp("hf_export")
    model, trainer = sm.train_hf(tmp / "run", tokenizer=sm.tiny_tokenizer())
    trainer.save_model(str(tmp / "pretrained"))
    return tmp, model


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The same run at 2 processes under DDP (tests/scripts/hf_trainer_ddp.py): its checkpoint-3/ and the live
    weights."""
    from safetensors.torch import load_file
    tmp = tmp_path_factory.mktemp("hf_ddp")
    torchrun(2, SCRIPTS / "hf_trainer_ddp.py", tmp, deepspeed=False)
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (tmp / "run/checkpoint-3").iterdir()}
    return tmp / "run/checkpoint-3", load_file(str(tmp / "truth.safetensors"))


def _source(request, name):
    """(folder, the weights it must load as): the live model's at the end of the run."""
    if name == "ddp":
        return request.getfixturevalue("ddp_run")
    tmp, live = request.getfixturevalue("trained")
    return tmp / name, live.state_dict()


@pytest.mark.parametrize("name", ["run/checkpoint-3", "pretrained", pytest.param("ddp", marks=pytest.mark.engine)])
def test_export_folder_loads_with_from_pretrained_and_its_tokenizer(request, name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src, expected = _source(request, name)
    out = tmp_path / "out"
    assert MODEL_FILES <= {p.name for p in src.iterdir()}       # what the Trainer wrote
    assert reshard.cli.main(["export", str(src), str(out), "--quiet"]) == 0
    for file in MODEL_FILES:
        assert filecmp.cmp(src / file, out / file, shallow=False), file
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()     # tied again on load
    tokenizer, truth = AutoTokenizer.from_pretrained(out), sm.tiny_tokenizer()
    text = "t1 t2 t30 unknown"
    assert tokenizer(text)["input_ids"] == truth(text)["input_ids"] == [1, 2, 30, sm.VOCAB - 1]
    messages = [{"role": "user", "content": "t3"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == truth.apply_chat_template(messages,
                                                                                                 tokenize=False)
    # negative control: the weights without the config (what export wrote before) are no model transformers knows
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(out / "model.safetensors", bare)
    with pytest.raises(ValueError, match="Unrecognized model"):
        AutoModelForCausalLM.from_pretrained(bare)


def _imported(*args) -> list:
    """Which of torch and transformers `reshard ARGS` (run in a fresh process, exit 0) has imported when it ends."""
    code = ("import sys, reshard.cli; rc = reshard.cli.main(sys.argv[1:]); "
            "print(rc, [m for m in ('torch', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    rc, _, modules = proc.stdout.strip().splitlines()[-1].partition(" ")
    assert rc == "0", proc.stdout + proc.stderr
    return eval(modules)


def test_inspect_and_validate_import_torch_only_for_safetensors_with_a_model_class(trained, tmp_path):
    tmp, live = trained
    exported = tmp_path / "export"
    assert reshard.cli.main(["export", str(tmp / "run/checkpoint-3"), str(exported), "--quiet"]) == 0
    bin_folder = tmp_path / "bin"          # the Trainer's folder with its weights as pytorch_model.bin
    shutil.copytree(tmp / "run/checkpoint-3", bin_folder)
    (bin_folder / "model.safetensors").unlink()
    torch.save(live.state_dict(), bin_folder / "pytorch_model.bin")
    for folder in (bin_folder, exported):          # the order is in the file (a pickle; export's "tied" metadata)
        for command in ("inspect", "validate"):
            assert _imported(command, folder) == [], (command, folder)
    # sorted safetensors: only the model class knows the order (one run: each takes seconds, README says so)
    assert _imported("validate", tmp / "run/checkpoint-3") == ["torch", "transformers"]
