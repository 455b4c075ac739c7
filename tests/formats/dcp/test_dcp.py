"""PyTorch Distributed Checkpoint (DCP): reshard reads what torch writes and torch reads what reshard writes.

Inputs come from the real library (`dcp.save` in one process, FSDP2 under torchrun) and the real
DeepSpeed fixtures; outputs are proven by the real consumers: `torch.distributed.checkpoint.load`
into FSDP2 models and optimizers at 2 and 3 ranks (tests/scripts/dcp_fsdp2.py), torch's own
`dcp_to_torch_save`, and DeepSpeed's `engine.load_checkpoint` (tests/scripts/dcp_deepspeed_resume.py).
"""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import reshard
from make_hostile import Payload
from reshard.errors import ReshardError
from tests.helpers.cli import run_cli
from tests.helpers.damage import edit_dcp_metadata, mutated, set_element
from tests.helpers.engine_state import fsdp2_differences, saved_param_groups
from tests.helpers.fixtures import FIXTURES, fixture_dir, tag_dir, truth_json, truth_tensors
from tests.helpers.moe import MOE_NAMES, mixtral_truth
from tests.helpers.repo import SCRIPTS
from tests.helpers.torchrun import run_torchrun, torchrun

# fp32 ZeRO-1/2/3, bf16 (ZeRO-3, ZeRO-1, BF16_Optimizer), SGD, two param groups with frozen and tied params
# loaded through reshard.dcp_reader.Reader only: ZeRO-3 bf16 dp=4, ZeRO-2 round-robin; and the tensor- and pipeline-
# parallel fixtures, into the model each was trained as (tests/scripts/dcp_fsdp2.py "model")
READ_ONLY = ["z3_bf16_dp4", "z2_fp32_roundrobin_dp4"]
PARALLEL_MODELS = {"autotp2_z1_fp32_dp2": {"model": "llama",
                                           "hf_config": str(FIXTURES / "autotp2_z1_fp32_dp2" / "hf_config")},
                   "pipe2_z1_fp32_dp2": {"model": "pipe"}, "pipe2_tiedhead_z1_fp32_dp2": {"model": "tied_head"}}
# mixture-of-experts saves of DeepSpeed AutoEP (ZeRO-1/2/3, ep 2 and ep 2 x expert-dp 2, fp32 and bf16), written as
# DCP and read through reshard.dcp_reader.Reader under transformers' Mixtral names (mixtral-autoep-fsdp)
MOE_TO_LOAD = ["autoep2_z1_fp32", "autoep2_z2_bf16", "autoep2_z2_fp32_dp2", "autoep2_z3_fp32", "autoep2_z3_fp32_dp2"]
CHANGED = ("model.layers.1.mlp.experts.w3", (2, 5, 7))     # an element of expert 2 changed in a copy of the source
SWAPPED = "model.layers.0.mlp.experts.down_proj"           # its two FSDP2 chunks (experts 0-1, 2-3) swapped
FIXTURES_TO_LOAD = ["z1_fp32_dp2", "z2_fp32_frozen_tied_dp2", "z3_fp32_dp4", "z3_bf16_dp2", "z1_bf16_frozen_tied_dp2",
                    "z3_fp32_frozen_tied_dp2", "bf16opt_z1_dp2", "z2_fp32_sgd_dp2"]


