"""`reshard diff`: equal across topologies, a changed element pinpointed, missing/extra/shape found."""
import json
import shutil

import numpy as np
import pytest

import reshard
import reshard.diff
from reshard.catalog import MASTER
from reshard.dtypes import itemsize
from conftest import fixture_dir, run_cli


@pytest.mark.parametrize("name,to", [("z3_bf16_dp4", "dp=3,zero=1"), ("z2_fp32_roundrobin_dp4", "dp=2"),
                                     ("z1_bf16_frozen_tied_dp2", "dp=3,zero=3")])
def test_converted_checkpoint_has_no_difference(tmp_path, name, to):
    src = fixture_dir(name)
    run_cli("convert", src, tmp_path / "out", "--to", to, "--quiet", check=0)
    proc = run_cli("diff", src, tmp_path / "out", "--json", check=0)
    report = json.loads(proc.stdout)
    assert report["equal"] and not report["differences"]
    catalog = reshard.open_checkpoint(src)
    weights = len([p for p in catalog.params if p not in catalog.aliases])
    states = len(catalog.optimizer_states())
    trainable = sum(p.kind == "trainable" for p in catalog.params.values())
    assert report["compared"] >= weights + states * trainable


def _flip_element(catalog, name, state, element, delta):
    """Add `delta` to one element of (name, state) in the file that holds it (fp32 tensors)."""
    tensor = catalog.tensor(name, state)
    assert tensor.dtype == "float32"
    frag = next(f for f in tensor.fragments if f.start <= element < f.stop)
    offset = frag.storage.offset + (frag.elem_offset + element - frag.start) * itemsize(tensor.dtype)
    with open(frag.storage.file, "r+b") as f:
        f.seek(offset)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(offset)
        f.write(np.float32(value + delta).tobytes())


@pytest.mark.parametrize("block", [reshard.diff.BLOCK, 7])     # 7: values stream through in many small blocks
def test_changed_element_is_pinpointed(tmp_path, monkeypatch, block):
    monkeypatch.setattr(reshard.diff, "BLOCK", block)
    src = fixture_dir("z2_fp32_dp4")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    _flip_element(reshard.open_checkpoint(changed), "l1.weight", MASTER, 37, 0.25)

    report = reshard.diff.diff(reshard.open_checkpoint(src), reshard.open_checkpoint(changed))
    assert not report.equal
    [d] = report.differences
    assert (d.name, d.kind) == ("l1.weight", "values")
    assert d.max_abs_diff == pytest.approx(0.25, rel=1e-3)
    assert "at element 37" in d.detail

    proc = run_cli("diff", src, changed, check=1)
    assert "l1.weight (weight): max abs diff" in proc.stdout and "DIFFERENT" in proc.stdout
    run_cli("diff", src, changed, "--atol", "0.5", check=0)


def test_missing_extra_shape_and_state_differences():
    # The same model, but l2 frozen (no optimizer state) and head tied to emb in the second run.
    plain = reshard.open_checkpoint(fixture_dir("z2_fp32_dp2"))
    frozen_tied = reshard.open_checkpoint(fixture_dir("z2_fp32_frozen_tied_dp2"))
    found = {(d.name, d.state, d.kind) for d in reshard.diff.diff(plain, frozen_tied).differences}
    assert {("l2.weight", "exp_avg", "missing"), ("l2.bias", "exp_avg_sq", "missing")} <= found
    assert ("head.weight", "weight", "values") in found      # compared through the tie, values differ
    found = {(d.name, d.state, d.kind) for d in reshard.diff.diff(frozen_tied, plain).differences}
    assert ("l2.weight", "exp_avg", "extra") in found

    adam, sgd = (reshard.open_checkpoint(fixture_dir(n)) for n in ("z2_fp32_dp2", "z2_fp32_sgd_dp2"))
    states = {d.state for d in reshard.diff.diff(adam, sgd).differences if d.kind in ("missing", "extra")}
    assert {"exp_avg", "exp_avg_sq", "momentum_buffer"} <= states

    reshaped = reshard.open_checkpoint(fixture_dir("z2_fp32_dp2"))
    del reshaped.params["pos"]
    del reshaped.tensors[("pos", "module")]
    reshaped.tensors[("l1.bias", MASTER)].shape = (1, 19)
    found = {(d.name, d.kind) for d in reshard.diff.diff(plain, reshaped).differences}
    assert {("pos", "missing"), ("l1.bias", "shape")} <= found


def test_diff_of_unreadable_input_is_trouble(tmp_path):
    proc = run_cli("diff", fixture_dir("z2_fp32_dp2"), tmp_path / "nothing", check=2)
    assert proc.stderr.count("\n") == 1 and "no such file" in proc.stderr
