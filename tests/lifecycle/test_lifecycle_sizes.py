"""A checkpoint's bytes by kind (reshard.lifecycle.sizes, `reshard list`'s columns and `--json`), on the shipped
fixtures.

Every split is checked against what the test finds itself: the files' bytes from os.stat, and the weights as
parameter count times the model dtype's item size from the fixture's truth file, torch.load of the module file or
torch's own DCP metadata reader — never from reshard's catalog.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

import reshard
from reshard.formats import read
from reshard.lifecycle.sizes import GB, BytesByKind, split
from tests.helpers import lifecycle_runs as lr
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURES, truth_json, truth_tensors

MIXED, FP32 = 3, 2      # fp32 words of optimizer state per parameter: master + two moments, or the moments alone


def files_bytes(path: Path) -> int:
    return sum(os.stat(os.path.join(folder, f)).st_size for folder, _, files in os.walk(path) for f in files)


def module_state(path: Path) -> dict:
    """The module's tensors as DeepSpeed saved them (torch.load of the real file)."""
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def deepspeed_expected(name: str, model_file: str) -> tuple[int, int]:
    """(weights, optimizer) bytes of a DeepSpeed fixture: its module copy where the module file holds one (ZeRO-1/2),
    else (ZeRO-3: empty placeholders) the truth's fp32 parameters; buffers once; Adam's words per parameter."""
    module = module_state(FIXTURES / name / "checkpoint" / "global_step3" / model_file)
    buffers_named = set(truth_json(name)["buffers"])
    params = {k[len("module/"):]: t for k, t in truth_tensors(name).items()
              if k.startswith("module/") and k[len("module/"):] not in buffers_named}
    numel = sum(t.numel() for t in params.values())
    buffers = sum(t.numel() * t.element_size() for k, t in module.items() if k not in params)
    held = [module[k] for k in params]
    if all(t.numel() for t in held):          # the 16-bit (or fp32) copy the model holds
        weights = sum(t.numel() * t.element_size() for t in held)
        words = MIXED if held[0].dtype != torch.float32 else FP32
    else:                                     # ZeRO-3: the fp32 master is the only copy of the weights
        weights, words = numel * 4, FP32
    return weights + buffers, numel * 4 * words


