"""`reshard diff`: equal across topologies, a changed element pinpointed, missing/extra/shape found."""
import json
import shutil
import warnings
from dataclasses import replace

import numpy as np
import pytest

import reshard
import reshard.commands.diff
from reshard.core.catalog import MASTER
from reshard.core.dtypes import itemsize
from tests.helpers.cli import run_cli
from tests.helpers.damage import ODD_STEP, set_step, write_in_zip
from tests.helpers.fixtures import fixture_dir


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
    with open(frag.storage.file, "rb") as f:
        f.seek(offset)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
    write_in_zip(frag.storage.file, offset, np.float32(value + delta).tobytes())


@pytest.mark.parametrize("block", [reshard.commands.diff.BLOCK, 7])     # 7: values stream through in many small blocks
def test_changed_element_is_pinpointed(tmp_path, monkeypatch, block):
    monkeypatch.setattr(reshard.commands.diff, "BLOCK", block)
    src = fixture_dir("z2_fp32_dp4")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    _flip_element(reshard.open_checkpoint(changed), "l1.weight", MASTER, 37, 0.25)

    report = reshard.commands.diff.diff(reshard.open_checkpoint(src), reshard.open_checkpoint(changed))
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
    found = {(d.name, d.state, d.kind) for d in reshard.commands.diff.diff(plain, frozen_tied).differences}
    assert {("l2.weight", "exp_avg", "missing"), ("l2.bias", "exp_avg_sq", "missing")} <= found
    assert ("head.weight", "weight", "values") in found      # compared through the tie, values differ
    found = {(d.name, d.state, d.kind) for d in reshard.commands.diff.diff(frozen_tied, plain).differences}
    assert ("l2.weight", "exp_avg", "extra") in found

    adam, sgd = (reshard.open_checkpoint(fixture_dir(n)) for n in ("z2_fp32_dp2", "z2_fp32_sgd_dp2"))
    states = {d.state for d in reshard.commands.diff.diff(adam, sgd).differences if d.kind in ("missing", "extra")}
    assert {"exp_avg", "exp_avg_sq", "momentum_buffer"} <= states

    source = reshard.open_checkpoint(fixture_dir("z2_fp32_dp2"))    # a Catalog is frozen: a changed copy
    tensors = {key: t for key, t in source.tensors.items() if key != ("pos", "module")}
    tensors[("l1.bias", MASTER)] = replace(tensors[("l1.bias", MASTER)], shape=(1, 19))
    reshaped = replace(source, params={n: p for n, p in source.params.items() if n != "pos"}, tensors=tensors)
    found = {(d.name, d.kind) for d in reshard.commands.diff.diff(plain, reshaped).differences}
    assert {("pos", "missing"), ("l1.bias", "shape")} <= found


def test_diff_of_unreadable_input_is_trouble(tmp_path):
    proc = run_cli("diff", fixture_dir("z2_fp32_dp2"), tmp_path / "nothing", check=2)
    assert proc.stderr.count("\n") == 1 and "no such file" in proc.stderr


@pytest.mark.parametrize("name", ["z1_bf16_frozen_tied_dp2", "z3_fp32_frozen_tied_dp2", "z2_fp32_roundrobin_dp4"])
def test_export_has_no_difference_from_its_source(tmp_path, name):
    src = fixture_dir(name)
    # fp32: the masters exactly (a bf16 run's default export is them rounded, which diff reports as different)
    run_cli("export", src, tmp_path / "one.safetensors", "--dtype", "fp32", "--quiet", check=0)
    run_cli("export", src, tmp_path / "shards", "--max-shard-size", "2KB", "--dtype", "fp32", "--quiet", check=0)
    for out in ("one.safetensors", "shards"):
        report = json.loads(run_cli("diff", src, tmp_path / out, "--json", check=0).stdout)
        assert report["equal"] and report["compared"] == len(reshard.open_checkpoint(src).order) - \
            len(reshard.open_checkpoint(src).aliases)
        assert any("only A holds optimizer state" in n for n in report["notes"])
    run_cli("export", src, tmp_path / "bf16.safetensors", "--dtype", "bf16", "--quiet", check=0)
    report = json.loads(run_cli("diff", src, tmp_path / "bf16.safetensors", "--json", check=1).stdout)
    assert {d["kind"] for d in report["differences"]} == {"dtype", "values"}


