"""The command line's contract: what it infers, what it refuses (one line, the right exit code), what it
prints about the files it wrote (the disk's numbers), JSON for programs, and a closed stdout."""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file

import reshard
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, truth_json, truth_tensors
from tests.helpers.repo import REPO

SRC = fixture_dir("z2_fp32_dp2")
RULES = REPO / "reshard" / "layouts" / "tp-rules" / "megatron-gpt.json"


def _one_line(proc, *needles):
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _on_disk(folder) -> dict:
    """{relative path: size} of every file under `folder`."""
    return {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(folder) for f in files}


# -- 5: export OUT's suffix says the format -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["out.bin", "out.pt", "out.pth"])
def test_export_to_a_torch_name_writes_a_torch_file(name, tmp_path):
    out = tmp_path / name
    run_cli("export", SRC, out, "--quiet", check=0)
    assert out.is_file()
    weights = torch.load(out, weights_only=True)            # the real consumer
    run_cli("export", SRC, tmp_path / "ref.safetensors", "--quiet", check=0)
    reference = load_file(str(tmp_path / "ref.safetensors"))
    assert set(weights) >= set(reference)
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


@pytest.mark.parametrize("name, fmt", [("out.bin", "safetensors"), ("out.pt", "safetensors"),
                                       ("out.safetensors", "torch")])
def test_export_refuses_a_name_that_contradicts_format(name, fmt, tmp_path):
    proc = run_cli("export", SRC, tmp_path / name, "--format", fmt, check=2)
    _one_line(proc, str(tmp_path / name), fmt)
    assert os.listdir(tmp_path) == []
    # negative control: the same format with a name that agrees (or a directory) is written
    agreeing = "out.safetensors" if fmt == "safetensors" else "out.pt"
    run_cli("export", SRC, tmp_path / agreeing, "--format", fmt, "--quiet", check=0)
    run_cli("export", SRC, tmp_path / "folder", "--format", fmt, "--quiet", check=0)
    assert (tmp_path / agreeing).is_file() and (tmp_path / "folder").is_dir()


# -- 6: layout rules where the reader takes none ----------------------------------------------------------------

def test_layout_rules_refused_by_every_reader_that_takes_none(tmp_path):
    run_cli("export", SRC, tmp_path / "model.pt", "--quiet", check=0)
    run_cli("export", SRC, tmp_path / "model.safetensors", "--quiet", check=0)
    run_cli("convert", SRC, tmp_path / "dcp", "--format", "dcp", "--quiet", check=0)
    run_cli("convert", SRC, tmp_path / "universal", "--format", "universal", "--quiet", check=0)
    for source in ("model.pt", "model.safetensors", "dcp", "universal"):
        for command, *options in (["inspect"], ["validate"], ["plan", "--format", "dcp"]):
            proc = run_cli(command, tmp_path / source, *options, "--layout-rules", RULES, check=2)
            _one_line(proc, str(tmp_path / source), "layout rules")
            run_cli(command, tmp_path / source, *options, check=0)     # negative control: without them it reads
    # the DeepSpeed reader uses them: a Megatron-style save needs them to be read at all
    run_cli("inspect", fixture_dir("megatron_tp2_z1_fp32_dp2"), "--layout-rules", RULES, check=0)


# -- 6b: every reading option a format does not take, through every command -------------------------------------

