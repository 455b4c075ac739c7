"""Hostile and broken single-process checkpoints: one line, exit 1, nothing executed, nothing written."""
import json
import os
import shutil
import struct
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from reshard.errors import CheckpointError
from reshard.formats.single import optim_map
from tests.helpers import single_models as sm
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, tag_dir


class Payload:
    """Pickles as a call of os.system: what a malicious checkpoint holds."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def refused(path, tmp, needle, commands=("inspect", "validate", "export", "convert")):
    for command in commands:
        args = {"inspect": ["inspect", path], "validate": ["validate", path],
                "export": ["export", path, tmp / "never.safetensors"],
                "convert": ["convert", path, tmp / "never", "--to", "dp=2,zero=2", "--format", "deepspeed"]}[command]
        proc = run_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and needle in lines[0], (command, proc.stderr)
        assert not (tmp / "never").exists() and not (tmp / "never.safetensors").exists()


def _safetensors(path, tensors):
    save_file(tensors, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data, length, json.loads(data[8:8 + length])


def _rewrite_header(path, data, length, header):
    """The same data behind another header."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


def _trained(tmp):
    torch.manual_seed(0)
    model = sm.TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(sm.tokens(0)).backward()
    opt.step()
    return model, opt


def test_pickles_that_run_code_never_run(tmp_path):
    canary = tmp_path / "CANARY"
    model, opt = _trained(tmp_path)
    pt = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "x": Payload(f"touch {canary}")}, pt)
    ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": model.state_dict(), "hook": Payload(f"touch {canary}")}, ckpt)
    for path in (pt, ckpt):
        refused(path, tmp_path, "refusing to unpickle global posix.system")
    assert not canary.exists()


def test_hf_folder_never_unpickles_training_args_and_refuses_a_hostile_optimizer(tmp_path):
    canary = tmp_path / "CANARY"
    model, trainer = sm.train_hf(tmp_path / "run", steps=1)
    src = tmp_path / "src"
    shutil.copytree(tmp_path / "run" / "checkpoint-1", src / "checkpoint-1")
    folder = src / "checkpoint-1"
    torch.save(Payload(f"touch {canary}"), folder / "training_args.bin")
    torch.save(Payload(f"touch {canary}"), folder / "rng_state.pth")
    assert run_cli("inspect", folder).returncode == 0         # recorded, never unpickled
    torch.save(Payload(f"touch {canary}"), folder / "optimizer.pt")
    refused(folder, tmp_path, "refusing to unpickle global posix.system", ("inspect", "convert"))
    assert not canary.exists()


def test_legacy_torch_format_is_refused(tmp_path):
    model, _ = _trained(tmp_path)
    path = tmp_path / "legacy.pt"
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=False)
    refused(path, tmp_path, "legacy (non-zip) torch serialization is not supported", ("inspect",))


def test_damaged_safetensors(tmp_path):
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    path = tmp_path / "x.safetensors"
    data, length, header = _safetensors(path, tensors)
    # header length larger than the file
    path.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    refused(path, tmp_path, "is larger than the file", ("inspect", "validate", "export"))
    # data_offsets outside the file
    bad = json.loads(json.dumps(header))
    bad["a"]["data_offsets"] = [bad["a"]["data_offsets"][0], 10**6]
    _rewrite_header(path, data, length, bad)
    refused(path, tmp_path, "lie outside the data", ("inspect", "validate", "export"))
    # overlapping tensors (b moved onto a; sizes still consistent)
    bad = json.loads(json.dumps(header))
    bad["b"]["data_offsets"] = [0, 16]
    _rewrite_header(path, data, length, bad)
    refused(path, tmp_path, "overlap", ("inspect", "validate", "export"))
    # a truncated file
    path.write_bytes(data[:-8])
    refused(path, tmp_path, "lie outside the data", ("inspect", "validate", "export"))