def _dcp_to_torch_save(src, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / f"{os.path.basename(src)}-torch.pt"
    dcp_to_torch_save(str(src), str(out))
    return torch.load(out, weights_only=False)


def _exported(src, out, with_optimizer=True):
    from safetensors.torch import load_file
    # fp32: what the DCP output's model holds, whatever the run's training dtype
    optimizer = ["--with-optimizer"] if with_optimizer else []
    run_cli("export", src, out, *optimizer, "--dtype", "fp32", "--quiet", check=0)
    if not with_optimizer:
        return load_file(str(out / "model.safetensors")), {}, {}
    info = json.loads((out / "optimizer.json").read_text())
    states = {s: load_file(str(out / f)) for s, f in info["states"].items()}
    return load_file(str(out / "model.safetensors")), states, info


def _assert_same_as_export(sd, src, tmp_path, aliases=None):
    """Every tensor of a dcp_to_torch_save state dict bit-equal to reshard's export of `src`."""
    weights, states, info = _exported(src, tmp_path / "export", "optim" in sd)
    aliases = aliases or {}
    assert sorted(sd["model"]) == sorted(set(weights) | set(aliases))
    for name, value in sd["model"].items():
        expected = weights[aliases.get(name, name)]
        # export writes floats as fp32 (its default --dtype); a bf16 frozen param widens exactly
        assert torch.equal(value.to(expected.dtype), expected) and value.shape == expected.shape, name
    if "optim" not in sd:
        return
    compared = 0
    for name, per_param in sd["optim"]["state"].items():
        for state, value in per_param.items():
            if state == "step":
                group = next(g for g in info["param_groups"] if name in g["params"])
                assert float(value) == group["step"], name
            else:
                assert torch.equal(value, states[state][name]), (name, state)
                compared += 1
    assert compared == sum(len(s) for s in states.values())
    hyper = [{k: v for k, v in g.items() if k not in ("step",)} for g in info["param_groups"]]
    assert json.loads(json.dumps(sd["optim"]["param_groups"])) == hyper


# ---------------------------------------------------------------------------------------------
# reading a real dcp.save


def _real_save(out, variant):
    """A real `dcp.save` (one process) of the fixture model and AdamW after two steps, keyed as
    `variant` says: "nested" {"model": ..., "optim": ...} (get_state_dict's defaults), "flat_optim"
    (flatten_optimizer_state_dict=True, two param groups), "no_prefix" (model keys at the top)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from fixture_model import build_model, make_batch, param_groups

    model = build_model(tied=True)
    groups, _ = param_groups(model, two_groups=variant == "flat_optim")
    optim = torch.optim.AdamW(groups, lr=0.01)
    for step in range(2):
        model(make_batch(step, 0)).backward()
        optim.step()
        optim.zero_grad()
    options = StateDictOptions(flatten_optimizer_state_dict=variant == "flat_optim")
    msd, osd = get_state_dict(model, optim, options=options)
    state = {**msd, "optim": osd} if variant == "no_prefix" else {"model": msd, "optim": osd}
    dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out, msd, get_state_dict(model, optim)[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _real_save(tmp_path_factory.mktemp("dcp") / "saved", "nested")


@pytest.mark.parametrize("variant", ["nested", "flat_optim", "no_prefix"])
def test_reads_a_real_dcp_save(variant, tmp_path):
    path, msd, osd = _real_save(tmp_path / variant, variant)
    catalog = reshard.open_checkpoint(path)
    assert catalog.format == "dcp" and catalog.contents().optimizer == "AdamW" and catalog.contents().step == 2
    assert reshard.validate(catalog).ok
    assert list(catalog.order) == list(msd)
    for name, value in msd.items():
        assert torch.equal(reshard.full_tensor(catalog, name, "module"), value), name
    for name, per_param in osd["state"].items():
        assert torch.equal(reshard.full_tensor(catalog, name, "fp32"), msd[name])
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reshard.full_tensor(catalog, name, state), per_param[state]), (name, state)
    assert catalog.scalars_of_groups("a test") == [{"step": reshard.core.catalog.ScalarTensor(2.0, "float32")}] * \
        len(osd["param_groups"])
    assert [{k: v for k, v in g.items()} for g in catalog.param_groups] == osd["param_groups"]
    assert catalog.aliases == {} and catalog.params["head.weight"].kind == "frozen"   # DCP does not say it is tied


def test_param_groups_are_found_without_planner_data(saved, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(saved[0], src)
    edit_dcp_metadata(src, lambda meta: setattr(meta, "planner_data", None))
    assert list(reshard.open_checkpoint(src).param_groups) == list(reshard.open_checkpoint(saved[0]).param_groups) \
        == saved[2]["param_groups"]


def test_unequal_steps_within_a_group_are_read_and_kept_by_dcp_but_not_converted_to_deepspeed(saved, tmp_path):
    """Adam counts steps per param, so a real save can hold unequal ones: complete; DCP keeps a step per param,
    DeepSpeed one per group."""
    src = tmp_path / "src"
    shutil.copytree(saved[0], src)
    _append_value(src, "optim.state.l1.bias.step", _torch_saved(torch.tensor(5.0)))
    assert "complete" in run_cli("validate", src, check=0).stdout
    proc = run_cli("convert", src, tmp_path / "out", "--format", "deepspeed", "--to", "zero=2")
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"reshard: {src / '.metadata'}: param group 0: optimizer step differs between parameters (2 at emb.weight vs "
        "5 at l1.bias); a DeepSpeed checkpoint keeps one per group, so it is not written"), proc.stderr
    assert not (tmp_path / "out").exists()
    run_cli("convert", src, tmp_path / "dcp", "--format", "dcp", "--to", "dp=2", "--quiet", check=0)
    steps = {k: float(v["step"]) for k, v in _dcp_to_torch_save(tmp_path / "dcp", tmp_path)["optim"]["state"].items()}
    assert steps["l1.bias"] == 5.0 and set(steps.values()) == {2.0, 5.0}, steps
    assert {k for k, v in steps.items() if v == 5.0} == {"l1.bias"}
    run_cli("convert", saved[0], tmp_path / "ds", "--format", "deepspeed", "--to", "zero=2", "--quiet",
            check=0)   # negative control: equal steps convert


def test_export_of_a_real_dcp_save_equals_dcp_to_torch_save(saved, tmp_path):
    path, _, _ = saved
    sd = _dcp_to_torch_save(path, tmp_path)
    _assert_same_as_export(sd, path, tmp_path)


# ---------------------------------------------------------------------------------------------
# writing DCP from DeepSpeed fixtures


@pytest.mark.parametrize("name", ["z2_fp32_frozen_tied_dp2", "z3_bf16_dp2", "z1_fp32_dp4", "z2_fp32_sgd_dp2"])
def test_dcp_to_torch_save_of_our_output_equals_our_export(name, tmp_path):
    dst = tmp_path / "dcp"
    run_cli("convert", fixture_dir(name), dst, "--format", "dcp", "--quiet", check=0)
    assert (dst / ".metadata").is_file() and sorted(p.name for p in dst.glob("*.distcp"))
    sd = _dcp_to_torch_save(dst, tmp_path)
    _assert_same_as_export(sd, fixture_dir(name), tmp_path, truth_json(name)["tied"])


def test_our_metadata_is_torchs_metadata_and_reads_back(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
    source = reshard.open_checkpoint(fixture_dir("z3_fp32_frozen_tied_dp2"))
    dst = tmp_path / "dcp3"
    run_cli("convert", fixture_dir("z3_fp32_frozen_tied_dp2"), dst, "--format", "dcp", "--to", "dp=3", "--quiet",
            check=0)
    meta = FileSystemReader(str(dst)).read_metadata()
    assert isinstance(meta, Metadata)
    weight = meta.state_dict_metadata["model.emb.weight"]
    assert isinstance(weight, TensorStorageMetadata) and weight.size == torch.Size([37, 12])
    assert [tuple(c.offsets) for c in weight.chunks] == [(0, 0), (13, 0), (26, 0)]   # FSDP2's dim-0 cut
    assert sorted(p.name for p in dst.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # .metadata, the commit marker, is written after the data files
    assert all(os.stat(dst / ".metadata").st_mtime_ns >= os.stat(p).st_mtime_ns for p in dst.glob("*.distcp"))
    back = reshard.open_checkpoint(dst)
    assert reshard.validate(back).ok and back.layout.dp == 3
    # the tied name points at its holder's bytes, so the tie comes back; frozen params and buffers too
    assert back.aliases == source.aliases == {"head.weight": "emb.weight"}
    assert meta.storage_data[MetadataIndex("model.head.weight", [13, 0])] == \
        meta.storage_data[MetadataIndex("model.emb.weight", [13, 0])]
    assert {n: p.kind for n, p in back.params.items()} == {n: p.kind for n, p in source.params.items()}
    for (name, state), tensor in source.tensors.items():
        assert torch.equal(reshard.full_tensor(back, name, state).to(tensor_dtype(tensor)),
                           reshard.full_tensor(source, name, state)), (name, state)


def tensor_dtype(tensor):
    return getattr(torch, tensor.dtype)


def test_validate_proves_the_chunks_tile_each_tensor(tmp_path):
    """Move one chunk of emb.weight up a row: one row held twice, the last row missing."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    dst = tmp_path / "dcp"
    run_cli("convert", fixture_dir("z2_fp32_dp2"), dst, "--format", "dcp", "--to", "dp=2", "--quiet", check=0)

    def shift(meta):
        chunk = meta.state_dict_metadata["model.emb.weight"].chunks[1]
        info = meta.storage_data.pop(MetadataIndex("model.emb.weight", chunk.offsets))
        chunk.offsets = torch.Size([chunk.offsets[0] - 1, 0])
        meta.storage_data[MetadataIndex("model.emb.weight", chunk.offsets, 1)] = info
    edit_dcp_metadata(dst, shift)
    proc = run_cli("validate", dst)
    assert proc.returncode == 1, proc.stdout
    for state in ("module", "fp32"):      # the fp32 master is the same bytes as the module entry
        assert f"emb.weight ({state}, 444 elements): 12 elements missing, at [432, 444)" in proc.stdout
        assert f"emb.weight ({state}, 444 elements): 12 elements held more than once, at [216, 228)" in proc.stdout


# ---------------------------------------------------------------------------------------------
# hostile and broken DCP directories


def _first_info(meta):
    return next(iter(meta.storage_data.values()))


def _append_value(path, key, blob):
    """Point `key`'s storage location at `blob`, appended to __0_0.distcp."""
    distcp = path / "__0_0.distcp"
    offset = os.path.getsize(distcp)
    with open(distcp, "ab") as f:
        f.write(blob)

    def edit(meta):
        info = next(i for index, i in meta.storage_data.items() if index.fqn == key)
        info.relative_path, info.offset, info.length = "__0_0.distcp", offset, len(blob)
    edit_dcp_metadata(path, edit)


def _torch_saved(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _hostile_cases(canary):
    return {
        "value_os_system": ("__0_0.distcp", "system", lambda p: _append_value(
            p, "optim.param_groups.0.lr", _torch_saved(Payload(os.system, f"touch {canary}")))),
        "chunk_os_system": ("__0_0.distcp", "system", lambda p: _append_value(
            p, "model.l1.bias", _torch_saved({"x": Payload(os.system, f"touch {canary}")}))),
        "metadata_os_system": (".metadata", "system", lambda p: edit_dcp_metadata(
            p, lambda m: m.planner_data.update(evil=Payload(os.system, f"touch {canary}")))),
        "chunk_outside_file": ("__0_0.distcp", "wrong offsets", lambda p: edit_dcp_metadata(
            p, lambda m: setattr(_first_info(m), "offset", 10**9))),
        "path_escapes": (".metadata", "escapes", lambda p: edit_dcp_metadata(
            p, lambda m: setattr(_first_info(m), "relative_path", "../x"))),
        "truncated_distcp": ("__0_0.distcp", "truncated", lambda p: os.truncate(
            p / "__0_0.distcp", os.path.getsize(p / "__0_0.distcp") // 2)),
        "missing_distcp": ("__0_0.distcp", "missing", lambda p: os.remove(p / "__0_0.distcp")),
        "garbage_metadata": (".metadata", "not a DCP metadata",
                             lambda p: (p / ".metadata").write_bytes(os.urandom(3000))),
        "empty_metadata": (".metadata", "empty", lambda p: (p / ".metadata").write_bytes(b"")),
        "no_metadata": (".metadata", "missing", lambda p: os.remove(p / ".metadata")),
    }


HOSTILE = ["metadata_os_system", "value_os_system", "chunk_os_system", "chunk_outside_file", "path_escapes",
           "truncated_distcp", "missing_distcp",
           "garbage_metadata", "empty_metadata", "no_metadata"]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_dcp_is_refused_by_every_command(saved, case, tmp_path):
    canary = tmp_path / "canary"
    victim, needle, edit = _hostile_cases(canary)[case]
    src = tmp_path / "src"
    shutil.copytree(saved[0], src)
    edit(src)
    before = {p: p.read_bytes() for p in src.iterdir()}
    victim = str(src / victim)
    for command in (["inspect", src], ["validate", src], ["export", src, tmp_path / "out-export", "--quiet"],
                    ["convert", src, tmp_path / "out-convert", "--format", "dcp", "--quiet"]):
        proc = run_cli(*command)
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        if command[0] == "validate":
            lines = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if victim in line]
        else:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert len(lines) == 1, (command, proc.stderr)
        assert any(victim in line and needle in line for line in lines), (command, proc.stdout, proc.stderr)
        assert not canary.exists()
        assert not (tmp_path / "out-export").exists() and not (tmp_path / "out-convert").exists()
        assert {p: p.read_bytes() for p in src.iterdir()} == before


# ---------------------------------------------------------------------------------------------
# the real clients under torchrun


def _load_jobs(converted, out, world):
    return [{**_model_job(name), "dcp": str(dst), "out": str(out / f"{name}-loaded-{world}.pt")}
            for name, dst in converted.items()]


def _model_job(name):
    """How tests/scripts/dcp_fsdp2.py builds the model and optimizer of a fixture-model fixture."""
    truth = truth_json(name)
    return {"tied": bool(truth["tied"]), "frozen": bool(truth["frozen"]), "two_groups": len(truth["param_groups"]) == 2,
            "optimizer": truth["optimizer_class"],
            "hyper": [{k: v for k, v in g.items() if k != "param_names"} for g in truth["param_groups"]]}


def _compare_with_truth(name, loaded):
    """The gathered FSDP2 state equals what DeepSpeed reported when it saved the fixture."""
    truth, meta = truth_tensors(name), truth_json(name)
    model, optim = loaded["model"], loaded["optim"]
    trainable = [n for g in meta["param_groups"] for n in g["param_names"]]
    checked = 0
    for key, expected in truth.items():
        state, param = key.split("/", 1)
        if state == "fp32":
            got = model[param]
        elif state == "module":
            if param in trainable or param in meta["tied"]:
                continue                    # the 16-bit copy of a trainable weight: FSDP2 holds the master
            got = model[param]
            expected = expected.to(got.dtype)   # a bf16 frozen param in the fp32 model
        else:
            got = optim["state"][param][state]
        assert got.shape == expected.shape and torch.equal(got, expected), key
        checked += 1
    for alias, holder in meta["tied"].items():
        assert torch.equal(model[alias], truth[f"fp32/{holder}"]), alias
    assert checked == len([k for k in truth if not (k.startswith("module/") and
                                                   (k[7:] in trainable or k[7:] in meta["tied"]))])
    steps = {float(s["step"]) for s in optim["state"].values() if "step" in s}
    assert steps == ({float(meta["step"])} if meta["optimizer_class"] != "SGD" else set())
    groups = json.loads(json.dumps(optim["param_groups"]))
    for group, saved in zip(groups, meta["param_groups"], strict=True):
        assert group.pop("params") == saved["param_names"]
        assert group == {k: v for k, v in saved.items() if k != "param_names"}


@pytest.fixture(scope="module")
def fixtures_as_dcp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixtures-dcp")
    converted = {}
    for name in FIXTURES_TO_LOAD:
        converted[name] = out / name
        run_cli("convert", fixture_dir(name), converted[name], "--format", "dcp", "--quiet", check=0)
    return converted, out


def _moe_jobs(out):
    """The 2-rank launch's MoE jobs ({name: job}): each MoE fixture converted to DCP under Mixtral's names and read
    through reshard.dcp_reader.Reader; and two negative controls: a source with one expert element changed,
    converted, and an output whose expert chunks of one tensor are swapped in its .metadata."""
    jobs = {}
    for name in MOE_TO_LOAD:
        dst = out / f"moe-{name}"
        reshard.convert(fixture_dir(name), dst, "dp=2", fmt="dcp", names=MOE_NAMES)
        jobs[name] = {"model": "mixtral", "optimizer": "AdamW", "dcp": str(dst), "out": str(out / f"moe-{name}.pt"),
                      "source": str(fixture_dir(name)), "reader_out": str(out / f"moe-{name}-read.pt"),
                      "names": MOE_NAMES}
    changed = out / "moe-changed-source"
    shutil.copytree(fixture_dir("autoep2_z3_fp32"), changed)
    param, at = CHANGED
    tensor = reshard.open_checkpoint(changed).tensor(param, "fp32")
    set_element(reshard.open_checkpoint(changed), param, "fp32", int(np.ravel_multi_index(at, tensor.shape)),
                lambda x: x + 0.5)
    reshard.convert(changed, out / "moe-changed", "dp=2", fmt="dcp", names=MOE_NAMES)
    swapped = out / "moe-swapped"
    shutil.copytree(out / "moe-autoep2_z3_fp32", swapped)

    def swap(meta):
        first, second = [index for index in meta.storage_data if index.fqn == f"model.{SWAPPED}"]
        meta.storage_data[first], meta.storage_data[second] = meta.storage_data[second], meta.storage_data[first]
    edit_dcp_metadata(swapped, swap)
    for control in ("changed", "swapped"):
        jobs[control] = {"model": "mixtral", "optimizer": "AdamW", "dcp": str(out / f"moe-{control}"),
                         "out": str(out / f"moe-{control}.pt")}
    return jobs


@pytest.fixture(scope="module")
def fsdp2_loaded(fixtures_as_dcp, fsdp2_save):
    """At 2 and 3 ranks, one launch each: every fixture converted to DCP, and the sources read through
    reshard.dcp_reader.Reader ({world: (those jobs, {name: job of a source read only})}); at 2 also the FSDP2
    save converted to DCP at dp=2 (its folder and its job), and the MoE jobs (_moe_jobs)."""
    converted, out = fixtures_as_dcp
    moe = _moe_jobs(out)
    fsdp2_ckpt, _ = fsdp2_save
    dcp2 = out / "fsdp2-dcp2"
    run_cli("convert", fsdp2_ckpt, dcp2, "--format", "dcp", "--to", "dp=2", "--quiet", check=0)
    dcp2_job = {"dcp": str(dcp2), "out": str(out / "fsdp2-dcp2-loaded.pt"), "optimizer": "Adam",
                "hyper": [{"betas": [0.9, 0.999]}]}
    loaded = {}
    for world in (2, 3):
        jobs = _load_jobs(converted, out, world)
        for name, job in zip(converted, jobs, strict=True):
            job.update(source=str(fixture_dir(name)), reader_out=str(out / f"{name}-read-{world}.pt"))
        jobs.append({"source": str(fsdp2_ckpt), "reader_out": str(out / f"fsdp2-read-{world}.pt"), "optimizer": "Adam"})
        more = {name: {**(_model_job(name) if name in READ_ONLY else
                          {**PARALLEL_MODELS[name], "optimizer": truth_json(name)["optimizer_class"]}),
                       "source": str(fixture_dir(name)), "reader_out": str(out / f"{name}-read-{world}.pt")}
                for name in [*READ_ONLY, *PARALLEL_MODELS]}
        (out / f"jobs-{world}.json").write_text(json.dumps(jobs + list(more.values()) +
                                                           ([dcp2_job, *moe.values()] if world == 2 else [])))
        torchrun(world, SCRIPTS / "dcp_fsdp2.py", "load", out / f"jobs-{world}.json", deepspeed=False)
        loaded[world] = jobs, more
    return loaded, dcp2, dcp2_job, moe


@pytest.mark.engine
def test_moe_saves_load_into_an_fsdp2_mixtral_with_dcp_load(fsdp2_loaded):
    """Issue #29: each AutoEP save (ZeRO-1/2/3, ep 2 and ep 2 x expert-dp 2, fp32 and bf16) converted with --format dcp
    --names mixtral-autoep-fsdp, and read straight through reshard.dcp_reader.Reader, loads with dcp.load into an
    FSDP2-wrapped transformers MixtralForCausalLM at 2 ranks: every param (fp32), both Adam moments and the step equal
    the engine's, every expert in its global place; the Reader's model then trains a step. Negative controls: one
    expert element changed in the source is found in that tensor at that place only; an output whose expert chunks
    are swapped loads the experts at the wrong index, and is caught."""
    moe = fsdp2_loaded[3]
    names = set()
    for name in MOE_TO_LOAD:
        truth, step = mixtral_truth(name), truth_json(name)["step"]
        for kind in ("out", "reader_out"):
            loaded = torch.load(moe[name][kind], weights_only=False)
            problems, compared = fsdp2_differences(loaded, truth, step)
            assert problems == [] and compared == len(truth), (name, kind, problems[:5])
            assert [g["lr"] for g in loaded["optim"]["param_groups"]] == [0.01, 0.01]      # not the job's 123
            names = set(loaded["model"])
        assert math.isfinite(torch.load(moe[name]["reader_out"], weights_only=False)["next_loss"]), name
    assert {n for n in names if ".mlp." in n} == {f"model.layers.{i}.mlp.{p}" for i in range(2)
                                                  for p in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")}
    truth = mixtral_truth("autoep2_z3_fp32")
    changed = torch.load(moe["changed"]["out"], weights_only=False)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert fsdp2_differences(changed, truth, 3)[0] == [f"fp32/{fused}: differs"]
    expert, row, col = CHANGED[1]
    diff = (changed["model"][fused] - truth[f"fp32/{fused}"]).nonzero().tolist()
    assert diff == [[expert, 32 + row, col]]          # w3's row r of expert e: row I + r of gate_up_proj
    swapped = torch.load(moe["swapped"]["out"], weights_only=False)
    assert fsdp2_differences(swapped, truth, 3)[0] == [f"fp32/{SWAPPED}: differs"]
    assert torch.equal(swapped["model"][SWAPPED], truth[f"fp32/{SWAPPED}"][[2, 3, 0, 1]])


@pytest.mark.engine
@pytest.mark.parametrize("world", [2, 3])
def test_deepspeed_fixtures_load_into_fsdp2_with_dcp_load(fixtures_as_dcp, fsdp2_save, fsdp2_loaded, world):
    """Each fixture converted to DCP loads with dcp.load; and (issue #15) straight from its DeepSpeed files
    through reshard.dcp_reader.Reader, as do the real FSDP2 save made at 4 ranks, ZeRO-3 bf16 dp=4, ZeRO-2
    round-robin, the AutoTP tp2 x dp2 Llama and both pipelines, each into its own model; then each trains a
    step. Hyper-parameters are those torch.load finds in the source's optimizer file."""
    converted, _ = fixtures_as_dcp
    _, fsdp2_truth = fsdp2_save
    jobs, more = fsdp2_loaded[0][world]
    for name, job in more.items():
        read = torch.load(job["reader_out"], weights_only=False)
        problems, compared = fsdp2_differences(read, truth_tensors(name), truth_json(name)["global_steps"])
        assert problems == [] and compared > 0, (name, problems[:5])
        assert math.isfinite(read["next_loss"]), name
        saved = saved_param_groups(next(tag_dir(fixture_dir(name)).glob("*optim_states.pt")))
        assert [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in read["optim"]["param_groups"]] == \
               [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in saved], name
    # the comparison sees another run's state (the same model and optimizer, trained in fp32)
    other = torch.load(more["z3_bf16_dp4"]["reader_out"], weights_only=False)
    assert fsdp2_differences(other, truth_tensors("z3_fp32_dp4"), truth_json("z3_fp32_dp4")["global_steps"])[0]
    for name, job in zip(converted, jobs[:-1], strict=True):     # jobs[-1]: the FSDP2 save's own, below
        _compare_with_truth(name, torch.load(job["out"], weights_only=False))
        read = torch.load(job["reader_out"], weights_only=False)
        _compare_with_truth(name, read)
        assert math.isfinite(read["next_loss"])
    read = torch.load(jobs[-1]["reader_out"], weights_only=False)
    _assert_same_state(read, fsdp2_truth)
    # the comparisons see another run's state (same model and optimizer, trained at dp=4)
    with pytest.raises(AssertionError):
        _compare_with_truth("z1_fp32_dp4", torch.load(jobs[0]["out"], weights_only=False))
    with pytest.raises(AssertionError):
        _compare_with_truth("z1_fp32_dp4", torch.load(jobs[0]["reader_out"], weights_only=False))
    with pytest.raises(AssertionError):
        _assert_same_state(torch.load(jobs[0]["reader_out"], weights_only=False), fsdp2_truth)


def _assert_same_state(loaded, truth):
    """Two gathered FSDP2 states (tests/scripts/dcp_fsdp2.py) hold the same params, buffers and optimizer state."""
    assert loaded["model"].keys() == truth["model"].keys()
    for key, value in truth["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    assert loaded["optim"]["state"].keys() == truth["optim"]["state"].keys()
    for fqn, states in truth["optim"]["state"].items():
        for state, value in states.items():
            assert torch.equal(torch.as_tensor(loaded["optim"]["state"][fqn][state]), torch.as_tensor(value)), \
                (fqn, state)
    assert [g["lr"] for g in loaded["optim"]["param_groups"]] == [g["lr"] for g in truth["optim"]["param_groups"]]


@pytest.fixture(scope="module")
def fsdp2_save(tmp_path_factory):
    """A DCP checkpoint saved by real FSDP2 code at 4 ranks after 3 Adam steps, and its gathered state (with,
    under "mesh_2d", a 2-D mesh model loaded from a fixture through reshard.dcp_reader.Reader)."""
    out = tmp_path_factory.mktemp("fsdp2")
    torchrun(4, SCRIPTS / "dcp_fsdp2.py", "train", out / "ckpt", out / "truth.pt", fixture_dir("z1_fp32_dp2"),
             deepspeed=False)
    return out / "ckpt", torch.load(out / "truth.pt", weights_only=False)


@pytest.mark.engine
def test_a_2d_mesh_model_loads_a_deepspeed_checkpoint_through_the_reader(fsdp2_save):
    """(issue #15) The fixture model with l1 column- and l2 row-sharded over tp and everything sharded over dp
    on a 2x2 mesh (tests/scripts/dcp_fsdp2.py load_2d) loads the ZeRO-1 dp=2 fixture straight from its files."""
    loaded = fsdp2_save[1]["mesh_2d"]
    assert loaded["placements"]["l2.weight"] == "(Shard(dim=0), Shard(dim=1))"    # dp rows x tp columns
    assert "Shard(dim=0))" in loaded["placements"]["l1.weight"]                   # tp rows inside dp's
    _compare_with_truth("z1_fp32_dp2", loaded)
    with pytest.raises(AssertionError):
        _compare_with_truth("z1_fp32_dp4", loaded)


@pytest.mark.engine
def test_reshard_reads_an_fsdp2_save(fsdp2_save, tmp_path):
    ckpt, truth = fsdp2_save
    proc = run_cli("inspect", ckpt, check=0)
    assert "dcp" in proc.stdout and "dp=4" in proc.stdout and "Adam: states exp_avg, exp_avg_sq" in proc.stdout
    assert "complete" in run_cli("validate", ckpt, check=0).stdout
    sd = _dcp_to_torch_save(ckpt, tmp_path)
    _assert_same_as_export(sd, ckpt, tmp_path)
    catalog = reshard.open_checkpoint(ckpt)
    for name, value in truth["model"].items():
        assert torch.equal(reshard.full_tensor(catalog, name, "module"), value), name
    for victim, damage in (("__2_0.distcp", lambda p: os.truncate(p, os.path.getsize(p) - 100)),
                           ("__3_0.distcp", os.remove)):
        broken = tmp_path / f"broken-{victim}"
        shutil.copytree(ckpt, broken)
        damage(broken / victim)
        proc = run_cli("validate", broken)
        assert proc.returncode == 1 and str(broken / victim) in proc.stdout, proc.stdout + proc.stderr
        assert "NOT complete" in proc.stdout


@pytest.mark.engine
def test_reshard_reads_column_and_grid_boxes(fsdp2_save, tmp_path):
    ckpt, truth = fsdp2_save
    boxes = ckpt.parent / (ckpt.name + "-boxes")
    catalog = reshard.open_checkpoint(boxes)
    assert reshard.validate(catalog).ok
    cols = catalog.tensors[("cols", "module")].fragments
    assert len(cols) == 4 and {f.shard.blocks[0].shape for f in cols} == {(5, 3)}   # one per column shard
    for name, value in truth["boxes"].items():
        assert torch.equal(reshard.full_tensor(catalog, name, "module"), value), name
    sd = _dcp_to_torch_save(boxes, tmp_path)
    _assert_same_as_export(sd, boxes, tmp_path)


@pytest.mark.engine
def test_an_fsdp2_save_converted_to_dcp_loads_at_2_ranks(fsdp2_save, fsdp2_loaded):
    """(loaded in the 2-rank launch of the fixtures' loads)"""
    _, truth = fsdp2_save
    _, dst, job, _ = fsdp2_loaded
    assert sorted(p.name for p in dst.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    loaded = torch.load(job["out"], weights_only=False)
    assert sorted(loaded["model"]) == sorted(truth["model"])
    for name, value in truth["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    for name, per_param in truth["optim"]["state"].items():
        for state, value in per_param.items():
            assert torch.equal(loaded["optim"]["state"][name][state], value), (name, state)
    assert loaded["optim"]["param_groups"] == truth["optim"]["param_groups"]


def _nudged(truth_path, out, param, state, element):
    """The FSDP2 truth with one element of one Adam state nudged by one ulp: a control the check must tell apart."""
    truth = torch.load(truth_path, weights_only=False)
    moment = truth["optim"]["state"][param][state]
    moment.view(-1)[element] = torch.nextafter(moment.view(-1)[element], torch.tensor(1.0))
    torch.save(truth, out)
    return out


@pytest.fixture(scope="module")
def deepspeed_resumed(fsdp2_save, tmp_path_factory):
    """{stage: the FSDP2 save converted to DeepSpeed ZeRO-stage files at 2 ranks, resumed by the engine;
    "reshard": the save itself loaded into a ZeRO-3 engine through reshard}: one launch."""
    ckpt, _ = fsdp2_save
    out, truth = tmp_path_factory.mktemp("dcp-deepspeed"), str(ckpt.parent / "truth.pt")
    jobs, control = {}, str(_nudged(truth, out / "control.pt", "l1.weight", "exp_avg", 5))
    for stage in (1, 2, 3):
        dst = out / f"ds-zero{stage}"
        run_cli("convert", ckpt, dst, "--to", f"dp=2,zero={stage}", "--format", "deepspeed", "--quiet", check=0)
        jobs[stage] = {"checkpoint": str(dst), "stage": stage, "truth": truth, "control": control}
    jobs["reshard"] = {"checkpoint": str(ckpt), "stage": 3, "truth": truth, "loader": "reshard",
                       "control": str(_nudged(truth, out / "control-reshard.pt", "l2.weight", "exp_avg_sq", 3))}
    return dict(zip(jobs, run_torchrun("dcp_deepspeed_resume.py", 2, list(jobs.values()), out, "resume"), strict=True))


@pytest.mark.engine
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_fsdp2_save_converted_to_deepspeed_resumes_in_the_engine(deepspeed_resumed, stage):
    outcome = deepspeed_resumed[stage]
    assert outcome["compared"] == 24 and outcome["problems"] == [], outcome
    assert outcome["control_problems"] == ["exp_avg/l1.weight: differs from the FSDP2 run"], outcome
    # DCP counts no samples: without the key the engine counts them from its steps, not from a written 0
    assert outcome["global_steps"] == 3 and outcome["global_samples"] == 3 * outcome["train_batch_size"] > 0, outcome


@pytest.mark.engine
def test_an_fsdp2_save_loads_into_a_live_deepspeed_engine_through_reshard(deepspeed_resumed):
    """(issue #15) The same FSDP2 save, with no conversion step: reshard.deepspeed_engine.load_checkpoint in a ZeRO-3
    engine at 2 ranks gives the engine the FSDP2 run's state, told apart from the nudged control."""
    outcome = deepspeed_resumed["reshard"]
    assert outcome["compared"] == 24 and outcome["problems"] == [], outcome
    assert outcome["control_problems"] == ["exp_avg_sq/l2.weight: differs from the FSDP2 run"], outcome
    assert outcome["global_steps"] == 3, outcome


@settings(max_examples=int(os.environ.get("RESHARD_FUZZ_EXAMPLES", 150)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_dcp_files_only_ever_give_a_checkpoint_error(saved, data, tmp_path_factory):
    """Mutated real `.metadata` and `.distcp` bytes: reading returns or raises ReshardError, nothing else."""
    name = data.draw(st.sampled_from([".metadata", "__0_0.distcp"]))
    blob = mutated(data, (saved[0] / name).read_bytes())
    src = tmp_path_factory.mktemp("fuzz")
    for other in os.listdir(saved[0]):
        (src / other).write_bytes(bytes(blob) if other == name else (saved[0] / other).read_bytes())
    try:
        reshard.validate(reshard.open_checkpoint(src), deep=True)
    except ReshardError:
        pass


def test_what_a_dcp_save_does_not_say_stays_unknown_in_deepspeed(saved, tmp_path):
    """torch's dcp.save holds no sample count: the DeepSpeed output leaves it out (the engine then counts
    global_steps x train_batch_size) and inspect says unknown, not 0."""
    ds = tmp_path / "ds"
    run_cli("convert", saved[0], ds, "--format", "deepspeed", "--to", "zero=2", "--quiet", check=0)
    for path in (saved[0], ds):
        info = json.loads(run_cli("inspect", path, "--json", check=0).stdout)
        assert (info["optimizer"], info["global_steps"], info["global_samples"]) == ("AdamW", 2, None), path
        assert "(global_steps 2, global_samples unknown)" in run_cli("inspect", path, check=0).stdout


def test_the_counters_reshard_carries_in_a_dcp_save_load_with_dcp_load(tmp_path):
    """The source's optimizer name and counters ride in the DCP save under `reshard.`, which torch loads like
    any saved value and which a load of {"model", "optim"} alone ignores."""
    import torch.distributed.checkpoint as dcp
    name = "z2_fp32_dp2"
    out = tmp_path / "dcp"
    run_cli("convert", fixture_dir(name), out, "--format", "dcp", "--quiet", check=0)
    carried = {"optimizer": None, "global_steps": None, "global_samples": None, "skipped_steps": None}
    dcp.load({"reshard": carried}, checkpoint_id=str(out), no_dist=True)
    meta = truth_json(name)
    assert carried == {"optimizer": meta["optimizer_class"], "global_steps": meta["global_steps"],
                       "global_samples": meta["global_samples"], "skipped_steps": meta["skipped_steps"]}
