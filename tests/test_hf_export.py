"""export of a Hugging Face Trainer checkpoint-N/ (and of a save_pretrained folder) into a folder writes the model's
config, generation config and tokenizer files beside the weights, byte for byte: transformers loads the folder
with AutoModelForCausalLM.from_pretrained (the live model's weights) and AutoTokenizer (the run's tokenizer).
The Trainer's run is real (CPU, one process, tests/single_models.py); the DeepSpeed-driven Trainer's folder
is exported by tests/test_hf_trainer_deepspeed.py.
"""
import filecmp
import shutil

import pytest
import torch

import reshard.cli
import single_models as sm

MODEL_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Trainer run given a tokenizer: its checkpoint-3/ and the model it saved with save_model."""
    tmp = tmp_path_factory.mktemp("hf_export")
    model, trainer = sm.train_hf(tmp / "run", tokenizer=sm.tiny_tokenizer())
    trainer.save_model(str(tmp / "pretrained"))
    return tmp, model


@pytest.mark.parametrize("folder", ["run/checkpoint-3", "pretrained"])
def test_export_folder_loads_with_from_pretrained_and_its_tokenizer(trained, folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp, live = trained
    src, out = tmp / folder, tmp_path / "out"
    assert MODEL_FILES <= {p.name for p in src.iterdir()}       # what the Trainer wrote
    assert reshard.cli.main(["export", str(src), str(out), "--quiet"]) == 0
    for name in MODEL_FILES:
        assert filecmp.cmp(src / name, out / name, shallow=False), name
    model = AutoModelForCausalLM.from_pretrained(out)
    state, expected = model.state_dict(), live.state_dict()
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