def test_damaged_shard_index(tmp_path):
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"a": torch.ones(3)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(folder / "model-00002-of-00002.safetensors"))
    index = folder / "model.safetensors.index.json"

    def write(weight_map):
        index.write_text(json.dumps({"metadata": {"total_size": 20}, "weight_map": weight_map}))

    write({"a": "model-00001-of-00002.safetensors", "b": "../../etc/passwd"})
    refused(folder, tmp_path, "leaves the checkpoint folder", ("inspect", "validate", "export"))
    write({"a": "model-00001-of-00002.safetensors", "b": "/etc/passwd"})
    refused(index, tmp_path, "leaves the checkpoint folder", ("inspect",))
    os.symlink("/etc/passwd", folder / "link.safetensors")      # inside by name, outside in fact
    write({"a": "model-00001-of-00002.safetensors", "b": "link.safetensors"})
    refused(folder, tmp_path, "leaves the checkpoint folder", ("inspect",))
    (folder / "link.safetensors").unlink()
    write({"a": "model-00001-of-00002.safetensors", "b": "model-00003-of-00003.safetensors"})
    refused(folder, tmp_path, "is missing", ("inspect", "validate", "export"))
    write({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"})
    refused(folder, tmp_path, "is not in this shard", ("inspect",))
    write({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    refused(folder, tmp_path, "lie outside the data", ("inspect", "validate", "export"))


def test_optimizer_that_does_not_map_is_refused(tmp_path):
    model, _ = _trained(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 5)).sum().backward()
    opt.step()
    path = tmp_path / "mismatch.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    refused(path, tmp_path, "does not map to the parameters")
    # more optimizer params than the model has
    big = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(8)])
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    refused(path, tmp_path, "does not belong to this model")


def test_ambiguous_optimizer_is_refused(tmp_path):
    """Two layers of one shape, one frozen: which one the optimizer trains cannot be told."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ambiguous.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    refused(path, tmp_path, "more than one way", ("inspect",))


def test_saved_param_names_resolve_what_shapes_cannot(tmp_path):
    """The BatchNorm case again, with an optimizer built from named_parameters(): torch saves the names."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    path = tmp_path / "named.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    info = json.loads(run_cli("inspect", path, "--json", "--params", check=0).stdout)
    kinds = {row["name"]: row["kind"] for row in info["parameter_table"]}
    assert kinds == {"0.weight": "trainable", "0.bias": "trainable", "1.weight": "trainable", "1.bias": "trainable",
                     "1.running_mean": "frozen", "1.running_var": "frozen", "1.num_batches_tracked": "buffer"}
    assert "param_names" not in info["param_groups"][0]
    # names that are not the model's are refused
    state = opt.state_dict()
    state["param_groups"][0]["param_names"][0] = "2.weight"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    refused(path, tmp_path, "which the model state dict lacks", ("inspect",))


def test_unequal_steps_within_a_group_read_and_export_but_do_not_convert(tmp_path):
    """Adam counts steps per parameter; one unused at first is a step behind. DeepSpeed keeps one per group
    (every writer: tests/core/test_per_param_steps.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model[0](torch.ones(1, 3)).sum().backward()       # the second layer gets no gradient: no step
    opt.step()
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path / "steps.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    assert "complete" in run_cli("validate", path, check=0).stdout
    run_cli("export", path, tmp_path / "w.safetensors", "--quiet", check=0)
    refused(path, tmp_path, "optimizer step differs between parameters", ("convert",))


def test_the_mapping_rule():
    s, v = (4, 4), (4,)
    # one group in model order; a buffer-like entry left out only when counts leave room for it
    assert optim_map.assign("x", [("w", s), ("b", v)], [[s, v]]) == {"w": (0, 0), "b": (0, 1)}
    # two groups (decay / no decay) interleaved in model order, told apart by shape
    got = optim_map.assign("x", [("w1", s), ("b1", v), ("w2", s), ("b2", v)], [[s, s], [v, v]])
    assert got == {"w1": (0, 0), "w2": (0, 1), "b1": (1, 0), "b2": (1, 1)}
    # a frozen entry of a distinct shape is found
    assert optim_map.assign("x", [("f", (2,)), ("w", s)], [[s]]) == {"w": (0, 0)}
    # a param with no state yet matches any shape, unless that makes it ambiguous
    assert optim_map.assign("x", [("w", s), ("b", v)], [[optim_map.WILDCARD, v]]) == {"w": (0, 0), "b": (0, 1)}
    with pytest.raises(CheckpointError, match="more than one way"):
        optim_map.assign("x", [("a", v), ("b", v)], [[v], [v]])
    with pytest.raises(CheckpointError, match="does not map"):
        optim_map.assign("x", [("w", s), ("b", v)], [[v, s]])


class WithFloatBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.register_buffer("scale", torch.ones(5))

    def forward(self, x):
        return self.lin(x).sum() * self.scale.sum()


def test_float_buffer_or_frozen_param_is_not_guessed_for_zero3(tmp_path):
    """A float entry the optimizer does not train: frozen param or buffer? ZeRO-3 would need to know."""
    model = WithFloatBuffer()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).backward()
    opt.step()
    path = tmp_path / "buffer.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
    assert (info["trainable"], info["frozen"], info["buffers"]) == (2, 1, 0)
    proc = run_cli("convert", path, tmp_path / "z3", "--to", "dp=2,zero=3", "--format", "deepspeed")
    assert proc.returncode == 1 and "convert to zero=1 or zero=2" in proc.stderr and not (tmp_path / "z3").exists()
    run_cli("convert", path, tmp_path / "z2", "--to", "dp=2,zero=2", "--format", "deepspeed", "--quiet", check=0)


def test_batchnorm_running_stats_make_the_mapping_ambiguous(tmp_path):
    """BatchNorm's running mean/var have the shape of its weight and bias and nothing in a state dict
    says which are parameters: refused rather than guessed."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    path = tmp_path / "bn.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    refused(path, tmp_path, "more than one way", ("inspect", "convert"))
    weights = tmp_path / "weights.pt"       # without the optimizer there is nothing to map
    torch.save(model.state_dict(), weights)
    assert run_cli("export", weights, tmp_path / "w.safetensors", "--quiet").returncode == 0


def test_a_deepspeed_class_is_refused_outside_a_deepspeed_checkpoint(tmp_path):
    """Each format's unpickler takes what its format holds: DeepSpeed's classes (formats/deepspeed/pickles.py) in
    DeepSpeed's files only. A single-process torch.save file or Lightning .ckpt holding DeepSpeed's real
    LossScaler is refused in one line naming the global, nothing written; the controls: the same files without it
    read, and a DeepSpeed checkpoint whose optimizer file pickles DeepSpeed's classes reads."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    model, opt = _trained(tmp_path)
    pt, ckpt = tmp_path / "plain.pt", tmp_path / "plain.ckpt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, ckpt)
    for path in (pt, ckpt):
        assert run_cli("inspect", path).returncode == 0, path
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loss_scaler": LossScaler(2.0)}, pt)
    torch.save({"state_dict": model.state_dict(), "epoch": 1, "loss_scaler": LossScaler(2.0)}, ckpt)
    for path in (pt, ckpt):
        refused(path, tmp_path, "refusing to unpickle global deepspeed.runtime.fp16.loss_scaler.LossScaler")
    deepspeed_save = tag_dir(fixture_dir("z2_fp16_dp2"))
    optim = next(deepspeed_save.glob("*optim_states.pt"))
    with zipfile.ZipFile(optim) as zf:
        pickled = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    assert b"deepspeed.runtime" in pickled          # (it does name DeepSpeed's classes)
    assert run_cli("inspect", deepspeed_save).returncode == 0
