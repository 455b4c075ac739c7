"""export: DeepSpeed's own zero_to_fp32 agrees tensor by tensor; safetensors and huggingface_hub read ours."""
import contextlib
import importlib.util
import io
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, truth_json, truth_tensors


def _export(src, out, *args):
    run_cli("export", src, out, "--quiet", *args, check=0)


def _zero_to_fp32(save_dir, out):
    """DeepSpeed's own script, as it copied it into the save dir, in this process (its main's call with its
    defaults; DeepSpeed imported once, not per fixture): (state dict, error line or None)."""
    spec = importlib.util.spec_from_file_location("zero_to_fp32", save_dir / "zero_to_fp32.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            script.convert_zero_checkpoint_to_fp32_state_dict(str(save_dir), str(out))
    except Exception as e:      # the line its traceback would end with
        return None, f"{type(e).__name__}: {e}".strip().splitlines()[-1]
    return torch.load(out / "pytorch_model.bin", weights_only=False), None


def test_fp32_export_equals_zero_to_fp32_and_keeps_what_it_drops(fixture_name, tmp_path):
    meta = truth_json(fixture_name)
    _export(fixture_dir(fixture_name), tmp_path / "ours.safetensors", "--dtype", "fp32")    # zero_to_fp32's dtype
    ours = load_file(str(tmp_path / "ours.safetensors"))
    theirs, error = _zero_to_fp32(fixture_dir(fixture_name), tmp_path / "z2f")
    truth = truth_tensors(fixture_name)
    if theirs is None:
        # zero_to_fp32 cannot read BF16_Optimizer checkpoints ("... is not a zero checkpoint")
        assert fixture_name.startswith("bf16opt") and "zero checkpoint" in error, error
    else:
        for key, value in theirs.items():
            name = meta["tied"].get(key, key)
            assert torch.equal(ours[name], value), key
        dropped = set(ours) - set(theirs)
        if meta["zero_stage"] == 1 and meta["frozen"]:
            assert dropped == set(meta["frozen"])      # zero_to_fp32 silently drops ZeRO-1 frozen params
        else:
            assert not dropped
    # and against the engine: fp32 masters for trainable params, the saved values for the rest
    for name, value in ours.items():
        expected = truth[f"fp32/{name}"] if name in meta["trainable"] else truth[f"module/{name}"]
        assert torch.equal(value, expected.float() if value.is_floating_point() else expected), name
    assert set(ours) == set(meta["trainable"]) | set(meta["frozen"]) | set(meta["buffers"])


@pytest.mark.parametrize("name", ["z1_bf16_dp2", "z3_bf16_dp2", "z2_fp16_dp2", "z2_fp32_dp2", "z3_fp32_dp2"])
def test_the_default_dtype_is_what_the_model_holds(name, tmp_path):
    """No --dtype: the training dtype, what save_pretrained writes — a 16-bit run's weights are its module copy bit
    for bit (ZeRO-3 saves none: its master rounded as DeepSpeed rounds it), an fp32 run's its fp32 weights."""
    meta, truth = truth_json(name), truth_tensors(name)
    _export(fixture_dir(name), tmp_path / "default.safetensors")
    _export(fixture_dir(name), tmp_path / "fp32.safetensors", "--dtype", "fp32")
    default, fp32 = load_file(str(tmp_path / "default.safetensors")), load_file(str(tmp_path / "fp32.safetensors"))
    for param in meta["trainable"]:
        held = truth[f"module/{param}"]
        assert default[param].dtype == held.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                      "fp32": torch.float32}[meta["dtype"]], param
        assert torch.equal(default[param], held), param
        assert torch.equal(fp32[param], truth[f"fp32/{param}"]), param       # --dtype fp32: the old output
    # the control: a 16-bit run's default file is half the fp32 one's weights, an fp32 run's the same
    weights = sum(default[p].numel() * default[p].element_size() for p in meta["trainable"])
    assert weights * (2 if meta["dtype"] != "fp32" else 1) == sum(fp32[p].numel() * 4 for p in meta["trainable"])


@pytest.mark.parametrize("dtype, expected", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("auto", None)])
def test_dtype_choice_and_module_weights(dtype, expected, tmp_path):
    name = "z1_bf16_frozen_tied_dp2"
    truth = truth_tensors(name)
    _export(fixture_dir(name), tmp_path / "a.safetensors", "--dtype", dtype)
    out = load_file(str(tmp_path / "a.safetensors"))
    assert out["pos"].dtype == torch.int64 and torch.equal(out["pos"], truth["module/pos"])
    want = expected or torch.bfloat16
    assert out["l1.weight"].dtype == want
    assert torch.equal(out["l1.weight"], truth["fp32/l1.weight"].to(want))
    if dtype == "auto":
        assert out["scale"].dtype == torch.float32      # buffers keep the dtype they were saved in
    _export(fixture_dir(name), tmp_path / "m.safetensors", "--weights", "module", "--dtype", "auto")
    module = load_file(str(tmp_path / "m.safetensors"))
    for key in module:
        assert torch.equal(module[key], truth[f"module/{key}"]), key


