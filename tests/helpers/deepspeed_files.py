"""DeepSpeed's own files compared with ours: a conversion made in this process and read back, the elements of each
storage that hold real data (the rest is padding), and two files' objects equal but for that padding."""
from __future__ import annotations

import os

import numpy as np

import reshard
from reshard.commands.convert import make_plan
from reshard.core.dtypes import itemsize, numpy_carrier
from reshard.execution.executor import execute
from reshard.formats.deepspeed import pickles as deepspeed_pickles
from reshard.formats.torchsave_read import TensorRef
from tests.helpers.fixtures import fixture_dir, tag_dir


def convert_and_open(src, dst, to):
    """`src` converted to `to` into `dst` by the planner and executor (no CLI), and the output read back."""
    execute(make_plan(reshard.open_checkpoint(src), to), str(dst), progress=False)
    return reshard.open_checkpoint(dst)


def covered_elements(catalog) -> dict:
    """Storage (file, offset) -> element ranges holding real data; the rest is padding."""
    covered: dict = {}
    for tensor in catalog.tensors.values():
        for f in tensor.fragments:
            covered.setdefault((f.storage.file, f.storage.offset), []).append((f.elem_offset, f.elem_offset + f.numel))
    return covered


def _elements(ref):
    size = itemsize(ref.dtype)
    with open(ref.storage.file, "rb") as f:
        f.seek(ref.storage.offset + ref.storage_offset * size)
        return np.frombuffer(f.read(ref.numel * size), dtype=numpy_carrier(ref.dtype))


def assert_same_tree(a, b, where, covered) -> None:
    """Two loaded objects equal: keys and order, types, values, tensor bytes but `a`'s padding (`covered`)."""
    if isinstance(a, TensorRef):
        assert isinstance(b, TensorRef) and (a.dtype, a.shape) == (b.dtype, b.shape), where
        x, y = _elements(a), _elements(b)
        differ = np.flatnonzero(x != y)
        if differ.size:
            # only padding may differ (DeepSpeed leaves whatever was in memory there)
            real = covered.get((a.storage.file, a.storage.offset), [])
            positions = differ + a.storage_offset
            assert not any(((positions >= lo) & (positions < hi)).any() for lo, hi in real), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}", covered)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]", covered)
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def assert_same_files(original, back, covered) -> None:
    """The tag folder `back` holds the files of `original`, each the same objects (assert_same_tree)."""
    assert sorted(os.listdir(original)) == sorted(os.listdir(back))
    for name in sorted(os.listdir(original)):
        assert_same_tree(deepspeed_pickles.load(original / name), deepspeed_pickles.load(back / name), name, covered)


def assert_deepspeeds_own_files(fixture, out) -> None:
    """The save `out` holds the files DeepSpeed wrote for the fixture, but for their padding."""
    assert_same_files(tag_dir(fixture_dir(fixture)), tag_dir(out),
                      covered_elements(reshard.open_checkpoint(fixture_dir(fixture))))
