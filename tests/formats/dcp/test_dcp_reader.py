"""reshard.dcp_reader.Reader: torch's own `dcp.load` reads DeepSpeed checkpoints (ZeRO-1/2/3, BF16_Optimizer,
round-robin, sub-groups, tied and frozen params, AutoTP, Megatron TP, pipelines) with no conversion step.

Every value is compared bit for bit with the engine's truth saved beside each fixture. The model-side
tests go through `get_state_dict` / `set_state_dict`, the way a training script resumes, and then train
one more step.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import reshard
import reshard.dcp_reader
from fixture_model import build_model
from reshard.errors import ReshardError
from tests.helpers.damage import write_in_zip
from tests.helpers.dcp_resume import assert_resumed_as_truth, resume_fixture_model
from tests.helpers.fixtures import ALL_FIXTURES, FIXTURES, copy_fixture, fixture_dir, tag_dir, truth_json, truth_tensors
from tests.helpers.repo import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
RULES = {name: str(REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json")
         for name in ALL_FIXTURES if "megatron" in name}
# Elastic ZeRO-2 files hold no optimizer hyper-parameters (DeepSpeed takes them from the config).
ELASTIC = "z2_fp32_elastic_dp2"


def _reader(name, path=None):
    return reshard.dcp_reader.Reader(path or fixture_dir(name), layout_rules=RULES.get(name))


def _served_truth(name):
    """{DCP key: truth tensor} for everything the engine recorded: fp32 masters (or 16-bit weights of
    frozen params and buffers), both Adam moments."""
    truth, out = truth_tensors(name), {}
    tied = reshard.open_checkpoint(fixture_dir(name), layout_rules=RULES.get(name)).aliases
    for key, value in truth.items():
        kind, _, param = key.partition("/")
        if kind == "fp32":
            out[f"model.{param}"] = value
        elif kind == "module" and f"fp32/{param}" not in truth:     # frozen, a buffer, or a tied name
            out[f"model.{param}"] = truth.get(f"fp32/{tied[param]}", value) if param in tied else value
        elif kind in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{param}.{kind}"] = value
    return out


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_dcp_load_gives_the_engine_truth(name):
    """dcp.load into tensors of the metadata's shapes, filled with NaN: every recorded value arrives exact,
    every step is the engine's."""
    metadata = _reader(name).read_metadata()
    flat = {key: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype)
            if m.properties.dtype.is_floating_point
            else torch.zeros(tuple(m.size), dtype=m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(flat, storage_reader=_reader(name))
    truth = _served_truth(name)
    assert truth.keys() <= flat.keys(), sorted(truth.keys() - flat.keys())[:5]
    for key, value in truth.items():
        assert flat[key].dtype == value.dtype and torch.equal(flat[key], value), key
    steps = [v for k, v in flat.items() if k.endswith(".step")]
    counts_steps = "Adam" in truth_json(name).get("optimizer_class", "Adam")    # SGD keeps no step
    assert bool(steps) == counts_steps and all(float(s) == truth_json(name)["global_steps"] for s in steps)


@pytest.mark.parametrize("name", ["z3_bf16_dp4", "autotp2_z1_fp32_dp2", "pipe2_z1_fp32_dp2"])
def test_a_dcp_to_torch_save_style_load_gives_the_truth(name):
    """What torch's dcp_to_torch_save does (an empty state dict filled from the metadata, one process, no
    process group), with the Reader: every recorded value, nested as get_state_dict nests them."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state = {}
    _load_state_dict(state, storage_reader=_reader(name), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    for key, value in _served_truth(name).items():
        where, _, rest = key.partition(".")
        if where == "model":
            got = state["model"][rest]
        else:
            param, _, moment = rest.removeprefix("state.").rpartition(".")
            got = state["optim"]["state"][param][moment]
        assert got.dtype == value.dtype and torch.equal(got, value), key
    assert {float(s["step"]) for s in state["optim"]["state"].values()} == {truth_json(name)["global_steps"]}


FIXTURE_MODEL = ["z3_bf16_dp4", "z2_fp32_roundrobin_dp4", "z1_bf16_frozen_tied_dp2", "z3_fp32_subgroup_dp2",
                 "bf16opt_z1_dp2", "z2_fp16_dp2", "z2_fp32_sgd_dp2"]


@pytest.mark.parametrize("name", FIXTURE_MODEL)
def test_a_training_script_resumes_through_get_state_dict(name):
    assert_resumed_as_truth(name, *resume_fixture_model(name, _reader(name)))


def test_a_bf16_model_gets_its_master_rounded_as_torch_rounds():
    model, _ = resume_fixture_model("z3_fp32_dp2", _reader("z3_fp32_dp2"), torch.bfloat16)
    truth = truth_tensors("z3_fp32_dp2")
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), truth[f"fp32/{n}"].to(torch.bfloat16)), n


def test_autotp_checkpoint_into_a_hugging_face_model():
    """The AutoTP tp=2 save loads into the unsharded LlamaForCausalLM, whose forward then matches the
    engine's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    name = "autotp2_z1_fp32_dp2"
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(FIXTURES / name / "hf_config")))
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=_reader(name))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    truth = truth_tensors(name)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), truth[f"fp32/{n}"]), n
        assert torch.equal(optim.state[p]["exp_avg_sq"], truth[f"exp_avg_sq/{n}"]), n


