"""A Llama trained with DeepSpeed, exported by reshard, loads in transformers with the engine's logits."""
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.tiny_llama import probe

pytestmark = pytest.mark.engine
CASES = [("2", "fp32"), ("3", "bf16")]


@shares("engine_llama.py")
def trainings(out):
    """Each case trained and saved at 2 ranks, in out/zero{stage}-{dtype}: (2, None, job)."""
    return [(2, None, {"out": str(out / f"zero{stage}-{dtype}"), "stage": stage, "dtype": dtype})
            for stage, dtype in CASES]


@pytest.fixture(scope="module", params=CASES, ids=[f"zero{s}-{d}" for s, d in CASES])
def trained(request, engine_launches):
    result = engine_launches.results(trainings)[CASES.index(request.param)]
    return Path(result["out"]), result["dtype"]


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_from_pretrained_gives_the_engine_logits(trained, shard, tmp_path):
    from transformers import LlamaForCausalLM


    out, dtype = trained
    export = tmp_path / "export"
    args = ["--dtype", "auto"] + (["--max-shard-size", shard] if shard else [])
    run_cli("export", out / "checkpoint", export, "--quiet", *args, check=0)
    if shard:
        assert (export / "model.safetensors.index.json").exists()
        assert len(list(export.glob("model-*-of-*.safetensors"))) > 1
    shutil.copy(out / "hf_config" / "config.json", export / "config.json")
    model = LlamaForCausalLM.from_pretrained(export, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # re-tied
    with torch.no_grad():
        logits = model(input_ids=probe()).logits
    expected = torch.load(out / "logits.pt")
    assert logits.dtype == expected.dtype
    assert torch.equal(logits, expected), (logits - expected).abs().max()