@pytest.fixture(scope="module")
def every_format(tmp_path_factory):
    """{reader FORMAT: a checkpoint of that format}: each made by reshard from the DeepSpeed fixture, the
    Lightning file by torch.save and the Trainer folder by safetensors, as those frameworks lay them out."""
    from safetensors.torch import save_file

    import reshard.cli
    root = tmp_path_factory.mktemp("formats")
    for args in (["export", SRC, root / "model.pt"], ["export", SRC, root / "model.safetensors"],
                 ["convert", SRC, root / "dcp", "--format", "dcp"],
                 ["convert", SRC, root / "universal", "--format", "universal"]):
        assert reshard.cli.main([*map(str, args), "--quiet"]) == 0
    weights = torch.load(root / "model.pt", weights_only=True)
    params = [torch.nn.Parameter(v.clone()) for v in weights.values() if v.is_floating_point()]
    adam = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    torch.save({"state_dict": weights, "optimizer_states": [adam.state_dict()], "global_step": 1},
               root / "model.ckpt")
    (root / "hf").mkdir()
    save_file(weights, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (root / "hf" / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    return {"deepspeed": SRC, "universal": root / "universal", "dcp": root / "dcp",
            "torch": root / "model.pt", "safetensors": root / "model.safetensors",
            "lightning": root / "model.ckpt", "hf-trainer": root / "hf"}


READ_OPTIONS = {"--tag": ("global_step3", {"deepspeed", "universal"}),
                "--layout-rules": (str(RULES), {"deepspeed"})}


def _commands(source, out, flag, value):
    """Each command given `flag` for `source`; diff's per-side flag is --tag-a / --tag-b."""
    given = [flag, value]
    return {"inspect": ["inspect", source, *given], "validate": ["validate", source, *given],
            "plan": ["plan", source, "--format", "dcp", *given],
            "convert": ["convert", source, out / "converted", "--format", "dcp", *given],
            "export": ["export", source, out / "exported.safetensors", *given],
            "diff": ["diff", source, source, *(["--tag-a", value] if flag == "--tag" else given)]}


def test_a_reading_option_a_format_does_not_take_is_a_usage_error(every_format, tmp_path, capsys):
    import reshard.cli
    for fmt, source in every_format.items():
        for flag, (value, takers) in READ_OPTIONS.items():
            for command, args in _commands(source, tmp_path, flag, value).items():
                code = reshard.cli.main([*map(str, args), "--quiet"])
                err = capsys.readouterr().err
                if fmt in takers:       # negative control: the formats that take it read with it
                    assert code == 0 and err == "", (fmt, command, flag, err)
                else:
                    assert code == 2 and err.startswith(f"reshard: {source}: {fmt} checkpoints take no {flag} (") \
                        and err.count("\n") == 1, (fmt, command, flag, err)
                    assert not list(tmp_path.iterdir()), (fmt, command, flag)    # nothing written
                for made in tmp_path.iterdir():
                    shutil.rmtree(made) if made.is_dir() else made.unlink()


def test_diff_gives_layout_rules_to_the_side_that_takes_them(tmp_path):
    """A Megatron-style save is read only with its rules; its export takes none. diff of the two reads each
    as it can, and refuses the rules (exit 2) only when neither side takes them."""
    megatron = fixture_dir("megatron_tp2_z1_fp32_dp2")
    exported = tmp_path / "m.safetensors"
    run_cli("export", megatron, exported, "--layout-rules", RULES, "--quiet", check=0)
    for a, b in ((megatron, exported), (exported, megatron)):
        proc = run_cli("diff", a, b, "--layout-rules", RULES, check=0)
        assert proc.stdout.strip().splitlines()[-1].startswith("no difference: 16 tensors"), proc.stdout
    proc = run_cli("diff", exported, exported, "--layout-rules", RULES, check=2)
    _one_line(proc, f"{exported}: safetensors checkpoints take no --layout-rules")
    run_cli("diff", exported, exported, check=0)                                      # control


def test_convert_of_a_format_no_writer_writes_asks_for_format(every_format, tmp_path):
    proc = run_cli("convert", every_format["torch"], tmp_path / "out", check=2)
    _one_line(proc, f"{every_format['torch']}: torch checkpoints are read, not written", "--format")
    proc = run_cli("convert", SRC, tmp_path / "out", "--format", "torch", check=2)
    _one_line(proc, "no writer for format 'torch'")
    assert not (tmp_path / "out").exists()
    run_cli("convert", every_format["torch"], tmp_path / "out", "--format", "dcp", "--quiet", check=0)   # control


# -- 7: a closed stdout -------------------------------------------------------------------------------------

CLOSED_STDOUT_COMMANDS = [
    ["inspect", SRC], ["inspect", SRC, "--json", "--params"], ["validate", SRC], ["validate", SRC, "--json"],
    ["plan", SRC, "--to", "dp=3"], ["plan", SRC, "--json"], ["diff", SRC, SRC], ["diff", SRC, SRC, "--json"],
    ["inspect", "/nonexistent", "--json"],      # the JSON error object meets the closed pipe too
]


def _with_closed_stdout(*args):
    """reshard ARGS in this process, its stdout a real pipe whose reading end is closed before the command
    writes to it (block-buffered, as a process's stdout on a pipe): (exit status, stderr)."""
    import reshard.cli
    read_end, write_end = os.pipe()
    os.close(read_end)
    err = io.StringIO()
    # main points the pipe's end at devnull when it meets the closed pipe: closing it after flushes nothing
    with open(write_end, "w") as stdout, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
        code = reshard.cli.main([str(a) for a in args])
    return code, err.getvalue()


@pytest.mark.parametrize("args", CLOSED_STDOUT_COMMANDS, ids=lambda a: " ".join(map(str, a[:1] + a[2:])))
def test_closed_stdout_ends_the_command_quietly(args):
    for _ in range(3):
        code, stderr = _with_closed_stdout(*args)
        if args[1] == "/nonexistent":   # the error line still goes to stderr; its exit status is the pipe's
            assert stderr.strip() == "reshard: /nonexistent: no such file or directory" and code == 141, stderr
        else:
            assert stderr == "" and code == 141, (code, stderr)


def test_closed_stdout_ends_the_process_quietly():
    """The same at the process boundary: the interpreter's own flush at exit meets no closed pipe again, and
    the process's status is 141 (one command: what each command prints is the in-process test's)."""
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "reshard", "inspect", str(SRC)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        proc.stdout.close()
        stderr = proc.stderr.read()
        proc.stderr.close()
        assert proc.wait() == 141 and stderr == "", stderr


def test_closed_stdout_after_convert_and_export_keeps_the_output(tmp_path):
    for i in range(3):
        code, stderr = _with_closed_stdout("convert", SRC, tmp_path / f"c{i}", "--to", "dp=3", "--json")
        assert code == 141 and "reshard:" not in stderr and "Traceback" not in stderr, stderr
        run_cli("validate", tmp_path / f"c{i}", "--checksums", check=0)      # written and committed whole
        code, stderr = _with_closed_stdout("export", SRC, tmp_path / f"e{i}.safetensors", "--json")
        assert code == 141 and "reshard:" not in stderr and "Traceback" not in stderr, stderr
        assert (tmp_path / f"e{i}.safetensors").is_file()


def test_stdout_read_to_the_end_is_exit_0():
    """Negative control of the above: an open pipe, read whole, sees everything and exit 0."""
    proc = run_cli("inspect", SRC, check=0)
    assert proc.stdout.startswith(str(SRC)) and proc.stderr == ""


# -- 9: --to FILE that is missing, --workers 0 ------------------------------------------------------------------

def test_missing_descriptor_file_says_so(tmp_path):
    proc = run_cli("convert", SRC, tmp_path / "out", "--to", tmp_path / "nothere.json", check=2)
    line = _one_line(proc, str(tmp_path / "nothere.json"), "no such layout descriptor file")
    assert "bad layout spec" not in line and not (tmp_path / "out").exists()
    proc = run_cli("plan", SRC, "--to", "nothere.json", check=2)
    _one_line(proc, "nothere.json: no such layout descriptor file")
    # negative controls: a typo inside a spec is still a spec error, an existing descriptor is read
    _one_line(run_cli("plan", SRC, "--to", "dp=3,zer=1", check=2), "bad layout spec")
    (tmp_path / "t.json").write_text(json.dumps({"kind": "reshard.core.layout", "version": 1, "dp": 3}))
    assert "dp=3" in run_cli("plan", SRC, "--to", tmp_path / "t.json", check=0).stdout


@pytest.mark.parametrize("workers", ["0", "-2", "two"])
def test_workers_must_be_positive(workers, tmp_path):
    proc = run_cli("convert", SRC, tmp_path / "out", "--to", "dp=3", "--workers", workers, check=2)
    assert "--workers" in proc.stderr and "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    run_cli("plan", SRC, "--workers", workers, check=2)
    assert "1 worker)" in run_cli("plan", SRC, "--workers", "1", check=0).stdout     # control


# -- 11: the summaries are the disk's numbers -------------------------------------------------------------------

@pytest.mark.parametrize("fmt, spec", [("deepspeed", "dp=3"), ("universal", "dp=2"), ("dcp", "dp=3")])
def test_plan_and_convert_summaries_match_the_disk(fmt, spec, tmp_path):
    out = tmp_path / "out"
    planned = json.loads(run_cli("plan", SRC, "--to", spec, "--format", fmt, "--json", check=0).stdout)
    line = run_cli("convert", SRC, out, "--to", spec, "--format", fmt, check=0).stdout.strip().splitlines()[-1]
    disk = _on_disk(out)
    listed = json.loads((out / "reshard-manifest.json").read_text())["files"]
    assert set(listed) == set(disk) - {"reshard-manifest.json"}
    # plan: every file with its real size (no 0 B for a file of pickled state only), the total theirs
    assert {f["path"]: f["bytes"] for f in planned["files"]} == {p: disk[p] for p in listed}
    assert planned["bytes_written"] == sum(disk[p] for p in listed) and all(f["bytes"] > 0 for f in planned["files"])
    # convert: count and bytes of those files, in the target format's own terms; the checkpoint files counted as
    # validate counts them, the others (pointers, scripts) named
    from reshard.commands.inspect import human_bytes
    counts = re.search(r": (\d+) checkpoint files(?: and (\d+) others? \(([^)]*)\))?, (.*)$", line)
    held, others, named = int(counts[1]), int(counts[2] or 0), (counts[3] or "").split(", ")
    assert held + others == len(listed) and counts[4] == human_bytes(sum(disk[p] for p in listed)), line
    assert others == 0 or set(named) < set(listed), line
    assert f"in {held} files" in run_cli("validate", out, check=0).stdout
    if fmt == "dcp":    # no ZeRO stage and no tag in DCP
        assert "zero=" not in line and "tag" not in line and "dcp dp=3" in line, line
        assert planned["tag"] is None and planned["target_topology"] == "dp=3"
    else:
        assert f"{spec},tp=1,pp=1,zero=2, tag global_step3" in line and planned["tag"] == "global_step3"


def test_plan_shows_the_bytes_each_worker_writes():
    """--workers K: the tensor bytes each worker copies, the largest file first to the least loaded one (as the
    pool's workers take them), summing to the plan's; the control: one worker, no such line."""
    from reshard.commands.inspect import human_bytes
    planned = json.loads(run_cli("plan", SRC, "--to", "dp=3", "--workers", "2", "--json", check=0).stdout)
    sizes = sorted((f.nbytes for f in reshard.plan(SRC, "dp=3").plan.files), reverse=True)
    expected = [0, 0]
    for size in sizes:
        expected[expected.index(min(expected))] += size
    assert len(sizes) > 2 and planned["workers"] == 2 and planned["worker_bytes"] == expected
    lines = run_cli("plan", SRC, "--to", "dp=3", "--workers", "2", check=0).stdout.splitlines()
    balance = max(expected) * 2 / sum(expected)
    assert [line for line in lines if line.startswith("workers")] == [
        f"workers  2 copying {human_bytes(expected[0])} | {human_bytes(expected[1])} of tensors (the largest "
        f"{balance:.2f}× an even split; a worker takes the largest file left)"]
    alone = run_cli("plan", SRC, "--to", "dp=3", check=0).stdout.splitlines()
    assert not [line for line in alone if line.startswith("workers")] and any("1 worker)" in line for line in alone)


def test_export_summary_matches_the_disk(tmp_path):
    line = run_cli("export", SRC, tmp_path / "m.safetensors", check=0).stdout.strip()
    from reshard.commands.inspect import human_bytes
    assert line.endswith(f": 1 checkpoint file, {human_bytes(os.path.getsize(tmp_path / 'm.safetensors'))}"), line
    line = run_cli("export", SRC, tmp_path / "hf", "--max-shard-size", "2KB", check=0).stdout.strip()
    listed = json.loads((tmp_path / "hf" / "reshard-manifest.json").read_text())["files"]
    size = sum(os.path.getsize(tmp_path / "hf" / p) for p in listed)
    held = int(re.search(r": (\d+) checkpoint files", line)[1])
    assert len(listed) > 2 and line.endswith(f", {human_bytes(size)}") and f"in {held} files" in \
        run_cli("validate", tmp_path / "hf", check=0).stdout, line


def test_torch_file_size_is_known_before_writing_also_with_zip64(tmp_path, monkeypatch):
    """The planned size of a torch.save archive is the written one, also where zipfile adds ZIP64 fields
    (a small limit stands in for the 2 GiB one); torch.load reads the archive."""
    from reshard.core.write_requests import Piece
    from reshard.formats.torchsave_write import TorchFileBuilder, TorchZip, pickle_tree
    from reshard.storage.posix_sink import HashingSink

    for limit in (None, 3000, 300):
        if limit:
            monkeypatch.setattr(zipfile, "ZIP64_LIMIT", limit)
        made = TorchFileBuilder("x.pt")
        file = made.build({f"t{i}": made.slot("float32", (n,), [Piece(n)]) for i, n in enumerate((3, 700, 1, 1500))})
        header = pickle_tree(file.tree)
        path = tmp_path / f"x{limit}.pt"
        with HashingSink(str(path)) as out, TorchZip().writer(out, header, file.slots) as writer:
            for slot in file.slots:
                with writer.storage(slot.key, slot.nbytes) as stream:
                    stream.write(bytes(slot.nbytes))
        assert TorchZip().file_size(header, file.slots) == os.path.getsize(path) == out.size, limit
        loaded = torch.load(path, weights_only=True)
        assert [v.numel() for v in loaded.values()] == [3, 700, 1, 1500]


# -- 14: --json for convert and export, JSON errors -------------------------------------------------------------

def test_convert_json_says_what_was_written(tmp_path):
    out = tmp_path / "out"
    data = json.loads(run_cli("convert", SRC, out, "--to", "dp=3", "--json", check=0).stdout)
    assert data["format"] == "deepspeed" and data["topology"] == "dp=3,tp=1,pp=1,zero=2"
    assert data["tag"] == truth_json("z2_fp32_dp2")["tag"] and data["path"] == str(out)
    assert data["manifest"] == str(out / "reshard-manifest.json")
    listed = json.loads(open(data["manifest"]).read())["files"]
    assert {os.path.relpath(f["path"], out): f["bytes"] for f in data["files"]} == \
        {p: os.path.getsize(out / p) for p in listed}
    assert data["bytes"] == sum(f["bytes"] for f in data["files"])
    dcp = json.loads(run_cli("convert", SRC, tmp_path / "dcp", "--format", "dcp", "--json", check=0).stdout)
    assert dcp["format"] == "dcp" and dcp["tag"] is None and dcp["topology"] == "dp=2"


def test_export_json_says_what_was_written(tmp_path):
    out = tmp_path / "m.pt"
    data = json.loads(run_cli("export", SRC, out, "--json", check=0).stdout)
    assert data["format"] == "torch" and data["tag"] is None and data["topology"] is None
    assert data["files"] == [{"path": str(out), "bytes": os.path.getsize(out)}]
    assert data["bytes"] == os.path.getsize(out)
    assert data["manifest"] == f"{out}.reshard-manifest.json" and os.path.isfile(data["manifest"])
    weights = torch.load(out, weights_only=True)
    truth = truth_tensors("z2_fp32_dp2")
    assert torch.equal(weights["l1.weight"], truth["fp32/l1.weight"])


@pytest.mark.parametrize("args, code", [
    (["inspect", "{missing}", "--json"], 1), (["validate", "{missing}", "--json"], 1),
    (["plan", "{missing}", "--json"], 1), (["diff", "{missing}", SRC, "--json"], 2),
    (["convert", "{missing}", "{tmp}/out", "--json"], 1), (["export", "{missing}", "{tmp}/m.safetensors", "--json"], 1),
], ids=lambda a: a[0] if isinstance(a, list) else str(a))
def test_json_error_is_an_object_on_stdout(args, code, tmp_path):
    missing = tmp_path / "missing"
    argv = [str(a).format(missing=missing, tmp=tmp_path) for a in args]
    proc = run_cli(*argv, check=code)
    line = _one_line(proc, str(missing))
    assert json.loads(proc.stdout) == {"error": line[len("reshard: "):], "file": str(missing)}
    # negative control: without --json, stdout stays empty
    assert run_cli(*argv[:-1], check=code).stdout == ""


def test_json_error_names_the_file_the_problem_is_about(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    proc = run_cli("convert", SRC, tmp_path / "busy", "--to", "dp=3", "--json", check=1)
    assert json.loads(proc.stdout)["file"] == str(tmp_path / "busy") and "not empty" in proc.stderr
    proc = run_cli("plan", SRC, "--to", "dp=3,zer=1", "--json", check=2)
    assert json.loads(proc.stdout) == {"error": _one_line(proc)[len("reshard: "):], "file": None}
    descriptor = tmp_path / "t.json"
    descriptor.write_text(json.dumps({"kind": "reshard.core.layout", "version": 1, "dp": 0}))
    proc = run_cli("plan", SRC, "--to", descriptor, "--json", check=2)
    assert json.loads(proc.stdout) == {"error": _one_line(proc, "dp must be")[len("reshard: "):],
                                       "file": str(descriptor)}


def test_ctrl_c_while_the_arguments_are_parsed_is_one_line(monkeypatch, capsys):
    import reshard.cli

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(reshard.cli, "build_parser", interrupted)
    assert reshard.cli.main(["inspect", str(SRC)]) == 130
    assert capsys.readouterr().err == "reshard: interrupted\n"


def test_a_source_without_a_zero_stage_is_told_to_name_one(tmp_path):
    run_cli("convert", SRC, tmp_path / "dcp", "--format", "dcp", "--quiet", check=0)
    proc = run_cli("convert", tmp_path / "dcp", tmp_path / "ds", "--format", "deepspeed", check=2)
    assert proc.stderr.count("\n") == 1 and "name one, e.g. --to zero=2" in proc.stderr, proc.stderr
    assert not (tmp_path / "ds").exists()
    run_cli("convert", tmp_path / "dcp", tmp_path / "ds", "--format", "deepspeed", "--to", "zero=2", "--quiet", check=0)
