"""A tensor is one shape and one dtype in every file that holds part of it. Real checkpoints with one file
re-saved by torch.save (or a DCP save of two spellings of one state) where they disagree: every command
says so in one line naming the file, exit 1, nothing written; the untouched fixture is the control."""
import shutil

import torch

from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir

COMMANDS = {"inspect": lambda src, out: ["inspect", src], "validate": lambda src, out: ["validate", src],
            "convert": lambda src, out: ["convert", src, out, "--to", "dp=1", "--quiet"],
            "export": lambda src, out: ["export", src, out / "model.safetensors", "--quiet"]}


def _as_int32_exp_avg(save, files):
    """In each of `files` (relative to save dir `save`), Adam's exp_avg partition re-saved as int32: the same
    bytes and element count, another dtype, as DeepSpeed's own torch.save would write it."""
    for name in files:
        path = save / name
        state = torch.load(path, weights_only=False)
        entry = state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        entry["exp_avg"] = entry["exp_avg"].clone().view(torch.int32)
        torch.save(state, path)


def _refused(source, tmp_path, *needles):
    for command, args in COMMANDS.items():
        out = tmp_path / command
        proc = run_cli(*args(source, out))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, (command, proc.stderr)
        assert all(needle in lines[0] for needle in needles), (command, needles, lines[0])
        assert not out.exists(), command


def test_a_rank_whose_partition_has_another_dtype_is_named(tmp_path):
    """ZeRO-2 at dp=2: rank 1's exp_avg is int32, rank 0's float32. Catalog.add used to keep rank 0's
    dtype, so every command read rank 1's bytes as float32 and exited 0."""
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("z2_fp32_dp2"), save)
    for command, args in COMMANDS.items():        # control: the fixture as DeepSpeed saved it
        run_cli(*args(save, tmp_path / f"control-{command}"), check=0)
    rank1, rank0 = (f"global_step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (1, 0))
    _as_int32_exp_avg(save, [rank1])
    _refused(save, tmp_path, f"reshard: {save / rank1}: ", "(exp_avg): int32[", "float32[", str(save / rank0))


def test_a_storage_of_another_dtype_than_its_tensor_is_named(tmp_path):
    """AutoTP tp=2: tensor-parallel rank 1's exp_avg partitions (both dp ranks) are int32. Each rank's file
    agrees with itself, so only the check of every fragment's storage against its tensor (made once, where
    reshard.formats hands out a reader's catalog) sees the int32 storages holding part of a float32 tensor."""
    save = tmp_path / "save"
    shutil.copytree(fixture_dir("autotp2_z1_fp32_dp2"), save)
    files = [f"global_step3/zero_pp_rank_{d}_mp_rank_01_optim_states.pt" for d in (0, 1)]
    run_cli("validate", save, check=0)                                  # control
    _as_int32_exp_avg(save, files)
    _refused(save, tmp_path, f"reshard: {save / files[0]}: ", "(exp_avg): a storage of int32 holds part of a float32")


def test_two_shapes_of_one_state_are_refused(tmp_path):
    """A real dcp.save holding Adam's exp_avg of `weight` under both spellings the DCP reader accepts ("optim."
    and "optimizer."), [4, 4] and [2, 8]: one tensor cannot have two shapes; `inspect` used to show the first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = torch.nn.Linear(4, 4, bias=False)
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    adam.step()
    weights, optim = get_state_dict(model, adam)
    save = tmp_path / "dcp"
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=str(save), no_dist=True)
    run_cli("validate", save, check=0)                                  # control: one spelling
    shutil.rmtree(save)
    other = {"state": {"weight": {"exp_avg": torch.zeros(2, 8)}}}
    dcp.save({"model": weights, "optim": optim, "optimizer": other}, checkpoint_id=str(save), no_dist=True)
    _refused(save, tmp_path, f"reshard: {save}", "weight (exp_avg): float32[2, 8] here, float32[4, 4] in")
