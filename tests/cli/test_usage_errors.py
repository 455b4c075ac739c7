"""Usage errors exit 2 with one line, everywhere (issue 24, points 7 and 8): spec keys unknown, repeated or out of
range, keys the output format has no place for (naming the --format that has), descriptor files, options with
ranges, a kv_heads that cannot describe the tensors; the source unmodified, DST not created. --help says exactly
what the parser takes: both read formats.every_spec_key(), the writers' declarations."""
import hashlib
import json
import os
import shutil

import pytest

import reshard
from reshard.cli import main
from reshard.core.layout import Layout
from reshard.errors import UsageError
from reshard.formats import every_spec_key, target_layout
from reshard.formats.deepspeed.topology import DeepSpeedTopology
from tests.helpers.fixtures import fixture_dir
from tests.helpers.repo import REPO

SOURCE = "z2_fp32_dp2"
AUTOTP = "autotp2_z1_fp32_dp2"          # a Llama with 2 key-value heads: k_proj 8 rows, q_proj 16
RULES = "llama-autotp"      # a rule file shipped with reshard, found by name


def digest_tree(root) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def refused(capsys, tmp_path, *args, words=""):
    """reshard ARGS (DST, where one is named, is tmp_path/dst) exits 2 with one line holding `words`, writing
    nothing; returns the line."""
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("reshard: ") and words in lines[0], \
        (args, code, captured.err)
    assert not (tmp_path / "dst").exists() and not (tmp_path / ".dst.reshard-tmp").exists()
    return lines[0]


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory):
    """A DCP checkpoint (written by reshard from a real DeepSpeed save): an output format without ZeRO stages."""
    path = tmp_path_factory.mktemp("dcp") / "dcp"
    assert main(["convert", str(fixture_dir(SOURCE)), str(path), "--format", "dcp", "--quiet"]) == 0
    return path


SPEC_ERRORS = [("pd=2", "'pd' is not a key"), ("dp=0", "dp is a whole number, 1 or more"),
               ("zero=4", "zero is 1, 2 or 3"), ("zero=0", "zero is 1, 2 or 3"), ("dp=3,dp=4", "dp is given twice"),
               ("dp=1.5", "dp is a whole number"), ("tp=-1", "tp is a whole number"), ("kv_heads=0", "kv_heads is"),
               ("ep=two", "ep is a whole number"), ("partition=spiral", "partition must be one of"),
               ("layer_types=A//B", "layer_types is"), ("zero=1,zero=1", "given twice"),
               ("dp=2,=3", "'' is not a key")]


@pytest.mark.parametrize("spec, words", SPEC_ERRORS, ids=[s for s, _ in SPEC_ERRORS])
def test_a_bad_spec_is_a_usage_error(spec, words, tmp_path, capsys):
    """Each exited 1 (a duplicate key even 0: the last one won); now 2, one line, for plan and convert."""
    src = fixture_dir(SOURCE)
    before = digest_tree(src)
    refused(capsys, tmp_path, "plan", src, "--to", spec, words=words)
    refused(capsys, tmp_path, "convert", src, tmp_path / "dst", "--to", spec, words=words)
    assert digest_tree(src) == before


def test_a_key_the_output_has_no_place_for_names_the_format_that_has(dcp_source, tmp_path, capsys):
    """A DCP source with --to zero=3 said "dcp output has no zero" without saying which --format takes it."""
    line = refused(capsys, tmp_path, "convert", dcp_source, tmp_path / "dst", "--to", "zero=3",
                   words="dcp output has no zero")
    assert "--format deepspeed or universal takes zero" in line
    line = refused(capsys, tmp_path, "plan", fixture_dir(SOURCE), "--format", "dcp", "--to", "dp=2,kv_heads=2,zero=1")
    assert "no kv_heads or zero" in line and "--format deepspeed or universal takes kv_heads and zero" in line
    # negative control: the format the line names takes the key
    assert main(["convert", str(dcp_source), str(tmp_path / "ok"), "--format", "deepspeed", "--to", "zero=3",
                 "--quiet"]) == 0


