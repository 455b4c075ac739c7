"""Megatron-core mixture-of-experts saves (fixtures/megatron_core/mcore_moe_*: a GPTModel whose every layer's MLP is
4 experts, SequentialMLP, top-2 router, trained by the real megatron-core 0.16.1 at ep=2, dp=2 with the distributed
optimizer, tools/fixture_megatron_core.py): the experts are read as megatron-core saved them (one tensor per layer
stack with an expert axis, decoder.layers.mlp.experts.experts.*), every expert of every layer once, with the fp32
masters and both moments of the truth taken from the live run; the experts' dp_reshardable buckets (the second of
the chained distributed optimizers, one model-parallel group per expert-parallel rank over the expert-data-parallel
ranks) recomputed and checked against their stored counts. (The generic reading tests of
tests/formats/megatron/test_megatron.py run on these fixtures too: inspect, every element once, export against the
truth.)

Negative controls: a changed expert element is found by diff; wrong stored counts of the experts' buckets and a
missing rank file are refused in one line naming the file.
"""
from __future__ import annotations

import json
import shutil
import struct
import zipfile

import pytest
from safetensors.torch import load_file

import reshard
from reshard.core.catalog import MASTER, TensorKey
from tests.helpers.cli import run_cli
from tests.helpers.damage import write_in_zip
from tests.helpers.fixtures import FIXTURES
from tests.helpers.megatron_saves import bump_last_count, chunk_span, rewrite_in_span

ROOT = FIXTURES / "megatron_core"
MOE = ["mcore_moe_dp_reshardable_ep2_dp2", "mcore_moe_fully_reshardable_ep2_dp2"]
EXPERT = "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight"     # held by expert-parallel rank 1


def _save(name):
    return ROOT / name / "save"


@pytest.mark.parametrize("name", MOE)
def test_inspect_shows_the_expert_parallelism(name):
    info = reshard.inspect(reshard.open_checkpoint(str(_save(name))))
    truth = json.loads((ROOT / name / "truth.json").read_text())
    assert info.experts is not None and info.experts["ep"] == truth["ep"] == 2
    assert info.experts["expert_dp"] == truth["dp"] // truth["ep"]
    assert [layer["experts"] for layer in info.experts["layers"]] == [truth["experts"]] * truth["layers"]
    assert [layer["placement"] for layer in info.experts["layers"]] == [[[0, 1], [2, 3]]] * truth["layers"]
    assert info.problems == 0 and info.step == truth["step"][0]
    # the experts' param group (is_expert_parallel) holds every expert's params, and only them
    catalog = reshard.open_checkpoint(str(_save(name)))
    experts = [g for g in catalog.param_groups if g.get("is_expert_parallel")]
    assert len(experts) == 1 and sorted(experts[0]["params"]) == sorted(
        n for n in catalog.params if ".mlp.experts.experts." in n)
    assert len(experts[0]["params"]) == truth["layers"] * truth["experts"] * 2
    line = run_cli("inspect", _save(name)).stdout
    assert "experts       ep=2 expert-dp=1; layer 0: 4 experts, 2/2 per rank" in line


def test_validate_deep_finds_every_expert_once_with_its_masters_and_moments():
    name = MOE[0]
    proc = run_cli("validate", "--deep", _save(name))
    assert proc.returncode == 0 and proc.stdout.startswith("complete;"), proc.stdout + proc.stderr
    truth = load_file(str(ROOT / name / "truth.safetensors"))
    catalog = reshard.open_checkpoint(str(_save(name)))
    experts = {k.split("/", 1)[1] for k in truth if ".experts.experts." in k}
    assert len(experts) == 2 * 4 * 2       # layers x experts x (fc1, fc2)
    for expert in experts:
        for state in (MASTER, "exp_avg", "exp_avg_sq"):
            assert TensorKey(expert, state) in catalog.tensors, (expert, state)


def test_the_two_shardings_of_one_run_are_equal():
    """The dp_reshardable buckets (mapped by recomputing Megatron's bucketing) and the fully_reshardable
    model-space states Megatron itself wrote for the same run hold the same values."""
    proc = run_cli("diff", _save(MOE[0]), _save(MOE[1]), check=0)
    assert proc.returncode == 0 and "no difference" in proc.stdout, proc.stdout


def test_a_changed_expert_element_is_found(tmp_path):
    """One bf16 element of the expert stack's chunk of expert-parallel rank 1 (layer 1, expert 3) changed: diff
    names that expert; the fixture against itself is equal (the control)."""
    save = tmp_path / "save"
    shutil.copytree(_save(MOE[0]), save)
    path, offset, length = chunk_span(save, "decoder.layers.mlp.experts.experts.linear_fc2.weight", (1, 3, 0, 0))

    def flip(part):
        with zipfile.ZipFile(part) as zf:
            member = next(i for i in zf.infolist() if "/data/" in i.filename)
        header = part.read_bytes()[member.header_offset:member.header_offset + 30]
        start = member.header_offset + 30 + sum(struct.unpack_from("<HH", header, 26))
        value = part.read_bytes()[start:start + 2]
        write_in_zip(part, start, bytes([value[0] ^ 1, value[1]]))
    rewrite_in_span(path, offset, length, flip)
    assert reshard.diff(str(_save(MOE[0])), str(_save(MOE[0]))).equal
    changed = reshard.diff(str(_save(MOE[0])), str(save))
    assert not changed.equal and [d.name for d in changed.differences] == [EXPERT], changed.differences