def dcp_tensors(folder: Path) -> dict:
    """{key: (numel, itemsize)} of a DCP save, as torch's own reader gives its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k: (math.prod(m.size), m.properties.dtype.itemsize) for k, m in meta.items()
            if isinstance(m, TensorStorageMetadata)}


def catalog_split(path: Path) -> BytesByKind | None:
    return split(read(str(path)), files_bytes(path), str(path))


@pytest.mark.parametrize("name, model_file", [("z1_bf16_dp2", "mp_rank_00_model_states.pt"),
                                              ("z3_fp32_dp2", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                                              ("z3_bf16_dp2", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                                              ("z2_fp16_dp2", "mp_rank_00_model_states.pt")])
def test_deepspeed_rows_add_up_to_the_files_and_weights_are_one_copy(tmp_path, name, model_file):
    shutil.copytree(FIXTURES / name / "checkpoint", tmp_path / "ds")
    lr.age(tmp_path)
    (row,) = reshard.list_checkpoints(tmp_path).checkpoints
    kinds = row.bytes_by_kind
    assert kinds is not None and row.bytes == files_bytes(tmp_path / "ds" / "global_step3") == kinds.total
    assert kinds.weights + kinds.optimizer + kinds.other == row.bytes
    assert (kinds.weights, kinds.optimizer) == deepspeed_expected(name, model_file)
    assert kinds.other > 0      # pickles, zip headers, the flat buffers' padding, the second rank's buffers


def test_an_extra_file_lands_in_other_not_in_weights(tmp_path):
    """Negative control: the same checkpoint with a file the reader does not read — its bytes are `other`."""
    shutil.copytree(FIXTURES / "z1_bf16_dp2" / "checkpoint", tmp_path / "ds")
    lr.age(tmp_path)
    before = reshard.list_checkpoints(tmp_path).checkpoints[0].bytes_by_kind
    extra = tmp_path / "ds" / "global_step3" / "weights_backup.bin"
    extra.write_bytes(os.urandom(4096))
    lr.age(tmp_path)
    (row,) = reshard.list_checkpoints(tmp_path).checkpoints
    assert row.complete and row.bytes == files_bytes(tmp_path / "ds" / "global_step3")
    assert row.bytes_by_kind == BytesByKind(before.weights, before.optimizer, before.other + 4096)


def test_an_incomplete_checkpoint_has_no_kinds_and_the_run_says_unknown(tmp_path):
    """Negative control: a truncated rank file — read, not whole: its bytes only, counted as unknown in the run."""
    shutil.copytree(FIXTURES / "z1_bf16_dp2" / "checkpoint", tmp_path / "ds")
    lr.copy_tag("z1_bf16_dp2", "global_step3", tmp_path / "ds", "global_step4")
    optim = tmp_path / "ds" / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:-100])
    lr.age(tmp_path)
    listing = reshard.list_checkpoints(tmp_path)
    whole, cut = listing.checkpoints
    assert whole.complete and not cut.complete and cut.bytes_by_kind is None
    total = listing.total_bytes_by_kind()
    assert total.unknown == cut.bytes == files_bytes(tmp_path / "ds" / "global_step4")
    assert total.total == whole.bytes + cut.bytes
    assert (total.weights, total.optimizer, total.other) == \
        (whole.bytes_by_kind.weights, whole.bytes_by_kind.optimizer, whole.bytes_by_kind.other)


def test_fsdp_sharded_split_from_its_catalog():
    """HF Trainer FSDP (fp32): weights are the model's DCP tensors; the master is that same copy, not counted
    twice; optimizer the two moments."""
    ckpt = FIXTURES / "hf_fsdp_sharded_dp2" / "checkpoint-3"
    model = dcp_tensors(ckpt / "pytorch_model_fsdp_0")
    kinds = catalog_split(ckpt)
    assert kinds is not None and kinds.total == files_bytes(ckpt)
    assert kinds.weights == sum(n * size for n, size in model.values())
    assert kinds.optimizer == sum(n for n, _ in model.values()) * 4 * FP32


def test_megatron_tp_replicas_are_other_not_weights():
    """Megatron-core bf16 tp=2: each tensor-parallel rank saves the layer norms; the second copies are `other`."""
    save = FIXTURES / "megatron_core" / "mcore_dp_reshardable_tp2_dp2" / "save" / "iter_0000003"
    params = {k: t for k, t in truth_tensors("megatron_core/mcore_dp_reshardable_tp2_dp2").items()
              if k.startswith("module/")}
    assert {t.dtype for t in params.values()} == {torch.bfloat16}
    numel = sum(t.numel() for t in params.values())
    assert read(str(save)).replicas      # the control: there are second copies to keep out of the weights
    kinds = catalog_split(save)
    assert kinds is not None and kinds.total == files_bytes(save)
    assert (kinds.weights, kinds.optimizer) == (numel * 2, numel * 4 * MIXED)


def test_torchtitan_run_listed_with_kinds_and_cost(tmp_path):
    shutil.copytree(FIXTURES / "torchtitan" / "torchtitan_llama_fsdp2" / "checkpoint", tmp_path / "checkpoint")
    lr.age(tmp_path)
    step = tmp_path / "checkpoint" / "step-3"
    saved = dcp_tensors(step)      # torchtitan flattens the model's keys; each param has an exp_avg of its own
    params = [k[len("optimizer.state."):-len(".exp_avg")] for k in saved
              if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]
    model = {k: saved[k] for k in params}
    data = json.loads(run_cli("list", tmp_path, "--json", "--price", "0.02", check=0).stdout)
    (row,) = data["checkpoints"]
    kinds = row["bytes_by_kind"]
    assert row["bytes"] == kinds["total"] == files_bytes(step)
    assert kinds["weights"] + kinds["optimizer"] + kinds["other"] == kinds["total"]
    assert kinds["weights"] == sum(n * size for n, size in model.values())
    assert kinds["optimizer"] == sum(n for n, _ in model.values()) * 4 * FP32
    assert row["cost_per_month"] == {k: n / GB * 0.02 for k, n in kinds.items()}
    assert data["total_bytes_by_kind"] == {**kinds, "unknown": 0}
    assert data["cost_per_month"]["total"] == row["bytes"] / GB * 0.02


def test_cli_text_columns_and_the_run_total(tmp_path):
    shutil.copytree(FIXTURES / "z1_bf16_dp2" / "checkpoint", tmp_path / "ds")
    lr.age(tmp_path)
    from reshard.commands.inspect import human_bytes
    kinds = reshard.list_checkpoints(tmp_path).checkpoints[0].bytes_by_kind
    out = run_cli("list", tmp_path, "--price", "100", check=0).stdout.splitlines()
    assert "sizes: the files' bytes" in out[0] and out[1].split()[2:6] == ["SIZE", "WEIGHTS", "OPTIMIZER", "OTHER"]
    sizes = "  ".join(f"{human_bytes(n):>10}" for n in (kinds.total, kinds.weights, kinds.optimizer, kinds.other))
    assert f"  {sizes}  {'<$0.01':>11}  deepspeed" in out[2]
    total = next(line for line in out if line.startswith("total: "))
    assert total == (f"total: {human_bytes(kinds.total)} in 1 checkpoint: weights {human_bytes(kinds.weights)}, "
                     f"optimizer {human_bytes(kinds.optimizer)}, other {human_bytes(kinds.other)}")
    assert next(line for line in out if line.startswith("cost: ")).startswith("cost: <$0.01 a month at $100 per GB")
    assert run_cli("list", tmp_path, "--price", "-1", check=2).stderr
