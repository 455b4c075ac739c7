"""Every registered reader and writer satisfies its one protocol (reshard/formats/protocol.py): the same
call signature for all, and what reading options each takes declared as a frozen dataclass."""
import dataclasses
import importlib
import inspect

import pytest

from reshard.errors import UsageError
from reshard.formats import READERS, WRITERS, reader_options
from reshard.formats.protocol import Reader, ReadRequest, Writer


def _parameters(function) -> list:
    """(name, default) of each parameter: one signature means the same names and the same optional ones."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", READERS)
def test_every_reader_satisfies_the_reader_protocol(name):
    module = importlib.import_module(name)
    assert isinstance(module, Reader), name
    for method in ("sniff", "read"):
        assert _parameters(getattr(module, method)) == _parameters(getattr(Reader, method)), (name, method)
    options = module.OPTIONS
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen, name
    request = {f.name: f.type for f in dataclasses.fields(ReadRequest)}
    assert {f.name: f.type for f in dataclasses.fields(options)}.items() <= request.items(), name
    assert isinstance(module.FORMAT, str) and module.FORMAT, name


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_writer_satisfies_the_writer_protocol(name):
    module = importlib.import_module(WRITERS[name].module)
    assert isinstance(module, Writer), name
    for method in ("target_files", "describe", "batch_size_advice"):
        assert _parameters(getattr(module, method)) == _parameters(getattr(Writer, method)), (name, method)


def test_the_protocol_check_sees_a_module_that_lacks_a_member():
    """Negative control of the two tests above: a module without OPTIONS or describe is refused."""
    torchfile = importlib.import_module("reshard.formats.single.torchsave_checkpoint")
    lacking = type(torchfile)("lacking")
    lacking.sniff, lacking.read, lacking.FORMAT = torchfile.sniff, torchfile.read, torchfile.FORMAT
    assert not isinstance(lacking, Reader)
    lacking.OPTIONS, lacking.IN_FRAMEWORK_FOLDERS = torchfile.OPTIONS, torchfile.IN_FRAMEWORK_FOLDERS
    assert isinstance(lacking, Reader)
    dcp_writer = importlib.import_module(WRITERS["dcp"].module)
    half = type(dcp_writer)("half")
    half.target_files, half.batch_size_advice = dcp_writer.target_files, dcp_writer.batch_size_advice
    assert not isinstance(half, Writer)


def test_a_hint_reaches_the_readers_that_take_it_and_an_option_not_taken_is_still_refused():
    """model_order is a hint: the safetensors reader gets it, a reader without a use for it (Megatron's) reads
    without it. Negative control: --config, an option, given to that same reader is refused."""
    safetensors = importlib.import_module("reshard.formats.hf.safetensors_reader")
    megatron = importlib.import_module("reshard.formats.megatron.reader")
    assert reader_options(safetensors, "hf/", ReadRequest(model_order=False)) == safetensors.OPTIONS(model_order=False)
    assert reader_options(megatron, "save/", ReadRequest(tag="release", model_order=False)) == \
        megatron.OPTIONS(tag="release")
    with pytest.raises(UsageError, match="--config"):
        reader_options(megatron, "save/", ReadRequest(config="config.json", model_order=False))
