"""Single-process checkpoints made by real clients (torch.save, Lightning, the Hugging Face Trainer,
safetensors/save_pretrained): reshard inspects, validates and exports them, converts them to
DeepSpeed ZeRO at other world sizes, and the unmodified DeepSpeed engine resumes them with every
fp32 param and optimizer state equal to the source's (tests/scripts/single_engine_resume.py)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from reshard.commands.convert import make_plan
from tests.helpers import single_models as sm
from tests.helpers.cli import run_cli
from tests.helpers.torchrun import run_torchrun


def run_engine(world, jobs, tmp):
    """Resume each job's checkpoint in one torchrun launch of `world` ranks; problems per job."""
    results = run_torchrun("single_engine_resume.py", world, jobs, tmp, f"w{world}")
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


def _plain_run(tmp, optimizer="Adam", bf16=False):
    torch.manual_seed(0)
    model = sm.TinyLM().to(torch.bfloat16 if bf16 else torch.float32)     # bf16: pure bf16 training
    hyper = {"lr": 1e-2} if optimizer == "Adam" else {"lr": 1e-1, "momentum": 0.9}
    opt = getattr(torch.optim, optimizer)(model.parameters(), **hyper)
    for i in range(3):
        model(sm.tokens(i)).backward()
        opt.step()
        opt.zero_grad()
    optimizer_tag = f"{optimizer}{'-bf16' if bf16 else ''}"
    path = tmp / f"plain-{optimizer_tag}.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    names = [n for n, _ in model.named_parameters()]
    truth = truth_file(tmp / f"truth-{optimizer_tag}.safetensors", model.state_dict(), names,
                       sm.named_optimizer_truth(model, opt, opt.state_dict()))
    step = 3 if optimizer == "Adam" else None
    job = {"model": "tiny_lm", "truth": truth, "optimizer": optimizer, "hyper": hyper,
           "groups": [{"names": names}], "global_steps": 3 if step else 0, "step": step, "bf16": bf16}
    return path, model, job


def test_plain_torch_save_inspect_validate_export(tmp_path):
    path, model, _ = _plain_run(tmp_path)
    info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
    assert (info["format"], info["optimizer"], info["optimizer_states"]) == ("torch", "Adam", ["exp_avg", "exp_avg_sq"])
    assert (info["trainable"], info["buffers"], info["aliases"], info["step"]) == \
        (7, 1, {"head.weight": "emb.weight"}, 3)
    assert "complete" in run_cli("validate", path, check=0).stdout
    export_equals(path, tmp_path / "out.safetensors", model.state_dict(), {"head.weight": "emb.weight"})
    # converted to DeepSpeed and read back by the DeepSpeed reader: the same model
    ds = convert(path, tmp_path / "ds", "dp=3,zero=3")
    export_equals(ds, tmp_path / "ds-export.safetensors", model.state_dict(), {"head.weight": "emb.weight"})


@pytest.mark.engine
def test_plain_torch_save_resumes_in_deepspeed_at_dp_1_and_3(tmp_path):
    """Adam at ZeRO-1/2/3 and SGD (momentum) at ZeRO-2, dp 1 and 3; pure-bf16 Adam at dp 3, ZeRO-2/3."""
    path, _, job = _plain_run(tmp_path)
    sgd_path, _, sgd_job = _plain_run(tmp_path, "SGD")
    bf16_path, _, bf16_job = _plain_run(tmp_path, bf16=True)
    for world in (1, 3):
        jobs = [{**job, "stage": s, "checkpoint": convert(path, tmp_path / f"ds-{world}-{s}", f"dp={world},zero={s}")}
                for s in (1, 2, 3)]
        jobs.append({**sgd_job, "stage": 2,
                     "checkpoint": convert(sgd_path, tmp_path / f"sgd-{world}", f"dp={world},zero=2")})
        if world == 3:      # pure bf16 training: DeepSpeed's fp32 masters and states are the saved values widened
            jobs += [{**bf16_job, "stage": s,
                      "checkpoint": convert(bf16_path, tmp_path / f"bf16-{s}", f"dp=3,zero={s}")}
                     for s in (2, 3)]
        for result in run_engine(world, jobs, tmp_path):
            assert result["problems"] == [] and result["compared"] > 0, result


def _scheduler_keys(state):
    """What a resumed LR scheduler must have taken from the checkpoint."""
    return {k: state[k] for k in ("last_epoch", "_step_count", "_last_lr", "base_lrs")}