def test_wrong_expert_bucket_counts_are_refused_in_one_line(tmp_path):
    """The experts' stored per_bucket_numel_unpadded of expert-parallel rank 1 changed: the recomputed layout
    disagrees, and the save is refused in one line naming the file, not mapped to the wrong elements."""
    save = tmp_path / "save"
    shutil.copytree(_save(MOE[0]), save)
    key = "chained_1.optimizer.distributed.dp_group_idx_1.per_bucket_numel_unpadded"
    path, offset, length = chunk_span(save, key)

    rewrite_in_span(path, offset, length, bump_last_count)
    proc = run_cli("validate", save)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert path.name in lines[0], lines[0]
    assert "chained_1.per_bucket_numel_unpadded of model-parallel group 1" in lines[0], lines[0]




def test_a_missing_rank_file_is_named(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(_save(MOE[0]), save)
    (save / "iter_0000003" / "__1_1.distcp").unlink()
    proc = run_cli("validate", save)
    assert proc.returncode != 0 and "__1_1.distcp" in proc.stdout + proc.stderr, proc.stdout + proc.stderr



def test_a_round_trip_through_ep1_writes_megatrons_own_keys_and_chunks(tmp_path):
    """ep=2 -> ep=1 -> ep=2: every key, global shape and chunk box of megatron-core's own save (the expert stacks'
    per-expert chunks, both chained optimizers' buckets and their per-rank cuts, every object) and the same
    elements. At ep=1 the experts are dense params (no chained optimizer)."""
    from reshard.commands.convert import make_plan
    from reshard.execution.executor import execute
    from reshard.formats.dcp import metadata as md
    from reshard.formats.megatron.pickles import METADATA_ALLOWED
    source = _save(MOE[0])
    execute(make_plan(reshard.open_checkpoint(str(source)), "dp=2,ep=1"), str(tmp_path / "ep1"), progress=False)
    execute(make_plan(reshard.open_checkpoint(str(tmp_path / "ep1")), "dp=2,ep=2"), str(tmp_path / "back"),
            progress=False)

    def boxes(save):
        meta = md.read(str(save / "iter_0000003" / ".metadata"), METADATA_ALLOWED)
        return {key: (tuple(e.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in e.chunks))
                if isinstance(e, md.TensorStorageMetadata) else None for key, e in meta.state_dict_metadata.items()}
    ep1 = boxes(tmp_path / "ep1")
    assert not any(k.startswith("chained_") for k in ep1) and "optimizer.distributed.dp_group_idx_0.per_bucket_numel" \
        "/shard_0_1" in ep1
    assert boxes(tmp_path / "back") == boxes(source)
    for other in ("ep1", "back"):
        proc = run_cli("diff", source, tmp_path / other)
        assert proc.returncode == 0 and "no difference" in proc.stdout, proc.stdout
    info = reshard.inspect(reshard.open_checkpoint(str(tmp_path / "ep1")))
    assert info.experts is not None and (info.experts["ep"], info.experts["expert_dp"]) == (1, 2)


def test_what_is_not_written_for_experts_is_refused_in_one_line(tmp_path):
    for to, words, *fmt in (("dp=2,ep=3", "ep=3 must divide"), ("dp=1,tp=2,ep=1", "tp=1, pp=1"),
                            ("dp=2,ep=2,sharding=plain", "sharding=plain"),
                            ("dp=2,zero=1,ep=2", "not written as DeepSpeed's expert files", "--format", "deepspeed")):
        proc = run_cli("convert", _save(MOE[0]), tmp_path / "out", "--to", to, *fmt)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and words in lines[0], (to, proc.stderr)
        assert not (tmp_path / "out").exists()


def _mixtral_logits(folder, tokens):
    import torch
    from transformers import MixtralForCausalLM
    model = MixtralForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("swapped", [False, True])
def test_mixtral_export_gives_megatrons_logits(swapped, tmp_path):
    """`export --names megatron-core-mixtral`: MixtralForCausalLM.from_pretrained loads the folder (config.json from
    the save's args: experts, top-k, the experts' width) and its logits of the fixture's tokens are Megatron's own
    fp32 forward of the saved weights (taken at save time), within fp32 tolerance. The negative control: each
    expert's gate and up (w1, w3) swapped loads too, and gives other logits."""
    import os

    import torch
    names = os.path.join(os.path.dirname(reshard.__file__), "layouts", "export-names", "megatron-core-mixtral.json")
    if swapped:
        spec = json.loads(open(names).read())
        next(r for r in spec["rules"] if "experts" in r["match"] and "rows" in r)["rows"]["parts"].reverse()
        names = str(tmp_path / "swapped.json")
        (tmp_path / "swapped.json").write_text(json.dumps(spec))
    run_cli("export", _save(MOE[0]), tmp_path / "hf", "--names", names, "--dtype", "fp32", "--quiet", check=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    truth = json.loads((ROOT / MOE[0] / "truth.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == \
        (truth["experts"], truth["topk"], truth["expert_ffn"])
    forward = load_file(str(ROOT / MOE[0] / "truth_forward.safetensors"))
    logits = _mixtral_logits(tmp_path / "hf", forward["tokens"])
    if swapped:
        assert (logits - forward["logits"]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(logits, forward["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")   # (unpickling args imports megatron)
def test_per_expert_keys_are_refused_in_one_line(tmp_path):
    """A save whose content_metadata says singleton_local_shards (experts under per-expert keys, not read yet) is
    refused in one line naming common.pt, not read as something else."""
    import torch
    save = tmp_path / "save"
    shutil.copytree(_save(MOE[0]), save)
    path = save / "iter_0000003" / "common.pt"
    common = torch.load(path, weights_only=False)
    common["content_metadata"]["singleton_local_shards"] = True
    torch.save(common, path)
    proc = run_cli("inspect", save)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "common.pt" in lines[0], proc.stderr
    assert "singleton_local_shards" in lines[0]
