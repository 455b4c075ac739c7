"""The safe torch.save reader: exact byte locations, and nothing executed."""
import enum
import os
import subprocess

import numpy as np
import pytest
import torch

from reshard.core.catalog import Fragment
from reshard.errors import CheckpointError, UnsafeCheckpointError
from reshard.formats import torchsave_read
from reshard.formats.deepspeed import pickles as deepspeed_pickles
from reshard.formats.deepspeed.standins import DynamicLossScaler, ZeroStageEnum, fragment_address
from reshard.formats.torchsave_read import TensorRef
from reshard.formats.torchsave_write import GlobalName, pickle_tree
from reshard.reading.source_bytes import MappedFiles, read_scalar
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import FIXTURE_NAMES, copy_fixture, tag_dir


def _bytes_of(ref: TensorRef) -> bytes:
    size = torch.empty((), dtype=getattr(torch, ref.dtype)).element_size()
    with open(ref.storage.file, "rb") as f:
        f.seek(ref.storage.offset + ref.storage_offset * size)
        return f.read(ref.numel * size)


def test_tensors_are_located_not_read(tmp_path):
    values = {
        "bf16": torch.arange(12, dtype=torch.bfloat16).view(3, 4),
        "view": torch.arange(10, dtype=torch.float32)[3:7],
        "int": torch.tensor([5, -1], dtype=torch.int64),
        "half": torch.randn(2, 2).half(),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0),
        "nested": [{"x": torch.ones(2)}, (torch.zeros(1), "s")],
        "dtype": torch.float16, "size": torch.Size([2, 3]), "bytes": b"\x00\xff",
    }
    path = tmp_path / "t.pt"
    torch.save(values, path)
    loaded = torchsave_read.load(path)
    for key in ("bf16", "view", "int", "half", "scalar"):
        ref, tensor = loaded[key], values[key]
        assert isinstance(ref, TensorRef) and ref.shape == tuple(tensor.shape)
        assert _bytes_of(ref) == tensor.contiguous().numpy().tobytes() if tensor.dtype != torch.bfloat16 \
            else _bytes_of(ref) == tensor.view(torch.int16).numpy().tobytes()
    assert loaded["view"].storage_offset == 3
    assert read_scalar(loaded["scalar"]) == 3.0
    assert loaded["empty"].numel == 0
    assert loaded["size"] == (2, 3) and repr(loaded["dtype"]) == "torch.float16" and loaded["bytes"] == b"\x00\xff"
    with MappedFiles() as files:
        ref = loaded["int"]
        got = files.fragment(Fragment(0, 2, ref.storage, ref.storage_offset), "int64")
        assert got.tolist() == [5, -1]


class _Payload:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


@pytest.mark.parametrize("call, argument, shown", [
    (os.system, "touch {canary}", "system"),
    (subprocess.call, ["touch", "{canary}"], "call"),
    (eval, "open('{canary}', 'w')", "eval"),
    (exec, "open('{canary}', 'w')", "exec"),
])
def test_hostile_global_is_refused_and_nothing_runs(tmp_path, call, argument, shown):
    canary = tmp_path / "canary"
    arg = [a.format(canary=canary) for a in argument] if isinstance(argument, list) else argument.format(canary=canary)
    path = tmp_path / "evil.pt"
    torch.save({"ok": torch.ones(2), "deep": {"state": [_Payload(call, (arg,))]}}, path)
    with pytest.raises(CheckpointError) as err:
        torchsave_read.load(path)
    assert str(path) in str(err.value) and shown in str(err.value) and "allow-list" in str(err.value)
    assert not canary.exists()


def test_hostile_payload_inside_a_real_checkpoint_through_the_cli(tmp_path):
    name = "z2_fp32_dp2" if "z2_fp32_dp2" in FIXTURE_NAMES else FIXTURE_NAMES[0]
    save = copy_fixture(name, tmp_path)
    canary = tmp_path / "canary"
    optim = sorted(tag_dir(save).glob("*optim_states.pt"))[-1]
    sd = torch.load(optim, weights_only=False)
    sd["optimizer_state_dict"]["clip_grad"] = _Payload(os.system, (f"touch {canary}",))
    torch.save(sd, optim)
    for command in ("inspect", "validate"):
        proc = run_cli(command, save)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(optim) in lines[0] and "system" in lines[0], proc.stderr
    assert not canary.exists()


class _Bag:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class _NamespaceStandIn(_Bag):
    """A stand-in no format of reshard's has: argparse.Namespace, through the StandIn protocol alone."""

    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("argparse", "Namespace")


class _SignalStandIn(int, enum.Enum):
    term = 15

    @classmethod
    def stands_for(cls) -> GlobalName:
        return GlobalName("signal", "Signals")