# ---------------------------------------------------------------------------------------------
# Lightning


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    from tests.helpers import single_lightning
    tmp = tmp_path_factory.mktemp("lightning")
    module, trainer, path = single_lightning.train(tmp / "ckpts")
    saved = torch.load(path, weights_only=False)      # the test may trust its own output
    optimizer = trainer.optimizers[0]
    names = [n for n, _ in module.named_parameters()]
    truth = truth_file(tmp / "truth.safetensors", saved["state_dict"], names,
                       sm.named_optimizer_truth(module, optimizer, saved["optimizer_states"][0]))
    job = {"model": "lightning", "truth": truth, "optimizer": "AdamW", "hyper": {"lr": 1e-2, "weight_decay": 0.01},
           "groups": [{"names": names}], "global_steps": saved["global_step"], "step": 3,
           "scheduler": {"class": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5},
                         "expected": _scheduler_keys(saved["lr_schedulers"][0])}}
    return path, saved, job, tmp


def test_lightning_ckpt_inspect_validate_export(lightning_run):
    path, saved, _, tmp = lightning_run
    info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
    assert (info["format"], info["optimizer"], info["step"], info["global_steps"]) == ("lightning", "AdamW", 3, 3)
    assert info["aliases"] == {"net.head.weight": "net.emb.weight"} and info["buffers"] == 1
    catalog = reshard.open_checkpoint(path)
    assert catalog.notes.lr_schedulers[0]["last_epoch"] == saved["lr_schedulers"][0]["last_epoch"]
    assert catalog.notes.lightning["epoch"] == saved["epoch"] and "callbacks" in catalog.notes.lightning
    assert reshard.validate(catalog).ok
    export_equals(path, tmp / "export.safetensors", saved["state_dict"], {"net.head.weight": "net.emb.weight"})


# ---------------------------------------------------------------------------------------------
# Hugging Face Trainer


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    model, trainer = sm.train_hf(tmp / "run")
    folder = tmp / "run" / "checkpoint-3"
    saved_optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    saved_weights = load_file(str(folder / "model.safetensors"))
    names = [n for n, _ in model.named_parameters()]
    truth = truth_file(tmp / "truth.safetensors", saved_weights, names,
                       sm.named_optimizer_truth(model, trainer.optimizer, saved_optimizer))
    scheduler = torch.load(folder / "scheduler.pt", weights_only=True)
    job = {"model": "gpt2", "truth": truth, "optimizer": "AdamW", "hyper": {"lr": 1e-2},
           "groups": sm.trainer_param_groups(model, 0.01), "global_steps": 3, "step": 3,
           "scheduler": {"class": "hf_linear", "kwargs": {"num_warmup_steps": 0, "num_training_steps": 3},
                         "expected": _scheduler_keys(scheduler)}}
    return folder, model, job, tmp


