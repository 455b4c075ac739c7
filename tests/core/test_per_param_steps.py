"""Adam's `step` is counted per parameter: a param that had no gradient for some steps is behind.

The checkpoint is a plain torch.save of a real torch.optim.Adam whose steps are [5, 1, 1, 1]. DCP keeps a
step per param (what get_state_dict saves), so `convert --format dcp` carries each param's own, proven
by the real `dcp.load` + `set_state_dict` and by one more Adam step equal to the source's. DeepSpeed
keeps one per param group, and so does its universal loader (base_optimizer.py asserts a group's
step.pt are equal; stage3.py reads one for all), as does export's optimizer.json: those refuse.
"""
import json
import os

import pytest
import torch

from tests.helpers.cli import run_cli

STEPS = [5, 1, 1, 1]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _trained():
    """The first weight alone gets a gradient 4 times, then every param once: steps [5, 1, 1, 1]."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(4):
        opt.zero_grad(set_to_none=True)
        model[0].weight.grad = torch.full_like(model[0].weight, float(i + 1))
        opt.step()
    _grads(model, 1)
    opt.step()
    assert _steps(opt, model) == STEPS
    return model, opt


def _steps(opt, model) -> list:
    return [int(opt.state[p]["step"]) for p in model.parameters()]


@pytest.fixture
def source(tmp_path):
    model, opt = _trained()
    path = tmp_path / "steps.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path, model, opt


def _load_dcp(path):
    """A fresh model and Adam filled by the real dcp.load + set_state_dict, as FSDP code resumes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = _model()
    for p in model.parameters():
        p.data.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    msd, osd = get_state_dict(model, opt)          # initialises Adam's state: one step each
    assert _steps(opt, model) == [1, 1, 1, 1]     # control: only the load can make them [5, 1, 1, 1]
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _one_more_step(model, opt) -> list:
    _grads(model, 2)
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_dcp_output_gives_each_param_its_own_step(source, tmp_path):
    path, model, opt = source
    run_cli("convert", path, tmp_path / "dcp", "--format", "dcp", "--quiet", check=0)
    loaded, loaded_opt = _load_dcp(tmp_path / "dcp")
    assert _steps(loaded_opt, loaded) == STEPS
    for p, q in zip(model.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q)
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][state], loaded_opt.state[q][state]), state
    # Adam's bias correction depends on the step: the next update equals the source's only with its steps
    expected = _one_more_step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(expected, _one_more_step(loaded, loaded_opt), strict=True))
    # negative control: the same state with one step for all (5, the group's largest) updates differently
    wrong, wrong_opt = _load_dcp(tmp_path / "dcp")
    for p in wrong.parameters():
        wrong_opt.state[p]["step"].fill_(5)
    assert not all(torch.equal(a, b) for a, b in zip(expected, _one_more_step(wrong, wrong_opt), strict=True))


def test_dcp_to_dcp_keeps_them_and_deepspeed_refuses_the_dcp(source, tmp_path):
    path, _, _ = source
    run_cli("convert", path, tmp_path / "dcp", "--format", "dcp", "--quiet", check=0)
    run_cli("convert", tmp_path / "dcp", tmp_path / "dcp2", "--format", "dcp", "--to", "dp=2", "--quiet", check=0)
    loaded, opt = _load_dcp(tmp_path / "dcp2")
    assert _steps(opt, loaded) == STEPS
    proc = run_cli("convert", tmp_path / "dcp", tmp_path / "ds", "--format", "deepspeed", "--to", "zero=2")
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"reshard: {tmp_path / 'dcp' / '.metadata'}: param group 0: optimizer step differs between parameters "
        "(5 at 0.weight vs 1 at 0.bias); a DeepSpeed checkpoint keeps one per group, so it is not written")
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("args, target", [
    (("convert", "--format", "universal", "--to", "zero=2"), "a universal checkpoint"),
    (("convert", "--format", "universal", "--to", "zero=3"), "a universal checkpoint"),
    (("convert", "--format", "deepspeed", "--to", "zero=2"), "a DeepSpeed checkpoint"),
    (("export", "--with-optimizer"), "the optimizer state (--with-optimizer)")], ids=lambda a: "-".join(a).strip("-")
    if isinstance(a, tuple) else None)
def test_writers_that_keep_one_step_per_group_refuse(source, tmp_path, args, target):
    path, _, _ = source
    out = tmp_path / "out"
    proc = run_cli(args[0], path, out, *args[1:])
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"reshard: {path}: param group 0: optimizer step differs between parameters (5 at 0.weight vs 1 at "
        f"0.bias); {target} keeps one per group, so it is not written"), proc.stderr
    assert not out.exists() and os.listdir(tmp_path) == ["steps.pt"]
    # negative control: the weights alone are one value per tensor, exported as they are
    run_cli("export", path, out, "--quiet", check=0)
    info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)    # inspect lists the steps that differ
    assert info["param_groups"][0]["step"] == 5.0
    assert info["split_scalars"] == [{"group": 0, "key": "step", "param": p, "value": 1.0}
                                     for p in ("0.bias", "1.weight", "1.bias")]


def _equal_steps(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for seed in range(3):
        _grads(model, seed)
        opt.step()
    path = tmp_path / "equal.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def test_equal_steps_convert_to_every_format(tmp_path):
    """Control for the refusals: the same model with every param stepped alike converts everywhere."""
    path = _equal_steps(tmp_path)
    for fmt in ("universal", "deepspeed"):
        run_cli("convert", path, tmp_path / fmt, "--format", fmt, "--to", "zero=2", "--quiet", check=0)
    run_cli("export", path, tmp_path / "export", "--with-optimizer", "--quiet", check=0)
    run_cli("convert", path, tmp_path / "dcp", "--format", "dcp", "--quiet", check=0)
    loaded, loaded_opt = _load_dcp(tmp_path / "dcp")
    assert _steps(loaded_opt, loaded) == [3, 3, 3, 3]


def test_a_universal_source_with_unequal_step_files_is_read_per_param(tmp_path):
    """Each param of a universal tree has its step.pt: unequal ones are data (validate: complete), carried to
    DCP; DeepSpeed refuses, naming the file."""
    run_cli("convert", _equal_steps(tmp_path), tmp_path / "uni", "--format", "universal", "--to", "zero=2", "--quiet",
            check=0)
    step_file = next((tmp_path / "uni").glob("*/zero/1.weight/step.pt"))
    step = torch.load(step_file)
    assert float(step) == 3.0
    torch.save(torch.full_like(step, 7.0), step_file)
    os.remove(tmp_path / "uni" / "reshard-manifest.json")     # which would rightly flag the edited file
    assert "complete" in run_cli("validate", tmp_path / "uni", check=0).stdout
    proc = run_cli("convert", tmp_path / "uni", tmp_path / "ds", "--format", "deepspeed", "--to", "zero=2")
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"reshard: {step_file}: param group 0: optimizer step differs between parameters (3 at 0.weight vs 7 at "
        "1.weight); a DeepSpeed checkpoint keeps one per group, so it is not written"), proc.stderr
    assert not (tmp_path / "ds").exists()
    run_cli("convert", tmp_path / "uni", tmp_path / "dcp", "--format", "dcp", "--quiet", check=0)
    loaded, opt = _load_dcp(tmp_path / "dcp")
    assert _steps(opt, loaded) == [3, 3, 7, 3]