def _nan_with_payload(dtype, payload):
    """A quiet NaN of `dtype` whose low mantissa bits are `payload` (torch makes only the canonical one)."""
    import torch
    bits = {torch.float32: (torch.int32, 0x7FC00000), torch.bfloat16: (torch.int16, 0x7FC0),
            torch.float16: (torch.int16, 0x7E00)}[dtype]
    return torch.tensor([bits[1] | payload], dtype=bits[0]).view(dtype)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nan_and_inf_are_reported_as_such(tmp_path, dtype):
    import torch
    dtype = getattr(torch, dtype)
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([1.0, 2.0, nan, 4.0, inf, -inf, 5.0, 6.0, nan, 0.0], dtype=dtype)
    b = a.clone()
    b[1], b[5], b[6], b[9] = nan, inf, inf, -0.0      # NaN vs 2; -inf vs inf; inf vs 5; -0.0 vs 0.0
    b[8] = _nan_with_payload(dtype, 3)                 # NaN vs NaN with other bits: equal, noted
    b[3] = 4.5                                         # one finite difference
    torch.save({"w": a, "ok": a.clone()}, tmp_path / "a.pt")
    torch.save({"w": b, "ok": a.clone()}, tmp_path / "b.pt")

    with warnings.catch_warnings():
        warnings.simplefilter("error")      # as `python -W error`: a warning raised, its traceback on stderr
        proc = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr      # no numpy warning, as an error or not
    report = json.loads(proc.stdout)
    [d] = report["differences"]
    assert d["name"] == "w" and d["kind"] == "values"
    assert (d["nan_mismatches"], d["first_nan_mismatch"]) == (1, 1)
    assert (d["inf_mismatches"], d["first_inf_mismatch"]) == (2, 5)
    assert d["max_abs_diff"] == 0.5                   # the finite gap, not inf
    assert "NaN on one side only at 1 element(s), first at element 1" in d["detail"]
    assert "infinity facing another value at 2 element(s), first at element 5" in d["detail"]
    assert "max abs diff 0.5 at element 3" in d["detail"] and "inf" not in d["detail"].split(";")[0]
    assert any("NaNs with other bits" in n and "w (weight)" in n for n in report["notes"])

    text = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", check=1)
    assert text.stderr == "" and "max abs diff inf" not in text.stdout
    # --atol covers the finite gap, never a NaN or an infinity
    atol = json.loads(run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--atol", "1", "--json",
                              check=1).stdout)
    assert "max abs diff" not in atol["differences"][0]["detail"] and atol["differences"][0]["nan_mismatches"] == 1

    # control: NaN and inf at the same places (any NaN bits) are equal
    same = a.clone()
    same[8] = _nan_with_payload(dtype, 3)
    torch.save({"w": same, "ok": a.clone()}, tmp_path / "same.pt")
    report = json.loads(run_cli("diff", tmp_path / "a.pt", tmp_path / "same.pt", "--json", check=0).stdout)
    assert report["equal"] and report["compared"] == 2


def test_complex_values_are_compared_whole(tmp_path):
    import torch
    a = torch.tensor([1 + 1j, 2 + 0j, complex(float("nan"), 1)], dtype=torch.complex64)
    b = a.clone()
    b[0] = 1 + 1.5j           # only the imaginary part differs
    torch.save({"z": a}, tmp_path / "a.pt")
    torch.save({"z": b}, tmp_path / "b.pt")
    proc = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json", check=1)
    assert proc.stderr == ""
    [d] = json.loads(proc.stdout)["differences"]
    assert d["max_abs_diff"] == 0.5 and "at element 0" in d["detail"] and d["nan_mismatches"] == 0
    run_cli("diff", tmp_path / "a.pt", tmp_path / "a.pt", check=0)


@pytest.mark.parametrize("block", [reshard.commands.diff.BLOCK, 7])
def test_nan_in_a_zero_checkpoint_is_located_and_survives_conversion(tmp_path, monkeypatch, block):
    """A NaN written at a known element of a real DeepSpeed save (offsets from reshard's catalog): found
    against the original at that element, and equal to itself across a change of topology."""
    monkeypatch.setattr(reshard.commands.diff, "BLOCK", block)
    src = fixture_dir("z2_fp32_dp4")
    nan = tmp_path / "nan"
    shutil.copytree(src, nan)
    tensor = reshard.open_checkpoint(nan).tensor("emb.weight", MASTER)
    element = next(f for f in tensor.fragments if f.start > 0).start + 3      # inside a later rank's partition
    frag = next(f for f in tensor.fragments if f.start <= element < f.stop)
    write_in_zip(frag.storage.file, frag.storage.offset + (frag.elem_offset + element - frag.start) * 4,
                 np.float32(np.nan).tobytes())

    with np.errstate(all="raise"):      # no numpy warning on the way
        report = reshard.commands.diff.diff(reshard.open_checkpoint(src), reshard.open_checkpoint(nan))
    [d] = report.differences
    assert (d.name, d.kind, d.nan_mismatches, d.first_nan_mismatch) == ("emb.weight", "values", 1, element)
    assert d.max_abs_diff == 0 and "max abs diff" not in d.detail

    run_cli("convert", nan, tmp_path / "dp3", "--to", "dp=3,zero=3", "--quiet", check=0)
    assert reshard.commands.diff.diff(reshard.open_checkpoint(nan), reshard.open_checkpoint(tmp_path / "dp3")).equal
    proc = run_cli("diff", src, tmp_path / "dp3", check=1)
    assert proc.stderr == "" and f"NaN on one side only at 1 element(s), first at element {element}" in proc.stdout