def test_hf_trainer_folder_inspect_validate_export(hf_run):
    folder, model, _, tmp = hf_run
    info = json.loads(run_cli("inspect", folder, "--json", check=0).stdout)
    assert (info["format"], info["optimizer"], info["global_steps"]) == ("hf-trainer", "AdamW", 3)
    assert info["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    assert [g["params"] for g in info["param_groups"]] == [len(g["names"]) for g in sm.trainer_param_groups(model, 0)]
    catalog = reshard.open_checkpoint(folder)
    # the mapping equals the Trainer's own grouping, made by transformers from the live model
    assert [g["params"] for g in catalog.param_groups] == [g["names"] for g in sm.trainer_param_groups(model, 0)]
    assert {"training_args.bin", "rng_state.pth"} <= set(catalog.notes.opaque_files)
    assert catalog.training.lr_scheduler["last_epoch"] == 3
    assert reshard.validate(catalog).ok
    export_equals(folder, tmp / "export.safetensors", model.state_dict(), {"lm_head.weight": "transformer.wte.weight"})


def test_hf_trainer_frozen_param_and_pytorch_model_bin(tmp_path):
    """A frozen param is left out of the Trainer's groups: found as frozen. With pytorch_model.bin the
    state-dict order comes from the file itself (config.json removed to prove it)."""
    model, _ = sm.train_hf(tmp_path / "run", steps=1, freeze=("transformer.wpe.weight",))
    folder = tmp_path / "src" / "checkpoint-1"
    shutil.copytree(tmp_path / "run" / "checkpoint-1", folder)
    expected = [g["names"] for g in sm.trainer_param_groups(model, 0)]
    catalog = reshard.open_checkpoint(folder)
    assert [g["params"] for g in catalog.param_groups] == expected
    assert catalog.params["transformer.wpe.weight"].kind == "frozen" and reshard.validate(catalog).ok
    (folder / "model.safetensors").unlink()
    (folder / "config.json").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    catalog = reshard.open_checkpoint(folder)
    assert [g["params"] for g in catalog.param_groups] == expected
    assert catalog.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert list(catalog.order) == list(model.state_dict())
    # shards of pytorch_model.bin with an index (huggingface_hub): the order comes from config.json again
    import huggingface_hub
    (folder / "pytorch_model.bin").unlink()
    shutil.copy(tmp_path / "run" / "checkpoint-1" / "config.json", folder)
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    huggingface_hub.save_torch_state_dict(weights, folder, max_shard_size="10KB", safe_serialization=False)
    assert (folder / "pytorch_model.bin.index.json").exists()
    catalog = reshard.open_checkpoint(folder)
    assert [g["params"] for g in catalog.param_groups] == expected
    assert catalog.aliases == {"lm_head.weight": "transformer.wte.weight"} and reshard.validate(catalog).ok


@pytest.mark.engine
def test_hf_trainer_and_lightning_resume_in_deepspeed_at_dp2(hf_run, lightning_run, tmp_path):
    jobs = []
    for (src, _, job, _), stage in ((hf_run, 1), (hf_run, 2), (lightning_run, 2), (lightning_run, 3)):
        dst = tmp_path / f"{job['model']}-z{stage}"
        jobs.append({**job, "stage": stage, "checkpoint": convert(src, dst, f"dp=2,zero={stage}")})
    # a negative control: the same checkpoint against a truth with one optimizer state nudged
    truth = load_file(hf_run[2]["truth"])
    key = next(k for k in truth if k.startswith("exp_avg_sq/"))
    truth[key] = truth[key] + 1e-6
    save_file(truth, str(tmp_path / "nudged.safetensors"))
    jobs.append({**jobs[0], "truth": str(tmp_path / "nudged.safetensors")})
    *results, control = run_engine(2, jobs, tmp_path)
    for result in results:
        assert result["problems"] == [] and result["compared"] > 0, result
    assert control["problems"] == [f"{key}: differs after resume"]


# ---------------------------------------------------------------------------------------------
# safetensors: one file, shards with an index


def test_safetensors_single_and_sharded_inspect_validate_export(tmp_path):
    src_dir = tmp_path / "src"
    import huggingface_hub
    from safetensors.torch import save_model
    from transformers import GPT2LMHeadModel
    src_dir.mkdir()
    torch.manual_seed(0)
    tiny = sm.TinyLM()
    save_model(tiny, str(src_dir / "tiny.safetensors"))          # drops the tied duplicate
    lm = GPT2LMHeadModel(sm.gpt2_config())
    lm.save_pretrained(src_dir / "pretrained", max_shard_size="10KB")
    plain = {k: v.clone() for k, v in tiny.state_dict().items() if k != "head.weight"}
    (src_dir / "hub").mkdir()
    huggingface_hub.save_torch_state_dict(plain, src_dir / "hub", max_shard_size="1KB")
    assert (src_dir / "pretrained" / "model.safetensors.index.json").exists()
    assert (src_dir / "hub" / "model.safetensors.index.json").exists()
    cases = [(src_dir / "tiny.safetensors", plain, {}),
             (src_dir / "pretrained", lm.state_dict(), {"lm_head.weight": "transformer.wte.weight"}),
             (src_dir / "pretrained" / "model.safetensors.index.json",
              {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"}, {}),
             (src_dir / "hub", plain, {})]
    for i, (src, expected, tied) in enumerate(cases):
        catalog = reshard.open_checkpoint(src)
        info = reshard.inspect(catalog)
        assert info.format == "safetensors" and info.aliases == tied, src
        assert reshard.validate(catalog).ok
        out = tmp_path / "out"     # not beside a source folder: that is its save dir, protected
        export_equals(src, out / f"export-{i}.safetensors", expected, tied)
        with pytest.raises(reshard.ReshardError, match="no optimizer state"):     # (ZeRO-1/2: the module files)
            make_plan(catalog, "dp=2,zero=3", fmt="deepspeed")
    refused = run_cli("convert", cases[0][0], out / "ds", "--to", "dp=2,zero=3", "--format", "deepspeed", check=1)
    assert "no optimizer state" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert not (out / "ds").exists()
    # reshard's own export reads back with its ties
    again = reshard.open_checkpoint(tmp_path / "out" / "export-1.safetensors")
    assert again.aliases == {"lm_head.weight": "transformer.wte.weight"} and "lm_head.weight" in again.order


def _through_the_reader(src, model, groups, model_only=False):
    """`model` and an AdamW over `groups` loaded from `src` the way a training script resumes with DCP,
    through reshard.dcp_reader.Reader, in one process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    import reshard.dcp_reader
    named = dict(model.named_parameters())
    optim = torch.optim.AdamW([{"params": [named[n] for n in g["names"]]} for g in groups], lr=123.0)
    msd, osd = get_state_dict(model, optim)
    if model_only:
        dcp.load({"model": msd}, storage_reader=reshard.dcp_reader.Reader(src))
        set_model_state_dict(model, msd)
    else:
        dcp.load({"model": msd, "optim": osd}, storage_reader=reshard.dcp_reader.Reader(src))
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    return optim


def _reader_problems(model, optim, truth_path, step):
    """What the loaded model and optimizer hold other than the truth file (fp32/ and state/ names)."""
    params, problems = dict(model.named_parameters()), []
    for key, expected in load_file(truth_path).items():
        kind, name = key.split("/", 1)
        got = params[name].detach() if kind == "fp32" else optim.state[params[name]][kind]
        if not torch.equal(got.float(), expected):
            problems.append(key)
    if step is not None and {float(s["step"]) for s in optim.state.values()} != {float(step)}:
        problems.append("step")
    return problems


def test_single_process_checkpoints_load_through_the_reader(hf_run, lightning_run, tmp_path):
    """(issue #15) torch.save, a Lightning .ckpt, an HF Trainer folder and save_pretrained's sharded
    safetensors, each loaded
    into its model with dcp.load through reshard.dcp_reader.Reader: every param and Adam state is the source's,
    the hyper-parameters are the run's (not the script's lr=123), and a training step runs."""
    from tests.helpers import single_lightning
    path, _, job = _plain_run(tmp_path)
    model = sm.TinyLM()
    optim = _through_the_reader(path, model, job["groups"])
    assert _reader_problems(model, optim, job["truth"], job["step"]) == []
    assert optim.param_groups[0]["lr"] == job["hyper"]["lr"]
    with pytest.raises(AssertionError):     # the comparison sees another state: the same run's truth nudged
        other = load_file(job["truth"])
        other["fp32/mix.weight"][0, 0] += 1e-3
        save_file(other, str(tmp_path / "other.safetensors"))
        assert _reader_problems(model, optim, str(tmp_path / "other.safetensors"), job["step"]) == []
    model(sm.tokens(9)).backward()
    optim.step()

    path, _, job, _ = lightning_run
    module = single_lightning.LitTiny()
    optim = _through_the_reader(path, module, job["groups"])
    assert _reader_problems(module, optim, job["truth"], job["step"]) == []
    assert (optim.param_groups[0]["lr"], optim.param_groups[0]["weight_decay"]) == (5e-3, 0.01)   # StepLR halved it

    folder, _, job, _ = hf_run
    from transformers import GPT2LMHeadModel
    lm = GPT2LMHeadModel(sm.gpt2_config())
    optim = _through_the_reader(folder, lm, job["groups"])
    assert _reader_problems(lm, optim, job["truth"], job["step"]) == []

    lm.save_pretrained(tmp_path / "pretrained", max_shard_size="10KB")     # sharded safetensors, tied head
    fresh = GPT2LMHeadModel(sm.gpt2_config())
    _through_the_reader(tmp_path / "pretrained", fresh, job["groups"], model_only=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), lm.state_dict().values(), strict=True))


def _nudge_first_value(safetensors_path, name, delta):
    """Add `delta` to element 0 of tensor `name` in a safetensors file, in place."""
    import struct

    import numpy as np
    with open(safetensors_path, "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        assert header[name]["dtype"] == "F32"
        offset = 8 + header_len + header[name]["data_offsets"][0]
        f.seek(offset)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(offset)
        f.write(np.float32(value + delta).tobytes())


@pytest.mark.parametrize("run", ["hf_run", "lightning_run"])
def test_diff_export_equals_source_and_pinpoints_a_change(run, request, tmp_path):
    source = request.getfixturevalue(run)[0]
    export = tmp_path / "export.safetensors"
    run_cli("export", source, export, "--quiet", check=0)
    proc = run_cli("diff", source, export, check=0)
    assert "no difference" in proc.stdout and "only A holds optimizer state" in proc.stdout

    exported = reshard.open_checkpoint(export)
    name = next(t.name for t in exported.tensors.values() if t.dtype == "float32")
    _nudge_first_value(export, name, 0.5)
    report = json.loads(run_cli("diff", source, export, "--json", check=1).stdout)
    [d] = report["differences"]
    assert (d["name"], d["kind"]) == (name, "values") and d["max_abs_diff"] == pytest.approx(0.5, rel=1e-3)
    assert "at element 0" in d["detail"]