def test_negative_controls(tmp_path):
    """Another run's truth is not this one's; a changed element arrives changed; a missing rank file is one
    line naming it, before anything is loaded."""
    model, _ = resume_fixture_model("z3_bf16_dp4", _reader("z3_bf16_dp4"))
    other = truth_tensors("z3_fp32_dp4")
    assert not all(torch.equal(p.detach(), other[f"fp32/{n}"]) for n, p in model.named_parameters())

    save = copy_fixture("z2_fp32_dp2", tmp_path)
    master = reshard.open_checkpoint(save).tensor("l1.weight", "fp32").fragments[0]
    at = master.storage.offset + master.elem_offset * 4
    write_in_zip(master.storage.file, at, torch.tensor([123.25]).numpy().tobytes())
    changed, _ = resume_fixture_model("z2_fp32_dp2", _reader("z2_fp32_dp2", save))
    truth = truth_tensors("z2_fp32_dp2")["fp32/l1.weight"]
    differs = (changed.l1.weight.detach() != truth).nonzero()
    assert len(differs) == 1 and changed.l1.weight.detach().flatten()[master.start] == 123.25

    broken = copy_fixture("z2_fp32_dp2", tmp_path / "b")
    missing = next(tag_dir(broken).glob("zero_pp_rank_1_*optim_states.pt"))
    missing.unlink()
    with pytest.raises(ReshardError, match=missing.name):
        resume_fixture_model("z2_fp32_dp2", _reader("z2_fp32_dp2", broken))
    shutil.rmtree(broken)


def test_elastic_checkpoints_hold_no_hyper_parameters():
    """What a DeepSpeed elastic save lacks, DCP's planner names; with allow_partial_load the optimizer keeps
    the script's own (as DeepSpeed does), and every tensor is still the engine's."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    with pytest.raises(dcp.api.CheckpointException,
                       match="Missing key in checkpoint state_dict: optim.param_groups.0.lr"):
        resume_fixture_model(ELASTIC, _reader(ELASTIC))
    model = build_model(seed=99)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=_reader(ELASTIC),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    truth = truth_tensors(ELASTIC)
    assert all(torch.equal(p.detach(), truth[f"fp32/{n}"]) for n, p in model.named_parameters())
    assert optim.param_groups[0]["lr"] == 0.5


def test_a_tensor_hyper_parameter_arrives_as_a_tensor(tmp_path):
    """torch.optim takes a tensor lr; a checkpoint holding one gives the optimizer that tensor."""
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    for path in tag_dir(save).glob("*optim_states.pt"):
        tree = torch.load(path, weights_only=False)
        for group in tree["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]:
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float64)
        torch.save(tree, path)
    _, optim = resume_fixture_model("z2_fp32_dp2", _reader("z2_fp32_dp2", save))
    lr = optim.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64
    assert float(lr) == truth_json("z2_fp32_dp2")["param_groups"][0]["lr"]


def test_metadata_is_pickled_as_pythons_own_pickler_pickles_it(tmp_path):
    """reshard.formats.dcp.metadata.dumps' short path (MetadataPickler.save and memoize) writes the bytes the
    standard library's pure-Python pickler writes with the same reductions, for `.metadata` files torch itself wrote
    (an FSDP save), a Megatron conversion (objects, layer stacks, flat buckets) and the sparse 70B simulation's
    writer at a small scale; and torch's own DCP reader loads them."""
    import io
    import pickle

    import bench_megatron_sparse  # (tools/ is on the path: conftest)
    from reshard.commands.convert import make_plan
    from reshard.execution.executor import execute
    from reshard.formats.dcp import metadata as md
    from reshard.formats.megatron.pickles import METADATA_ALLOWED

    class Reference(md.MetadataPickler):
        save = pickle._Pickler.save
        memoize = pickle._Pickler.memoize

    megatron = FIXTURES / "megatron_core" / "mcore_dp_reshardable_tp2_pp2_dp2" / "save"
    execute(make_plan(reshard.open_checkpoint(str(megatron)), "tp=1,pp=2,dp=2"), str(tmp_path / "mcore"),
            progress=False)
    bench_megatron_sparse.make(str(tmp_path / "sparse"), 2, 2, 2, 4)
    paths = [*sorted((FIXTURES / "hf_fsdp_sharded_dp2").rglob(".metadata")),
             tmp_path / "mcore" / "iter_0000003" / ".metadata", tmp_path / "sparse" / "iter_0000001" / ".metadata"]
    assert len(paths) == 4
    for path in paths:
        meta = md.read(str(path), METADATA_ALLOWED)
        buf = io.BytesIO()
        Reference(buf, protocol=2).dump(meta)
        ours = md.dumps(meta)
        assert ours == buf.getvalue(), path
        loaded = pickle.loads(ours)      # torch's classes (torch.distributed.checkpoint is imported here)
        assert type(loaded) is dcp.metadata.Metadata and loaded.state_dict_metadata.keys() == \
            meta.state_dict_metadata.keys()