def test_sharded_index_matches_huggingface_hub(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards
    name = "z3_fp32_frozen_tied_dp2"
    _export(fixture_dir(name), tmp_path / "out", "--max-shard-size", "2KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    tensors = {}
    for filename in sorted(set(index["weight_map"].values())):
        with safe_open(str(tmp_path / "out" / filename), "pt") as f:
            assert f.metadata()["format"] == "pt"
            assert json.loads(f.metadata()["tied"]) == {"head.weight": "emb.weight"}
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    catalog = reshard.open_checkpoint(fixture_dir(name))
    ordered = {k: tensors[k] for k in catalog.order if k in tensors}
    split = split_torch_state_dict_into_shards(ordered, max_shard_size="2KB")
    assert index["metadata"] == split.metadata
    assert index["weight_map"] == split.tensor_to_filename
    assert len(split.filename_to_tensors) > 1


def test_with_optimizer_writes_every_state_and_the_json(tmp_path):
    name = "z2_fp32_frozen_tied_dp2"
    meta, truth = truth_json(name), truth_tensors(name)
    _export(fixture_dir(name), tmp_path / "out", "--with-optimizer", "--dtype", "bf16")
    summary = json.loads((tmp_path / "out" / "optimizer.json").read_text())
    assert set(summary["states"]) == {"fp32", "exp_avg", "exp_avg_sq"}
    for state, filename in summary["states"].items():
        values = load_file(str(tmp_path / "out" / filename))
        assert set(values) == set(meta["trainable"])
        for param, value in values.items():
            assert torch.equal(value, truth[f"{state}/{param}"]), (state, param)
    assert [g["params"] for g in summary["param_groups"]] == [g["param_names"] for g in meta["param_groups"]]
    assert [g["weight_decay"] for g in summary["param_groups"]] == [0.1, 0.0]
    assert all(g["step"] == meta["step"] for g in summary["param_groups"])
    assert summary["global_steps"] == meta["global_steps"]


def test_torch_format_keeps_the_tie(tmp_path):
    name = "z2_fp32_frozen_tied_dp2"
    _export(fixture_dir(name), tmp_path / "model.bin", "--format", "torch")
    sd = torch.load(tmp_path / "model.bin", weights_only=True)
    assert sd["head.weight"].data_ptr() == sd["emb.weight"].data_ptr()
    truth = truth_tensors(name)
    assert torch.equal(sd["emb.weight"], truth["fp32/emb.weight"])
    _export(fixture_dir(name), tmp_path / "sharded", "--format", "torch", "--max-shard-size", "1KB")
    index = json.loads((tmp_path / "sharded" / "pytorch_model.bin.index.json").read_text())
    assert index["weight_map"]["head.weight"] == index["weight_map"]["emb.weight"]


def test_export_refusals(tmp_path):
    src = fixture_dir("z2_fp32_dp2")
    proc = run_cli("export", src, tmp_path / "m.safetensors", "--with-optimizer", check=1)
    assert "directory" in proc.stderr
    (tmp_path / "exists.safetensors").write_text("x")
    proc = run_cli("export", src, tmp_path / "exists.safetensors", check=1)
    assert "exists" in proc.stderr and (tmp_path / "exists.safetensors").read_text() == "x"
    proc = run_cli("export", src, tmp_path / "o", "--max-shard-size", "5 parsecs", check=2)
    assert "shard size" in proc.stderr and not (tmp_path / "o").exists()


def test_rows_rules_cut_interleaved_parts_as_boxes_and_refuse_what_does_not_fit(tmp_path):
    """A "rows" rule (export_names): each part is its rows of every group, a shard of boxes; counts by number or by a
    hyperparameter the checkpoint records. Controls: a count no checkpoint value gives, groups that do not divide the
    rows, and parts that do not fill a group are refused in one line naming the rule file."""
    from reshard.commands.export import Entry
    from reshard.core.placement import Block
    from reshard.errors import ReshardError
    from reshard.rules import export_names

    def rules(rows):
        path = tmp_path / "names.json"
        path.write_text(json.dumps({"kind": "reshard.export-names", "version": 1,
                                    "rules": [{"match": "w", "rows": rows}]}))
        return export_names.load(str(path))
    entry = Entry("w", "float32", (12, 3), ("w", "fp32"))
    qkv = {"groups": "groups", "parts": [{"name": "q"}, {"name": "k", "rows": 1}, {"name": "v", "rows": 1}]}
    out, _ = rules(qkv).apply([entry], {}, {"groups": 3})
    assert [(e.key, e.shape) for e in out] == [("q", (6, 3)), ("k", (3, 3)), ("v", (3, 3))]
    assert out[1].shard.blocks == tuple(Block((4 * g + 2, 0), (g, 0), (1, 3)) for g in range(3))
    halves, _ = rules({"parts": [{"name": "gate"}, {"name": "up"}]}).apply([entry], {})
    assert [(e.key, e.shard.blocks) for e in halves] == [("gate", (Block((0, 0), (0, 0), (6, 3)),)),
                                                         ("up", (Block((6, 0), (0, 0), (6, 3)),))]
    with pytest.raises(ReshardError, match=r"names\.json: w: groups is groups, which the checkpoint does not record"):
        rules(qkv).apply([entry], {})
    with pytest.raises(ReshardError, match=r"names\.json: w: 12 rows are not 5 equal groups"):
        rules(qkv).apply([entry], {}, {"groups": 5})
    with pytest.raises(ReshardError, match=r"names\.json: w: the parts' rows do not fill a group of 4 rows"):
        rules({"groups": 3, "parts": [{"name": "a", "rows": 3}, {"name": "b", "rows": 2}]}).apply([entry], {})
    with pytest.raises(ReshardError, match=r'names\.json: rule 0: "rows" must be'):
        rules({"parts": [{"name": "alone"}]})