def test_a_stand_in_is_pickled_under_the_global_it_stands_for():
    """The torch.save writer knows no format: any class saying what it stands for (torchsave_write.StandIn) is
    written under that global, an object as NEWOBJ and its attributes, an enum member as its class called with its
    value, and Python's own unpickler gives the real classes. The control: the same object without `stands_for` is
    written under its own name, and loads as the stand-in class, not the framework's."""
    import argparse
    import pickle
    import signal

    loaded = pickle.loads(pickle_tree({"args": _NamespaceStandIn(lr=0.5, tp=2), "sig": _SignalStandIn.term}))
    assert type(loaded["args"]) is argparse.Namespace and vars(loaded["args"]) == {"lr": 0.5, "tp": 2}
    assert loaded["sig"] is signal.SIGTERM
    control = pickle.loads(pickle_tree({"args": _Bag(lr=0.5, tp=2)}))
    assert type(control["args"]) is _Bag


def test_deepspeed_classes_become_inert_standins(tmp_path):
    """Through DeepSpeed's allow-list; torch's own (any other format's base) refuses the first (the control)."""
    # Pickle objects under DeepSpeed's global names without DeepSpeed: write the bytes by hand.
    import pickle
    import zipfile
    payload = pickle.dumps(
        {"stage": ZeroStageEnum.weights, "scaler": DynamicLossScaler(), "addr": fragment_address(5, 7)}, protocol=2)
    for cls, (module, name) in __import__("reshard.formats.deepspeed.standins", fromlist=["x"]).GLOBAL_NAMES.items():
        payload = payload.replace(f"c{cls.__module__}\n{cls.__qualname__}\n".encode(), f"c{module}\n{name}\n".encode())
    path = tmp_path / "ds.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ds/data.pkl", payload)
    loaded = deepspeed_pickles.load(path)
    assert loaded["stage"] == 3 and isinstance(loaded["stage"], ZeroStageEnum)
    assert isinstance(loaded["scaler"], DynamicLossScaler)
    assert loaded["addr"] == fragment_address(5, 7)
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle global deepspeed.runtime.zero.config"):
        torchsave_read.load(path)


def test_legacy_format_is_refused_clearly(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy .non-zip. torch serialization"):
        torchsave_read.load(path)


def test_empty_truncated_and_garbage_files(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"a": torch.arange(1000, dtype=torch.float32)}, good)
    data = good.read_bytes()
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        torchsave_read.load(tmp_path / "empty.pt")
    for cut in (10, 100, len(data) // 2, len(data) - 30, len(data) - 1):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as err:
            torchsave_read.load(bad)
        assert str(bad) in str(err.value)
    (tmp_path / "junk.pt").write_bytes(np.arange(100, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="not a torch.save"):
        torchsave_read.load(tmp_path / "junk.pt")


@pytest.mark.parametrize("tensors", [1, 300])
def test_zip_directory_reads_what_zipfile_reads_of_torch_saves(tmp_path, tensors):
    """The short path through a torch.save archive's directory (reshard.formats.zip_directory) names every member
    at the offset, size and CRC zipfile gives; archives it does not read (a comment, a damaged end record) go to
    zipfile, with the same result or the same one-line refusal."""
    import io
    import zipfile

    from reshard.formats import zip_directory
    path = tmp_path / "t.pt"
    torch.save({f"t{i}": torch.randn(3) for i in range(tensors)}, path)
    data = path.read_bytes()
    found = zip_directory.members(lambda n: data[-n:], len(data))
    expected = zipfile.ZipFile(io.BytesIO(data)).infolist()
    assert [(m.filename, m.header_offset, m.file_size, m.CRC) for m in found] == \
        [(i.filename, i.header_offset, i.file_size, i.CRC) for i in expected]
    assert tensors == 1 or sum(46 + len(m.filename) for m in found) > 4096   # a directory beyond the first read

    # controls: a comment (torch.save writes none) or a damaged end record is not read here, zipfile decides
    commented = data[:-2] + (4).to_bytes(2, "little") + b"note"
    assert zip_directory.members(lambda n: commented[-n:], len(commented)) is None
    damaged = data[:-22] + b"PK\x05\x07" + data[-18:]
    assert zip_directory.members(lambda n: damaged[-n:], len(damaged)) is None
    (tmp_path / "commented.pt").write_bytes(commented)
    assert torchsave_read.load(tmp_path / "commented.pt")["t0"].shape == (3,)
    (tmp_path / "damaged.pt").write_bytes(damaged)
    with pytest.raises(CheckpointError, match="damaged.pt: .*zip"):
        torchsave_read.load(tmp_path / "damaged.pt")
