"""Single-process checkpoints made by real clients (torch.save, Lightning, the Hugging Face Trainer,
safetensors/save_pretrained): reshard inspects, validates and exports them, converts them to
DeepSpeed ZeRO at other world sizes, and the unmodified DeepSpeed engine resumes them with every
fp32 param and optimizer state equal to the source's (tests/single_engine_resume.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from conftest import REPO, run_cli
import single_models as sm


def run_engine(world, jobs, tmp):
    """Resume each job's checkpoint in one torchrun launch of `world` ranks; problems per job."""
    jobs_path, results_path = tmp / f"jobs-{world}.json", tmp / f"results-{world}.json"
    jobs_path.write_text(json.dumps(jobs))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc_per_node", str(world), "--master_port", str(29600 + world),
                           str(REPO / "tests" / "single_engine_resume.py"), str(jobs_path), str(results_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(results_path.read_text())
    assert len(results) == len(jobs)
    return results


def truth_file(path, module_sd, trainable, optimizer_truth):
    """fp32/<name> for every trainable param (its saved value) + the optimizer's states by name."""
    tensors = {f"fp32/{n}": module_sd[n].detach().float().clone().contiguous() for n in trainable}
    tensors.update(optimizer_truth)
    save_file(tensors, str(path))
    return str(path)


def convert(src, dst, spec):
    run_cli("convert", src, dst, "--to", spec, "--format", "deepspeed", "--quiet", check=0)
    assert reshard.validate(reshard.open_checkpoint(dst)).ok
    return str(dst)


def export_equals(src, out, expected: dict, aliases_expected: dict):
    """reshard export SRC OUT writes exactly `expected` (a state dict), ties recorded not duplicated."""
    run_cli("export", src, out, "--quiet", check=0)
    exported = load_file(str(out))
    from safetensors import safe_open
    with safe_open(str(out), "pt") as f:
        tied = json.loads((f.metadata() or {}).get("tied", "{}"))
    assert tied == aliases_expected
    full = {**exported, **{a: exported[h] for a, h in tied.items()}}
    assert list(full) and set(full) == set(expected)
    for key, value in expected.items():
        assert torch.equal(full[key], value), key


# ---------------------------------------------------------------------------------------------
# plain torch.save


def _plain_run(tmp, optimizer="Adam"):
    torch.manual_seed(0)
    model = sm.TinyLM()
    hyper = {"lr": 1e-2} if optimizer == "Adam" else {"lr": 1e-1, "momentum": 0.9}
    opt = getattr(torch.optim, optimizer)(model.parameters(), **hyper)
    for i in range(3):
        model(sm.tokens(i)).backward()
        opt.step()
        opt.zero_grad()
    path = tmp / f"plain-{optimizer}.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    names = [n for n, _ in model.named_parameters()]
    truth = truth_file(tmp / f"truth-{optimizer}.safetensors", model.state_dict(), names,
                       sm.named_optimizer_truth(model, opt, opt.state_dict()))
    step = 3 if optimizer == "Adam" else None
    job = {"model": "tiny_lm", "truth": truth, "optimizer": optimizer, "hyper": hyper,
           "groups": [{"names": names}], "global_steps": 3 if step else 0, "step": step}
    return path, model, job


def test_plain_torch_save_inspect_validate_export(tmp_path):
    path, model, _ = _plain_run(tmp_path)
    info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
    assert (info["format"], info["optimizer"], info["optimizer_states"]) == ("torch", "Adam", ["exp_avg", "exp_avg_sq"])
    assert (info["trainable"], info["buffers"], info["aliases"], info["step"]) == (7, 1, {"head.weight": "emb.weight"}, 3)
    assert "complete" in run_cli("validate", path, check=0).stdout
    export_equals(path, tmp_path / "out.safetensors", model.state_dict(), {"head.weight": "emb.weight"})


@pytest.mark.engine
def test_plain_torch_save_resumes_in_deepspeed_at_dp_1_and_3(tmp_path):
    path, _, job = _plain_run(tmp_path)
    sgd_path, _, sgd_job = _plain_run(tmp_path, "SGD")
    for world in (1, 3):
        jobs = [{**job, "stage": s, "checkpoint": convert(path, tmp_path / f"ds-{world}-{s}", f"dp={world},zero={s}")}
                for s in (1, 2, 3)]
        jobs.append({**sgd_job, "stage": 2,
                     "checkpoint": convert(sgd_path, tmp_path / f"sgd-{world}", f"dp={world},zero=2")})
        for result in run_engine(world, jobs, tmp_path):
            assert result["problems"] == [] and result["compared"] > 0, result