def test_a_bad_descriptor_file_is_a_usage_error(tmp_path, capsys):
    """--to FILE: a missing file, a value out of range, a key given twice (json kept the last one) exit 2."""
    src = fixture_dir(SOURCE)
    good = Layout.of(3, format_topology=DeepSpeedTopology(zero=2)).to_dict()
    cases = {"twice.json": ('{"kind": "reshard.core.layout", "version": 1, "dp": 3, "dp": 4}', "dp given twice"),
             "dp0.json": (json.dumps({**good, "dp": 0}), "dp must be a positive integer"),
             "zero7.json": (json.dumps({**good, "zero": 7}), "zero must be"),
             "colour.json": (json.dumps({**good, "colour": "red"}), "unknown layout keys colour")}
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        for command in (["plan", src], ["convert", src, tmp_path / "dst"]):
            line = refused(capsys, tmp_path, *command, "--to", tmp_path / name, words=words)
            assert str(tmp_path / name) in line
    refused(capsys, tmp_path, "plan", src, "--to", tmp_path / "nothere.json", words="no such layout descriptor file")
    (tmp_path / "good.json").write_text(json.dumps(good))      # negative control
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", str(tmp_path / "good.json"), "--quiet"]) == 0


OPTION_ERRORS = [
    (["convert", "SRC", "DST", "--workers", "0"], "--workers"), (["plan", "SRC", "--workers", "-2"], "--workers"),
    (["convert", "SRC", "DST", "--memory-budget", "garbage"], "--memory-budget"),
    (["convert", "SRC", "DST", "--memory-budget", "0"], "--memory-budget"),
    (["convert", "SRC", "DST", "--memory-budget", "1.2.3GB"], "--memory-budget"),
    (["export", "SRC", "DST", "--max-shard-size", "garbage"], "--max-shard-size"),
    (["export", "SRC", "DST", "--max-shard-size", "0"], "--max-shard-size"),
    (["diff", "SRC", "SRC", "--atol", "-1"], "--atol"), (["diff", "SRC", "SRC", "--atol", "nan"], "--atol"),
    (["list", "SRC", "--recent", "-1"], "--recent"), (["prune", "SRC", "--settle", "inf"], "--settle"),
    (["watch", "SRC", "--interval", "0"], "--interval"), (["prune", "SRC", "--keep-last", "0"], "--keep-last"),
    (["export", "SRC", "DST", "--dtype", "fp8"], "--dtype"), (["convert", "SRC"], "DST"),
    (["frobnicate"], "invalid choice"),
]


@pytest.mark.parametrize("args, words", OPTION_ERRORS, ids=[" ".join(a) for a, _ in OPTION_ERRORS])
def test_an_option_out_of_its_range_is_one_line(args, words, tmp_path, capsys):
    """argparse printed its usage block before the error (several lines); --atol -1 was taken (every tensor then
    'differs'), --max-shard-size garbage exited 1, --memory-budget 0 was taken."""
    argv = [{"SRC": fixture_dir(SOURCE), "DST": tmp_path / "dst"}.get(a, a) for a in args]
    line = refused(capsys, tmp_path, *argv, words=words)
    assert "--help" in line and "usage:" not in line


