"""reshard.live.materialize: a planned file built in memory is what torch.load of the written file gives.

reshard.deepspeed_engine.load_checkpoint hands DeepSpeed these objects instead of files, so for every fixture, at
another topology, each planned file is written by the executor, loaded by torch.load, and compared with
its materialized twin: the same tree, every tensor of the same dtype, shape, strides and bytes, and the
same storages shared.
"""
import pytest
import torch

import reshard
from reshard.commands.convert import make_plan
from reshard.execution.executor import execute
from reshard.execution.target_bytes import SourceFiles
from reshard.live.materialize import materialize
from tests.helpers.fixtures import ALL_FIXTURES, copy_fixture, fixture_dir
from tests.helpers.repo import REPO

RULES = {name: str(REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json")
         for name in ALL_FIXTURES if "megatron" in name}


def _plan(src, name, to):
    return make_plan(reshard.open_checkpoint(src, layout_rules=RULES.get(name)), to)


def _same(a, b, where, storages):
    """a (torch.load) and b (materialize) are the same tree; `storages` pairs the storages seen so far."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == \
               (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad), where
        mine, theirs = a.untyped_storage(), b.untyped_storage()
        assert storages.setdefault(mine.data_ptr(), theirs.data_ptr()) == theirs.data_ptr(), f"{where}: sharing"
        assert bytes(mine) == bytes(theirs), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}", storages)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]", storages)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _same(vars(a), vars(b), where, storages)
    else:
        assert a == b or (a != a and b != b), where        # (a NaN hyper-parameter equals itself here)


def _written_and_materialized(plan, out):
    execute(plan, str(out), progress=False)
    sources = SourceFiles(plan.reread())
    try:
        for file in plan.files:
            yield file.path, torch.load(out / file.path, weights_only=False), materialize(file, sources)
    finally:
        sources.close()


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_a_materialized_file_is_the_written_file_loaded(name, tmp_path):
    plan = _plan(fixture_dir(name), name, "dp=3")
    compared = 0
    for path, loaded, made in _written_and_materialized(plan, tmp_path / "out"):
        _same(loaded, made, path, {})
        compared += 1
    assert compared == len(plan.files) > 0


def test_a_changed_source_byte_is_in_the_materialized_file(tmp_path):
    """Negative control: the comparison sees one changed element of a source optimizer state."""
    src = copy_fixture("z2_fp32_dp2", tmp_path / "src")
    plan = _plan(src, "z2_fp32_dp2", "dp=3")
    master = reshard.open_checkpoint(src).tensor("l1.weight", "fp32").fragments[0]
    written = dict((path, loaded) for path, loaded, _ in _written_and_materialized(plan, tmp_path / "out"))
    with open(master.storage.file, "r+b") as f:
        f.seek(master.storage.offset + master.elem_offset * 4)
        f.write(torch.tensor([123.25]).numpy().tobytes())
    sources = SourceFiles({})
    try:
        differ = []
        for file in plan.files:
            try:
                _same(written[file.path], materialize(file, sources), file.path, {})
            except AssertionError:
                differ.append(file.path)
    finally:
        sources.close()
    assert len(differ) == 1 and "optim_states" in differ[0]


def test_map_location_is_applied_to_each_storage(tmp_path):
    """DeepSpeed's SDLoader passes `lambda storage, loc: storage`; whatever it returns is what tensors use."""
    plan = _plan(fixture_dir("z1_fp32_dp2"), "z1_fp32_dp2", "dp=3")
    seen = []
    sources = SourceFiles({})
    try:
        materialize(plan.files[0], sources, lambda storage: seen.append(storage.nbytes()) or storage)
    finally:
        sources.close()
    assert seen and all(n > 0 for n in seen)


@pytest.mark.parametrize("map_location", [{"cpu": "cuda:0"}, {"cuda:0": "cpu"}, {}])
def test_a_map_location_dict_maps_the_storages_as_torch_load_does(map_location, tmp_path):
    """DeepSpeed's load passes what the user gave: torch.load's {saved location: new one}. On this CPU-only
    build, torch.load's own move to cuda:0 fails; ours must fail alike, and the others stay on the CPU."""
    from reshard.live.deepspeed_engine import ServedFiles
    src = fixture_dir("z1_fp32_dp2")
    plan = _plan(src, "z1_fp32_dp2", "dp=2")        # the same files: torch.load reads the source's own
    name = next(f.path for f in plan.files if f.path.endswith("model_states.pt"))
    served = ServedFiles(None, str(tmp_path), plan)
    outcomes = []
    try:
        for load in (lambda: torch.load(src / name, map_location=map_location, weights_only=False),
                     lambda: served.load(str(tmp_path / name), map_location=map_location)):
            try:
                outcomes.append({t.device.type for t in _tensors(load())})
            except RuntimeError as e:        # torch: no CUDA in this build
                outcomes.append(type(e))
    finally:
        served.close()
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0] == ({"cpu"} if map_location.get("cpu", "cpu") == "cpu" else RuntimeError), outcomes


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)
