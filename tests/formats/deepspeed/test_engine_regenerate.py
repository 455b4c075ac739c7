"""The real DeepSpeed engine, in CI: regenerate one fixture and read it against the fresh truth."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.core.catalog import MASTER
from tests.helpers.fixtures import truth_tensors
from tests.helpers.repo import REPO

pytestmark = pytest.mark.engine
NAMES = ["z2_fp32_dp2", "z3_bf16_dp2"]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("regenerated")
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fixtures.py"), "--only", ",".join(NAMES),
                    "--out", str(out)], check=True, cwd=REPO, timeout=900)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_regenerated_fixture_reads_bit_exactly(regenerated, name):
    truth = load_file(str(regenerated / name / "truth.safetensors"))
    meta = json.loads((regenerated / name / "truth.json").read_text())
    catalog = reshard.open_checkpoint(regenerated / name / "checkpoint")
    assert reshard.validate(catalog, deep=True).ok
    assert catalog.contents().step == meta["step"] and catalog.training.global_steps == meta["global_steps"]
    for key, expected in truth.items():
        state, param = key.split("/", 1)
        if (param, state) not in catalog.tensors and meta["zero_stage"] == 3:
            got = reshard.full_tensor(catalog, param, MASTER).to(expected.dtype)
        else:
            got = reshard.full_tensor(catalog, param, state)
        assert torch.equal(got, expected), key
    # the committed fixture came from the same recipe: same tensors, values equal up to CPU kernel differences
    committed = truth_tensors(name)
    assert committed.keys() == truth.keys()
    for key, value in committed.items():
        assert value.dtype == truth[key].dtype and value.shape == truth[key].shape
        torch.testing.assert_close(value.float(), truth[key].float(), rtol=1e-2, atol=1e-3)
