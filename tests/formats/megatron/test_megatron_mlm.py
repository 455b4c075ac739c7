"""Megatron saves made with Megatron-LM's own defaults (fixtures/megatron_core/mcore_mlm_*: bf16 with gradients
reduced in fp32 — accumulate_allreduce_grads_in_fp32, which Megatron-LM's validate_args sets for every bf16 run —, the
tokenizer's 100 tokens padded to make_vocab_size_divisible_by (128) x tp, the tokenizer's size not in args; and fp32
runs under every optimizer sharding), converted and proven by megatron-core 0.16.1 itself: `dist_checkpointing.load`
at the target (tests/scripts/megatron_load.py: the model built as Megatron-LM builds it there, its vocabulary padded for
that tp), every weight, master and moment equal to the truth of the live run (the vocabulary-sized ones as Megatron-LM's
tools/checkpoint re-pads them), the step kept, one more training step.

Negative controls: Megatron's own load of the bf16 save at another tp fails; a conversion with one element changed
loads and the comparison names that tensor; the grad buffers keyed as a run reducing in bf16 would key them
(args.accumulate_allreduce_grads_in_fp32 = False in a source that records no buffers) do not load in a run reducing
in fp32, with the KeyError every bf16 conversion gave before the buffers' dtypes were derived.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

import reshard
from reshard.commands.convert import make_plan
from reshard.errors import ReshardError, UsageError
from reshard.execution.executor import execute
from tests.helpers.cli import run_cli
from tests.helpers.engine_launches import shares
from tests.helpers.fixtures import FIXTURES
from tests.helpers.megatron_saves import change_one_element, degrees

ROOT = FIXTURES / "megatron_core"
# (fixture, --to): tp, pp and dp changed from each Megatron-LM default; the sharding kept unless asked
CONVERSIONS = [
    ("mcore_mlm_bf16_dp_reshardable_tp2", "tp=1,pp=1,dp=2,vocab=100"),       # bf16 dp_reshardable; 256 -> 128 rows
    ("mcore_mlm_bf16_dp_reshardable_dp2", "tp=2,pp=1,dp=1"),                 # 128 -> 256 rows, derived
    ("mcore_mlm_bf16_fully_reshardable_tp2", "tp=1,pp=2,dp=1,vocab=100"),    # fully_reshardable kept, pp 1 -> 2
    ("mcore_mlm_fp32_plain_tp2", "tp=1,pp=1,dp=2,vocab=100"),                # fp32, plain kept (no master copy)
    ("mcore_mlm_fp32_plain_tp2", "tp=1,pp=2,dp=1,sharding=dp_reshardable,vocab=100"),   # the params as masters
    ("mcore_mlm_fp32_fully_reshardable_pp2", "tp=2,pp=1,dp=1"),              # fp32 fully_reshardable kept
    ("mcore_mlm_fp32_dp_reshardable_dp2", "tp=2,pp=1,dp=1"),                 # fp32 dp_reshardable
    ("mcore_mlm_fp32_dp_reshardable_dp2", "tp=1,pp=2,dp=1,sharding=plain"),  # -> the plain FP32Optimizer
    ("mcore_mlm_legacy_fp32_plain_tp2", "tp=1,pp=1,dp=2,vocab=100"),         # legacy torch format, fp32 plain
    ("mcore_mlm_legacy_fp32_distributed_dp2", "tp=2,pp=1,dp=1"),             # legacy distrib_optim.pt, fp32
    ("mcore_mlm_fp32_fully_sharded_model_space_dp2_v015", "tp=2,pp=1,dp=1"),   # 0.15's model space, fp32
]
# the model alone (sharding=none: what Megatron-LM's --no-save-optim --no-save-rng writes), loaded as its
# --no-load-optim --no-load-rng loads it: the weights-only form `reshard thin` keeps of a Megatron save
WEIGHTS_ONLY = [("mcore_mlm_bf16_dp_reshardable_tp2", "tp=2,pp=1,dp=1,sharding=none"),
                ("mcore_mlm_fp32_plain_tp2", "tp=1,pp=1,dp=2,sharding=none,vocab=100")]
CHANGED = "output_layer.weight"       # the element the negative control changes (its exp_avg)
FP32_GRADS_OFF = "mcore_mlm_bf16_fully_reshardable_tp2"     # records no buffers: args alone decide their dtypes


def _info(name: str) -> dict:
    return json.loads((ROOT / name / "truth.json").read_text())


def _sharding(name: str, to: str) -> str:
    own = _info(name)["sharding_type"]
    asked = dict(item.split("=") for item in to.split(",")).get("sharding")
    return asked or {None: "plain", "dp_zero_gather_scatter": "dp_reshardable"}.get(own, own)


def _rows(to: str) -> int:
    """The embedding's rows Megatron-LM builds at the target's tp: 100 tokens padded to a multiple of 128 x tp."""
    multiple = 128 * degrees(to)["tp"]
    return -(-100 // multiple) * multiple


def _job(label: str, name: str, to: str, save) -> dict:
    cut = degrees(to)
    return {"label": label, "save": str(save), "tp": cut["tp"], "pp": cut["pp"], "vocab": _rows(to),
            "fp32": _info(name)["model_dtype"] == "float32", "truth": str(ROOT / name / "truth.safetensors"),
            "weights_only": "sharding=none" in to}


def _convert(name: str, to: str, dst) -> None:
    execute(make_plan(reshard.open_checkpoint(str(ROOT / name / "save")), to), str(dst), progress=False)


@shares("megatron_load.py")
def megatron_load_jobs(out):
    """Every conversion, a changed one, one whose grad buffers say bf16 reduction, and Megatron's own load of the
    bf16 dp_reshardable save at another tp: 2 ranks."""
    jobs = []
    for index, (name, to) in enumerate(CONVERSIONS):
        _convert(name, to, out / f"conversion-{index}")
        jobs.append(_job(f"{name}:{to}", name, to, out / f"conversion-{index}"))
    name, to = CONVERSIONS[1]
    _convert(name, to, out / "changed")
    change_one_element(out / "changed", CHANGED)
    jobs.append(_job("changed", name, to, out / "changed"))
    source = shutil.copytree(ROOT / FP32_GRADS_OFF / "save", out / "bf16-grads")
    common = torch.load(source / "iter_0000003" / "common.pt", weights_only=False)
    common["args"].accumulate_allreduce_grads_in_fp32 = False
    torch.save(common, source / "iter_0000003" / "common.pt")
    to = "tp=2,pp=1,dp=1,sharding=dp_reshardable"
    execute(make_plan(reshard.open_checkpoint(str(source)), to), str(out / "bf16-grads-out"), progress=False)
    jobs.append(_job("bf16 grads", FP32_GRADS_OFF, to, out / "bf16-grads-out"))
    name = CONVERSIONS[0][0]
    jobs.append(_job("megatron itself", name, "tp=1,pp=1,dp=2", ROOT / name / "save"))
    for index, (name, to) in enumerate(WEIGHTS_ONLY):
        _convert(name, to, out / f"weights-{index}")
        jobs.append(_job(f"{name}:{to}", name, to, out / f"weights-{index}"))
    name, to = WEIGHTS_ONLY[0]        # the control: a full load (the optimizer asked for) of the model alone fails
    jobs.append({**_job("weights only, optimizer asked", name, to, out / "weights-0"), "weights_only": False})
    # `reshard thin` of an iteration folder of a run, loaded as --no-load-optim loads it; and with one changed element
    name = THINNED
    save = thinned_run(out / "thin-run")
    for label, changed in (("thinned", False), ("thinned, changed", True)):
        loaded_save = out / label.replace(", ", "-") / "save"
        shutil.copytree(save / "iter_0000001", loaded_save / "iter_0000001")
        (loaded_save / "latest_checkpointed_iteration.txt").write_text("1")
        if changed:
            change_module_element(loaded_save / "iter_0000001", CHANGED, fix_crc=True)
        jobs.append({**_job(label, name, "tp=2,pp=1,dp=1", loaded_save), "weights_only": True})
    return [(2, None, job) for job in jobs]


@pytest.fixture(scope="module")
def loaded(engine_launches):
    return {r["label"]: r for r in engine_launches.results(megatron_load_jobs)}


@pytest.mark.engine
@pytest.mark.parametrize("name, to", CONVERSIONS, ids=[f"{n.removeprefix('mcore_mlm_')}-{t}" for n, t in CONVERSIONS])
def test_megatron_loads_the_conversion_of_a_default_run_as_the_truth(name, to, loaded):
    result = loaded[f"{name}:{to}"]
    assert result["loaded"] and result["error"] is None, result
    assert result["problems"] == [], result["problems"]      # every weight, master and moment, re-padded rows too
    step = _info(name)["step"]
    assert result["step"] == step and result["group_step"] == ([] if _sharding(name, to) == "plain" else step)
    assert result["losses"] and all(math.isfinite(x) for x in result["losses"])
    assert result["moved"] and result["step_after"] == [step[0] + 1]


@pytest.mark.engine
def test_megatron_itself_cannot_load_the_default_run_at_another_tp(loaded):
    result = loaded["megatron itself"]
    assert not result["loaded"] and "mismatch" in result["error"], result["error"]


@pytest.mark.engine
def test_a_changed_element_of_a_repadded_tensor_is_found(loaded):
    result = loaded["changed"]
    assert result["loaded"] and result["problems"] == [f"exp_avg/{CHANGED}: differs from the truth"], result


@pytest.mark.engine
def test_buffers_keyed_for_bf16_reduction_do_not_load_in_a_run_reducing_in_fp32(loaded):
    """What every bf16 conversion wrote before the grad buffers' dtypes were derived: Megatron's KeyError."""
    result = loaded["bf16 grads"]
    assert not result["loaded"] and "KeyError" in result["error"], result["error"]
    assert "dtype_(torch.bfloat16, torch.float32).bucket_idx_0.param" in result["error"], result["error"]


@pytest.mark.engine
@pytest.mark.parametrize("name, to", WEIGHTS_ONLY, ids=[f"{n.removeprefix('mcore_mlm_')}-{t}" for n, t in WEIGHTS_ONLY])
def test_megatron_loads_the_model_alone_without_its_optimizer(name, to, loaded):
    result = loaded[f"{name}:{to}"]
    assert result["loaded"] and result["error"] is None and result["problems"] == [], result
    # a fresh optimizer takes its first step (the fixture's schedule warms up from lr 0: nothing moves yet)
    assert result["step_after"] == [1.0] and result["losses"] and all(math.isfinite(x) for x in result["losses"])


@pytest.mark.engine
def test_the_model_alone_is_not_a_full_checkpoint_to_megatron(loaded):
    result = loaded["weights only, optimizer asked"]
    assert not result["loaded"] and "optimizer" in result["error"], result["error"]


THINNED = "mcore_mlm_bf16_dp_reshardable_tp2"


def thinned_run(root):
    """A Megatron-LM save dir of THINNED's iteration three times (1, 2, 3; the tracker naming 3), saved an hour
    ago, its iter_0000001 thinned by `reshard thin --yes`."""
    import time
    save = root / "save"
    for iteration in (1, 2, 3):
        shutil.copytree(ROOT / THINNED / "save" / "iter_0000003", save / f"iter_{iteration:07d}")
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    hour_ago = time.time() - 3600
    for path in save.rglob("*"):
        os.utime(path, (hour_ago, hour_ago))
    reshard.thin(str(save / "iter_0000001"), yes=True)
    return save


def change_module_element(folder, name: str, fix_crc: bool) -> None:
    """One bf16 element of `name`'s weights flipped in place (its zip member's CRC-32 made to match, or left)."""
    from reshard.core.catalog import TensorKey
    fragment = reshard.open_checkpoint(str(folder)).tensors[TensorKey(name, "module")].fragments[0]
    at = fragment.storage.offset + fragment.elem_offset * 2
    data = bytearray(open(fragment.storage.file, "rb").read())
    if fix_crc:
        from reshard.formats.dcp import metadata as dcp_metadata
        from reshard.formats.megatron.pickles import METADATA_ALLOWED
        from tests.helpers.damage import write_in_zip
        meta = dcp_metadata.read(os.path.join(folder, ".metadata"), METADATA_ALLOWED)
        start, length = next((i.offset, i.length) for i in meta.storage_data.values()
                             if i.relative_path == os.path.basename(fragment.storage.file)
                             and i.offset <= at < i.offset + i.length)
        item = folder.parent / "item.zip"
        item.write_bytes(bytes(data[start:start + length]))
        write_in_zip(item, at - start, bytes(b ^ 0x40 for b in data[at:at + 2]))
        data[start:start + length] = item.read_bytes()
        item.unlink()
    else:
        data[at:at + 2] = bytes(b ^ 0x40 for b in data[at:at + 2])
    open(fragment.storage.file, "wb").write(bytes(data))


@pytest.mark.engine
def test_megatron_loads_a_thinned_iteration_without_its_optimizer(loaded):
    result = loaded["thinned"]
    assert result["loaded"] and result["error"] is None and result["problems"] == [], result
    changed = loaded["thinned, changed"]
    assert changed["loaded"] and changed["problems"] == [f"module/{CHANGED}: differs from the truth"], changed


def test_reshard_thin_of_a_megatron_iteration_keeps_the_model_alone(tmp_path):
    """`reshard thin` of an iteration folder: the model's torch_dist written alone beside it, proven, swapped in;
    `list` calls it complete and weights-only, its export is the full one's bit for bit, `convert` to a target that
    needs optimizer state is refused in one line; one flipped byte of it is caught by `validate --deep`."""
    save = thinned_run(tmp_path / "run")
    rows = {r["name"]: r for r in json.loads(run_cli("list", save, "--json").stdout)["checkpoints"]}
    assert rows["iter_0000001"]["status"] == "complete" and rows["iter_0000001"]["weights_only"]
    assert rows["iter_0000001"]["bytes"] < rows["iter_0000002"]["bytes"] / 5
    assert rows["iter_0000001"]["mtime"] == rows["iter_0000002"]["mtime"]       # the save's time kept
    assert "weights-only (thinned from a full megatron checkpoint" in run_cli("inspect", save / "iter_0000001").stdout
    assert reshard.validate(str(save / "iter_0000001"), deep=True).ok
    run_cli("export", save / "iter_0000002", tmp_path / "full.safetensors", check=0)
    run_cli("export", save / "iter_0000001", tmp_path / "thin.safetensors", check=0)
    assert (tmp_path / "full.safetensors").read_bytes() == (tmp_path / "thin.safetensors").read_bytes()
    refused = run_cli("convert", save / "iter_0000001", tmp_path / "out", "--to", "dp=2,tp=1,vocab=100,"
                      "sharding=dp_reshardable", check=1)
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    flipped = shutil.copytree(save / "iter_0000001", tmp_path / "flipped" / "iter_0000001")
    change_module_element(flipped, CHANGED, fix_crc=False)
    assert not reshard.validate(str(flipped), deep=True).ok


# -- what reshard itself writes and refuses (no engine)

@pytest.mark.parametrize("name, to", CONVERSIONS[:3] + CONVERSIONS[5:7])
def test_the_sharding_grad_buffers_and_padded_vocabulary_are_the_target_runs(name, to, tmp_path):
    _convert(name, to, tmp_path / "out")
    catalog = reshard.open_checkpoint(str(tmp_path / "out"))
    assert catalog.layout.format_topology.sharding == _sharding(name, to)
    assert catalog.tensors[("embedding.word_embeddings.weight", "exp_avg")].shape == (_rows(to), 16)
    common = torch.load(tmp_path / "out" / "iter_0000003" / "common.pt", weights_only=False)
    assert common["args"].padded_vocab_size == _rows(to)
    assert common["args"].vocab_size == (100 if "vocab=100" in to else None)
    fp32 = _info(name)["model_dtype"] == "float32"
    if _sharding(name, to) == "dp_reshardable":
        assert catalog.notes.grad_buffers == (("torch.float32",) * 2 if fp32 else ("torch.bfloat16", "torch.float32"),)
    assert reshard.validate(str(tmp_path / "out"), deep=True).ok


def test_an_fp32_plain_save_is_complete_and_its_params_are_its_masters(tmp_path):
    """megatron-core's FP32Optimizer saves no optimizer.state.fp32_param: the params are the masters. validate says
    complete, export's masters are the params, and written back as plain it holds no copy either."""
    save = str(ROOT / "mcore_mlm_fp32_plain_tp2" / "save")
    report = reshard.validate(save, deep=True)
    assert report.ok and not report.problems
    info = reshard.inspect(reshard.open_checkpoint(save))
    assert (info.dtype, info.master_dtype) == ("float32", "float32")
    _convert("mcore_mlm_fp32_plain_tp2", "tp=1,pp=1,dp=2,vocab=100", tmp_path / "out")
    keys = run_cli("inspect", tmp_path / "out", "--params").stdout
    assert "fp32_param" not in keys
    assert reshard.diff(save, str(tmp_path / "out")).differences      # (re-padded: 256 -> 128 rows)
    _convert("mcore_mlm_fp32_plain_tp2", "tp=2,pp=1,dp=1", tmp_path / "same")
    assert reshard.diff(save, str(tmp_path / "same")).equal