def _rewrite(path, edit):
    import torch
    sd = torch.load(path, weights_only=False)
    edit(sd)
    torch.save(sd, path)


def _groups(sd):
    inner = sd["optimizer_state_dict"]
    return inner["base_optimizer_state"]


def test_one_ranks_step_differing_is_a_difference(tmp_path):
    """Issue 24.5: one rank's step 3.0000002 among 4 ranks' 3. diff names that file (exit 1), also with --atol (it
    bounds tensors only: scalars compare exactly); the negative control: the untouched copy diffs clean."""
    src = fixture_dir("z2_fp32_dp4")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    assert run_cli("diff", src, changed, check=0).stdout.startswith("no difference")
    victim = changed / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    set_step(victim, 3.0000002)
    proc = run_cli("diff", src, changed, "--atol", "1", check=1)
    assert proc.stdout.splitlines() == [f"B only: {victim}: {ODD_STEP}",
                                        "DIFFERENT (atol 1): 1 difference; 34 tensors, 5,604 elements compared"]
    [d] = json.loads(run_cli("diff", changed, src, "--json", check=1).stdout)["differences"]
    assert (d["name"], d["kind"], d["detail"]) == ("A only", "problem", f"{victim}: {ODD_STEP}")


@pytest.mark.parametrize("what,edit,line", [
    ("step", lambda sd: [e.__setitem__("step", e["step"] + 2 ** -22) for e in _groups(sd)["state"].values()],
     "emb.weight, l1.weight, l1.bias … (step): step 3.0 in A, 3.000000238418579 in B (8 params)"),
    ("lr", lambda sd: _groups(sd)["param_groups"][0].__setitem__("lr", 0.0100001),
     "emb.weight, l1.weight, l1.bias … (lr): lr 0.0028000000000000004 in A, 0.0100001 in B (8 params)"),
    ("betas", lambda sd: _groups(sd)["param_groups"][0].__setitem__("betas", (0.9, 0.99)),
     "emb.weight, l1.weight, l1.bias … (betas[1]): betas[1] 0.999 in A, 0.99 in B (8 params)"),
    ("loss scale", lambda sd: setattr(sd["optimizer_state_dict"]["loss_scaler"], "cur_scale", 2.0),
     "loss_scaler.cur_scale (scalar): 1.0 in A, 2.0 in B"),
    ("clip_grad", lambda sd: sd["optimizer_state_dict"].__setitem__("clip_grad", 0.5),
     "clip_grad (scalar): 1.0 in A, 0.5 in B")])
def test_every_optimizer_scalar_is_compared(tmp_path, what, edit, line):
    """A scalar changed alike in every rank's optimizer file: per param step, hyper-parameters, the loss scaler's
    state, clip_grad: one line each, with both values."""
    src = fixture_dir("z2_fp32_dp2")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    for path in (changed / "global_step3").glob("*optim_states.pt"):
        _rewrite(path, edit)
    proc = run_cli("diff", src, changed, check=1)
    assert proc.stdout.splitlines()[:-1] == [line], proc.stdout


@pytest.mark.parametrize("key,value,line", [
    ("global_steps", 4, "global_steps (scalar): 3 in A, 4 in B"),
    ("global_samples", 13, "global_samples (scalar): 12 in A, 13 in B"),
    ("lr_scheduler", {"last_batch_iteration": 3}, "lr_scheduler.last_batch_iteration (scalar): 2 in A, 3 in B"),
    ("epoch", 2, "client_state.epoch (scalar): 1 in A, 2 in B")])
def test_training_counters_scheduler_and_client_state_are_compared(tmp_path, key, value, line):
    src = fixture_dir("z2_fp32_dp2")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    _rewrite(changed / "global_step3" / "mp_rank_00_model_states.pt", lambda sd: sd.__setitem__(key, value))
    proc = run_cli("diff", src, changed, check=1)
    assert proc.stdout.splitlines()[:-1] == [line], proc.stdout
