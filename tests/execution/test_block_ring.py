"""The executor's ring of block buffers handed round many times: blocks of 64 bytes, so every tensor of a real
DeepSpeed fixture is many blocks, each cast into (export --dtype bf16: read into the ring's scratch, cast in pieces
into its buffer) or gathered into (tp=2 -> tp=1: the row-parallel weights' boxes) a buffer the ring hands out again
three blocks later. What the consumers load is what the engine held; a flipped bit is still caught by the CRC-32
combined from the many blocks (the negative control)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.errors import CheckpointError
from reshard.execution import executor
from tests.helpers.fixtures import copy_fixture, fixture_dir, tag_dir, truth_json, truth_tensors
from tests.helpers.repo import REPO

BLOCK = 64      # bytes: 16 float32 elements, 32 bfloat16
Z3 = "z3_bf16_dp2"
TP = "autotp2_z1_bf16_tied_dp2"
RULES = str(REPO / "reshard" / "layouts" / "tp-rules" / "llama-autotp.json")


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(executor, "chunk_bytes", lambda *args, **kwargs: BLOCK)


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_cast_blocks_export_what_torch_casts(small_blocks, tmp_path, dtype, torch_dtype):
    """The fp32 masters, many blocks each, exported as bf16 (cast) and fp32 (read straight into the ring): what
    safetensors loads is torch's cast of the engine's masters."""
    meta, truth = truth_json(Z3), truth_tensors(Z3)
    out = tmp_path / "model.safetensors"
    reshard.export(fixture_dir(Z3), out, dtype=dtype)
    loaded = load_file(str(out))
    assert any(truth[f"fp32/{name}"].numel() * 4 > 4 * BLOCK for name in meta["trainable"])    # the ring wraps
    for name in meta["trainable"]:
        assert loaded[name].dtype == torch_dtype
        assert torch.equal(loaded[name], truth[f"fp32/{name}"].to(torch_dtype)), name


def test_gather_blocks_convert_what_the_engine_held(small_blocks, tmp_path):
    """tp=2 -> tp=1 in 64-byte blocks: the module torch.load reads from the converted files is the engine's, its
    row-parallel weights gathered from both ranks' columns."""
    catalog = reshard.open_checkpoint(fixture_dir(TP), layout_rules=RULES)
    reshard.convert(catalog, tmp_path / "tp1", "tp=1,dp=2")
    truth = truth_tensors(TP)
    module = torch.load(tag_dir(tmp_path / "tp1") / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module and any(value.numel() * value.element_size() > 4 * BLOCK for value in module.values())
    for name, value in module.items():
        assert torch.equal(value, truth[f"module/{name}"]), name


def test_a_flipped_bit_is_caught_across_small_blocks(small_blocks, tmp_path):
    """Negative control: one bit of a master flipped in a copy: the export in small blocks fails naming the file
    (its member's CRC-32 combined from every block read) and writes nothing."""
    source = copy_fixture(Z3, tmp_path)
    catalog = reshard.open_checkpoint(source)
    name = max(truth_json(Z3)["trainable"], key=lambda n: catalog.tensor(n, "fp32").numel)
    storage = catalog.tensor(name, "fp32").fragments[0].storage
    with open(storage.file, "r+b") as f:
        f.seek(storage.offset + 3 * BLOCK + 1)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match="CRC-32 mismatch") as caught:
        reshard.export(source, out, dtype="bf16")
    assert caught.value.file == storage.file and not out.exists()