def test_what_the_target_cannot_take_is_refused_in_one_line(tmp_path):
    # a smaller tp whose padding the saved rows do not tell: the tokenizer's size is asked for
    save = reshard.open_checkpoint(str(ROOT / "mcore_mlm_bf16_dp_reshardable_tp2" / "save"))
    with pytest.raises(ReshardError, match=r"give it, --to \.\.\.,vocab=N") as refused:
        make_plan(save, "tp=1,dp=2")
    assert "\n" not in str(refused.value)
    with pytest.raises(ReshardError, match="does not fit the 256 embedding rows"):
        make_plan(save, "tp=1,dp=2,vocab=300")
    # the source's grad buffers (bf16 params, fp32 gradients) and args saying bf16 reduction disagree
    source = shutil.copytree(ROOT / "mcore_mlm_bf16_dp_reshardable_dp2" / "save", tmp_path / "save")
    common = torch.load(source / "iter_0000003" / "common.pt", weights_only=False)
    common["args"].accumulate_allreduce_grads_in_fp32 = False
    torch.save(common, source / "iter_0000003" / "common.pt")
    refused = run_cli("convert", source, tmp_path / "out", "--to", "tp=2,dp=1")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "args.accumulate_allreduce_grads_in_fp32 = False" in refused.stderr and "disagree" in refused.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="args.vocab_size is 100"):
        common["args"].accumulate_allreduce_grads_in_fp32, common["args"].vocab_size = True, 100
        torch.save(common, source / "iter_0000003" / "common.pt")
        make_plan(reshard.open_checkpoint(str(source)), "tp=2,dp=1,vocab=99")


