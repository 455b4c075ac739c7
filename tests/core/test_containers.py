"""reshard.core.container.Container: each container (torch zip, .distcp, safetensors) knows its file's exact size
before a byte is written, writes it front to back into any stream, and is a frozen dataclass of typed options;
convert and export take them from one registry (reshard.formats.containers), and the core imports none."""
from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch

from reshard.core.write_requests import NewTensor, Piece
from reshard.formats import containers
from reshard.formats.dcp.writer import DistcpFileBuilder
from reshard.formats.safetensors_file import SafetensorsFileBuilder
from reshard.formats.torchsave_write import TorchFileBuilder
from reshard.storage.posix_sink import HashingSink

SIZES = (3, 700, 1, 1500)       # elements (float32) of each tensor


class Stream(io.RawIOBase):
    """An in-memory stream that, like the executor's sink, cannot seek: every byte written goes at the end."""

    def __init__(self):
        super().__init__()
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.data += memoryview(data).cast("B")
        return memoryview(data).nbytes

    def tell(self) -> int:
        return len(self.data)


def _torch():
    file = TorchFileBuilder("x.pt", archive="x")
    return file.build({f"t{i}": file.slot("float32", (n,), [Piece(n)]) for i, n in enumerate(SIZES)})


def _safetensors():
    file = SafetensorsFileBuilder("x.safetensors")
    for i, n in enumerate(SIZES):
        file.slot("float32", (n,), [Piece(n)], key=f"t{i}")
    return file.build({"format": "pt"})


def _distcp():
    file = DistcpFileBuilder("__0_0.distcp")
    file.add_value({"step": 3})
    for n in SIZES:
        file.add_chunk("float32", (n,), [Piece(n)])
    file.add_value([1, 2])
    return file.build()


FILES = {"torch": _torch, "safetensors": _safetensors, "distcp": _distcp}


def _write(container, header: bytes, slots, out) -> None:
    with container.writer(out, header, slots) as writer:
        for slot in slots:
            with writer.storage(slot.key, slot.nbytes) as stream:
                stream.write(bytes(range(256)) * (slot.nbytes // 256) + bytes(slot.nbytes % 256))


@pytest.mark.parametrize("name", sorted(FILES))
def test_exact_size_is_the_bytes_written(name):
    file = FILES[name]()
    container, header = file.container(), file.header()
    out = Stream()
    _write(container, header, file.slots, out)
    assert type(container).name == name and len(out.data) == container.file_size(header, file.slots) > 0
    # negative control: a file whose last storage is 64 bytes bigger is not the size of the bytes written (64: a
    # few bytes more may only eat the 64-byte alignment padding of the member after it)
    grown = [*file.slots[:-1], NewTensor(file.slots[-1].key, "float32", (SIZES[-1] + 16,))]
    assert container.file_size(header, grown) != len(out.data)


@pytest.mark.parametrize("name", sorted(FILES))
def test_written_through_the_sink_the_file_is_its_exact_size_and_loads(name, tmp_path):
    file = FILES[name]()
    container, header, path = file.container(), file.header(), tmp_path / file.path
    with HashingSink(str(path), container.file_size(header, file.slots)) as sink:
        _write(container, header, file.slots, sink)
    assert path.stat().st_size == sink.size == container.file_size(header, file.slots)
    if name == "torch":
        assert [t.numel() for t in torch.load(path, weights_only=True).values()] == list(SIZES)
    elif name == "safetensors":
        from safetensors.torch import load_file
        assert [load_file(path)[f"t{i}"].numel() for i in range(len(SIZES))] == list(SIZES)


def test_a_storage_cut_short_is_refused():
    """Negative control for the sizes above: a writer that would leave a chunk short of its bytes says so."""
    file = _distcp()
    slot = file.slots[0]
    with pytest.raises(AssertionError, match="left over"):
        with file.container().writer(Stream(), file.header(), file.slots) as writer:
            with writer.storage(slot.key, slot.nbytes) as stream:
                stream.write(bytes(slot.nbytes - 1))


@pytest.mark.parametrize("name", sorted(FILES))
def test_options_are_typed_frozen_and_travel_to_worker_processes(name):
    container = FILES[name]().container()
    assert dataclasses.is_dataclass(container) and containers.CONTAINERS[name].container is type(container)
    assert pickle.loads(pickle.dumps(container)) == container
    field = next(iter(dataclasses.fields(container)), None)
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(container, field.name, None)


@pytest.mark.parametrize("name", sorted(FILES))
def test_the_built_write_request_is_immutable(name):
    """A built TensorFile changes no more: its fields cannot be set, its slots are a tuple and its pieces a
    read-only mapping, and a slot made on its builder afterwards is not in it (its header and layout stay what the
    planner read). The control: the builder itself takes the new slot."""
    builder = {"torch": lambda: TorchFileBuilder("x.pt", archive="x"), "safetensors": lambda: SafetensorsFileBuilder(
        "x.safetensors"), "distcp": lambda: DistcpFileBuilder("__0_0.distcp")}[name]()
    builder.slot("float32", (4,), [Piece(4)], key="t0")
    file = builder.build(**({"tree": {"t0": builder.slots[0]}} if name == "torch" else {}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        file.tree = {}      # type: ignore[misc]
    with pytest.raises(AttributeError):
        file.slots.append(NewTensor("t1", "float32", (2,)))     # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        file.pieces["t1"] = (Piece(2),)     # type: ignore[index]
    header, size = file.header(), file.container().file_size(file.header(), file.slots)
    builder.slot("float32", (2,), [Piece(2)], key="t1")
    assert [s.key for s in file.slots] == ["t0"] and list(file.pieces) == ["t0"]
    assert (file.header(), file.container().file_size(file.header(), file.slots)) == (header, size)
    assert [s.key for s in builder.slots] == ["t0", "t1"] and list(builder.pieces) == ["t0", "t1"]


def test_export_writes_the_registered_containers():
    from reshard.commands.export import FORMATS
    assert FORMATS is containers.EXPORTS
    assert {name: containers.CONTAINERS[name].exported_as for name in FORMATS} == FORMATS
    assert all(type(kind.from_entries("x", [], {}, {}).container()).name == name
               for name, kind in FORMATS.items())