def test_help_says_exactly_what_the_parser_takes(capsys):
    """--help listed zero=0, which convert refuses. Every key's help row gives the values formats.every_spec_key()
    accepts, and which output formats take it; the parser takes each value named and refuses the ones beside."""
    from reshard.formats import WRITERS, formats_taking
    assert main(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "zero=S ZeRO stage (1, 2 or 3;" in text and "0, 1, 2 or 3" not in text
    source = reshard.open_checkpoint(fixture_dir(SOURCE)).layout
    for key in every_spec_key():
        if key.choices or key.minimum is not None:
            assert key.accepted() in text
            taken = key.choices or (key.minimum, key.minimum + 1)
            for value in taken:
                assert isinstance(target_layout(source, f"{key.name}={value}", "deepspeed"), Layout)
            for value in sorted({min(taken) - 1, *([max(taken) + 1] if key.choices else [])}):
                with pytest.raises(UsageError):
                    target_layout(source, f"{key.name}={value}", "deepspeed")
        taking = formats_taking([key.name])
        if len(taking) < len(WRITERS):
            assert f"{' and '.join(taking)} output" in text


# ----------------------------------------------------------------------------- point 8: kv_heads


@pytest.mark.parametrize("to, words", [
    ("tp=3,kv_heads=3", "kv_heads=3 cannot describe model.layers.0.self_attn.q_proj.weight: its 16 rows"),
    ("tp=2,dp=1,kv_heads=3", "kv_heads=3 cannot describe"),         # the source's degree: its cut kept, still wrong
    ("tp=1,kv_heads=3", "kv_heads=3 cannot describe"),
    ("tp=3,kv_heads=2", "cut into kv_heads=2 heads gives tensor-parallel rank 2 nothing at tp=3"),
    ("tp=3,kv_heads=1", "cut into kv_heads=1 heads gives tensor-parallel rank 1 nothing at tp=2"),    # not the source's
])
def test_kv_heads_that_cannot_describe_the_tensors_is_refused(to, words, tmp_path, capsys):
    """k_proj holds 2 heads of 4 rows (8 rows; q_proj 16): kv_heads=3 was taken at tp=3 (AutoTP's even fallback
    then cut k_proj 3+3+2, through a head). Now: exit 2, one line, nothing written, the source unchanged."""
    src = fixture_dir(AUTOTP)
    before = digest_tree(src)
    refused(capsys, tmp_path, "convert", src, tmp_path / "dst", "--to", to, "--layout-rules", RULES, words=words)
    refused(capsys, tmp_path, "plan", src, "--to", to, "--layout-rules", RULES, words=words)
    assert digest_tree(src) == before


def test_the_models_kv_heads_still_converts(tmp_path):
    """Negative control: the model's own 2 heads re-cut tp2 -> tp1 -> tp2 and give back the engine's files
    (test_tp_pp_convert checks them byte for byte and the engine resumes from them)."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(AUTOTP), src)
    assert main(["convert", str(src), str(tmp_path / "tp1"), "--to", "tp=1,dp=2,kv_heads=2", "--layout-rules", RULES,
                 "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "tp1"), str(tmp_path / "tp2"), "--to", "tp=2,dp=2,kv_heads=2",
                 "--layout-rules", RULES, "--quiet"]) == 0
    assert reshard.validate(reshard.open_checkpoint(tmp_path / "tp2"), deep=True).ok


def test_a_rule_file_count_that_cannot_describe_the_tensors_is_refused(tmp_path, capsys):
    """A rule file's counts are the user's statement about the model: `sub_params: 5` for a fused SwiGLU weight of
    24 rows (exit 1 before), `original_vocab_size` above the embedding's rows (silently ignored before: the tensor
    kept whole as if it described it). Exit 2, one line naming the rule file, nothing written."""
    src = fixture_dir("megatron_tp2_z1_fp32_dp2")
    rules = json.loads((REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json").read_text())
    five = {**rules, "rules": [{**r, "sub_params": 5} if "sub_params" in r else r for r in rules["rules"]]}
    cases = {"sub5.json": (five, "24 rows along dim 0 do not split into 5 sub-params"),
             "vocab.json": ({**rules, "original_vocab_size": 41}, "original_vocab_size 41 cannot describe")}
    for name, (data, words) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        for command in (["inspect", src], ["convert", src, tmp_path / "dst", "--to", "tp=1"]):
            line = refused(capsys, tmp_path, *command, "--layout-rules", tmp_path / name, words=words)
            assert line.startswith(f"reshard: {tmp_path / name}: ")
    (tmp_path / "vocab.json").write_text(json.dumps({**rules, "original_vocab_size": 37}))    # control: 3 padding rows
    assert main(["inspect", str(src), "--layout-rules", str(tmp_path / "vocab.json")]) == 0