def test_the_model_alone_reads_as_weights_only_and_converts_only_to_weights(tmp_path):
    """sharding=none: no optimizer key, no scheduler, args.no_save_optim and no_save_rng (Megatron-LM's
    --no-save-optim --no-save-rng); read back every param frozen, complete; a target that needs optimizer state is
    refused in one line, another model-only one is written."""
    name, to = WEIGHTS_ONLY[0]
    _convert(name, to, tmp_path / "model")
    common = torch.load(tmp_path / "model" / "iter_0000003" / "common.pt", weights_only=False)
    assert "optimizer" not in common and "opt_param_scheduler" not in common
    assert common["args"].no_save_optim and common["args"].no_save_rng
    info = reshard.inspect(reshard.open_checkpoint(str(tmp_path / "model")))
    assert info.options["sharding"] == "none" and info.trainable == 0 and info.problems == 0
    assert reshard.validate(str(tmp_path / "model"), deep=True).ok
    with pytest.raises(ReshardError, match="lacks some") as refused:
        make_plan(reshard.open_checkpoint(str(tmp_path / "model")), "tp=1,dp=2,vocab=100,sharding=dp_reshardable")
    assert "\n" not in str(refused.value)
    execute(make_plan(reshard.open_checkpoint(str(tmp_path / "model")), "tp=1,dp=2,vocab=100"), str(tmp_path / "tp1"),
            progress=False)
    assert reshard.open_checkpoint(str(tmp_path / "tp1")).tensors[("output_layer.weight", "module")].shape == (128, 16)
