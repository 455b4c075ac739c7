"""convert without the engine: complete outputs, N -> M -> N identity, the CLI's promises."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import reshard
from reshard.formats import target_layout
from reshard.formats.deepspeed import pickles as deepspeed_pickles, topology as ds
from tests.helpers.cli import run_cli
from tests.helpers.deepspeed_files import assert_same_tree, convert_and_open, covered_elements
from tests.helpers.fixtures import copy_fixture, fixture_dir, tag_dir, truth_json

TARGETS = [1, 2, 3, 5]


def _assert_same_tensors(a, b):
    assert set(a.tensors) == set(b.tensors)
    for name, state in a.tensors:
        assert torch.equal(reshard.full_tensor(a, name, state), reshard.full_tensor(b, name, state)), (name, state)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """convert(fixture, spec): its output, written once per fixture and spec; the tests that convert a fixture
    alike read that one output (none writes to it)."""
    root, made = tmp_path_factory.mktemp("converted"), {}

    def convert(name, spec):
        if (name, spec) not in made:
            made[name, spec] = root / f"{name}-{spec}"
            convert_and_open(fixture_dir(name), made[name, spec], spec)
        return made[name, spec]
    return convert


@pytest.mark.parametrize("dp", TARGETS)
def test_every_fixture_converts_to_a_complete_checkpoint(fixture_name, dp, converted):
    source = reshard.open_checkpoint(fixture_dir(fixture_name))
    out = reshard.open_checkpoint(converted(fixture_name, f"dp={dp}"))
    report = reshard.validate(out, deep=True)
    assert report.ok, report.problems
    assert out.layout.dp == dp and ds.of(out.layout).zero == ds.of(source.layout).zero
    assert out.contents().step == source.contents().step and out.training.global_steps == source.training.global_steps
    _assert_same_tensors(source, out)
    assert out.param_groups == source.param_groups and out.aliases == source.aliases


@pytest.mark.parametrize("dp", [1, 3])
def test_round_trip_gives_back_deepspeeds_own_files(fixture_name, dp, converted, tmp_path):
    """N -> M -> N: every file DeepSpeed wrote comes back: same objects, same tensor bytes but padding."""
    meta = truth_json(fixture_name)
    convert_and_open(converted(fixture_name, f"dp={dp}"), tmp_path / "n", f"dp={meta['world_size']}")
    original, back = tag_dir(fixture_dir(fixture_name)), tag_dir(tmp_path / "n")
    assert sorted(os.listdir(original)) == sorted(os.listdir(back))
    covered = covered_elements(reshard.open_checkpoint(fixture_dir(fixture_name)))
    for name in sorted(os.listdir(original)):
        ours = deepspeed_pickles.load(back / name)
        if "elastic" in fixture_name and "optim" in name:
            # the one addition: DeepSpeed's elastic loader needs it and DeepSpeed omits it for torch.optim.Adam
            assert ours["optimizer_state_dict"].pop("base_optimizer_state_step") == meta["step"]
        assert_same_tree(deepspeed_pickles.load(original / name), ours, name, covered)


STAGE_CHANGES = [("z1_fp32_dp2", 3), ("z3_fp32_dp2", 1), ("z2_fp32_dp2", 3), ("z3_bf16_dp4", 2),
                 ("z1_bf16_frozen_tied_dp2", 3), ("z3_fp32_frozen_tied_dp2", 2), ("z3_fp32_subgroup_dp2", 1),
                 ("bf16opt_z1_dp2", 3), ("z2_bf16_dp2", 1)]


@pytest.mark.parametrize("name, stage", STAGE_CHANGES)
def test_stage_changes_keep_every_tensor(name, stage, tmp_path):
    source = reshard.open_checkpoint(fixture_dir(name))
    out = convert_and_open(fixture_dir(name), tmp_path / "out", f"dp=3,zero={stage}")
    assert reshard.validate(out, deep=True).ok
    assert ds.of(out.layout).zero == stage
    for (param, state), _tensor in source.tensors.items():
        if stage == 3 and state == "module" and source.params[param].kind == "trainable":
            assert (param, state) not in out.tensors    # ZeRO-3 keeps no 16-bit copy of trainable params
            continue
        assert torch.equal(reshard.full_tensor(source, param, state), reshard.full_tensor(out, param, state))
    if ds.of(source.layout).zero == 3 and stage != 3:   # the 16-bit module copy is the master cast down
        for p in source.params.values():
            if p.kind == "trainable":
                master = reshard.full_tensor(source, p.name, "fp32")
                module = reshard.full_tensor(out, p.name, "module")
                assert torch.equal(master.to(module.dtype), module), p.name


def test_plan_cli_reports_topology_sizes_disk_and_batch_advice():
    out = run_cli("plan", fixture_dir("z2_fp32_dp4"), "--to", "dp=2", check=0).stdout
    for needle in ("dp=4,tp=1,pp=1,zero=2", "dp=2,tp=1,pp=1,zero=2", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                   "read", "write", "memory", "free", "train_batch_size 8 -> 4",
                   "gradient_accumulation_steps 1 -> 2"):
        assert needle in out, needle
    import json
    data = json.loads(run_cli("plan", fixture_dir("z2_fp32_dp4"), "--to", "dp=3", "--json", check=0).stdout)
    assert data["target_topology"] == "dp=3,tp=1,pp=1,zero=2" and data["bytes_written"] > 0 and data["disk_ok"]


def test_convert_refuses_what_it_must(tmp_path):
    src = fixture_dir("z2_fp32_dp2")
    for spec, needle, code in (("tp=2", "not an AutoTP run", 1), ("pp=2", "not a PipelineModule", 1),
                               ("dp=0", "dp is a whole number, 1 or more", 2), ("zero=0", "zero is 1, 2 or 3", 2),
                               ("gpus=3", "bad layout spec", 2)):
        proc = run_cli("convert", src, tmp_path / "x", "--to", spec, check=code)
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "x").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("x")
    proc = run_cli("convert", src, busy, "--to", "dp=3", check=1)
    assert "not empty" in proc.stderr and (busy / "keep").exists()
    run_cli("convert", src, busy, "--to", "dp=3", "--overwrite", "--quiet", check=0)
    assert not (busy / "keep").exists() and reshard.validate(reshard.open_checkpoint(busy)).ok
    inside = run_cli("convert", src, src / "nested", "--to", "dp=3", check=1)
    assert "overlaps the source" in inside.stderr
    dry = run_cli("convert", src, tmp_path / "dry", "--to", "dp=3", "--dry-run", check=0)
    assert "zero_pp_rank_2" in dry.stdout and not (tmp_path / "dry").exists()


def test_a_to_key_the_output_format_has_no_place_for_is_a_usage_error(tmp_path):
    """DCP output has no ZeRO stage or model parallelism: asking for one is refused, never silently dropped."""
    src = fixture_dir("z2_fp32_dp2")
    for spec, named in (("dp=2,zero=3", "no zero"), ("kv_heads=4,zero=1", "no kv_heads or zero")):
        proc = run_cli("convert", src, tmp_path / "x", "--format", "dcp", "--to", spec, check=2)
        assert named in proc.stderr and "written at dp" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    run_cli("convert", src, tmp_path / "x", "--format", "dcp", "--to", "dp=3", "--quiet", check=0)


def test_incomplete_source_is_refused_and_nothing_is_written(tmp_path):
    save = copy_fixture("z2_fp32_dp2", tmp_path)
    (tag_dir(save) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    proc = run_cli("convert", save, tmp_path / "out", "--to", "dp=3", check=1)
    assert "not complete" in proc.stderr and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "reshard-tmp" in p.name]


def test_source_is_never_modified(tmp_path):
    save = copy_fixture("z3_bf16_dp4", tmp_path)
    before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
    stat = {p: p.stat().st_mtime_ns for p in before}
    run_cli("convert", save, tmp_path / "out", "--to", "dp=3,zero=1", "--workers", "2", "--quiet", check=0)
    assert {p: p.read_bytes() for p in before} == before
    assert {p: p.stat().st_mtime_ns for p in before} == stat
    assert reshard.validate(reshard.open_checkpoint(tmp_path / "out"), deep=True).ok


def _tree_bytes(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("workers", [1, 2])
def test_files_in_memory_are_written_from_the_blocks_and_are_the_same_bytes(tmp_path, monkeypatch, workers):
    """A file in memory (tmpfs) is written straight from the blocks read, without the copy into the sink's ring, and
    not reserved (reshard.storage.posix_sink): a conversion written so (the sink told its files are in memory, its
    block cut to 256 bytes so these small tensors take that path; into /dev/shm too where there is one) is byte for byte
    the one written through the ring to disk, and validate --checksums passes on it; the control: a byte of it
    changed, validate --checksums fails naming the file."""
    from reshard.storage import posix_sink
    src = fixture_dir("z3_fp32_frozen_tied_dp2")
    reshard.convert(src, tmp_path / "ring", "dp=3,zero=2")
    through = []
    write_through = posix_sink.HashingSink._write_through

    def noted(sink, view):
        through.append(len(view))
        write_through(sink, view)
    monkeypatch.setattr(posix_sink, "BLOCK", 256)
    monkeypatch.setattr(posix_sink, "in_memory", lambda fd: True)
    monkeypatch.setattr(posix_sink.HashingSink, "_write_through", noted)
    places = [tmp_path / "memory"] + ([Path(tempfile.mkdtemp(dir="/dev/shm")) / "out"]
                                      if os.path.isdir("/dev/shm") else [])
    try:
        for out in places:
            reshard.convert(src, out, "dp=3,zero=2", workers=workers)
            assert _tree_bytes(out) == _tree_bytes(tmp_path / "ring")
            assert reshard.validate(out, checksums=True).ok
        assert through or workers > 1       # (worker processes append to their own copy of the list)
        victim = max((p for p in places[0].rglob("*.pt")), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
        report = reshard.validate(places[0], checksums=True)
        assert not report.ok and any(str(victim) in str(problem) for problem in report.problems)
    finally:
        for out in places[1:]:
            shutil.rmtree(out.parent, ignore_errors=True)


def test_workers_descriptor_and_tag_out(tmp_path):
    """--workers K writes the same bytes as one process; a layout file works as SPEC; --tag-out names the tag."""
    src = fixture_dir("z3_fp32_frozen_tied_dp2")
    run_cli("convert", src, tmp_path / "one", "--to", "dp=3,zero=2", "--quiet", check=0)
    run_cli("convert", src, tmp_path / "three", "--to", "dp=3,zero=2", "--workers", "3", "--quiet", check=0)
    assert _tree_bytes(tmp_path / "one") == _tree_bytes(tmp_path / "three")

    layout = target_layout(reshard.open_checkpoint(src).layout, "dp=3,zero=2", "deepspeed")
    layout.save(tmp_path / "target.json")
    run_cli("convert", src, tmp_path / "described", "--to", tmp_path / "target.json", "--quiet", check=0)
    assert _tree_bytes(tmp_path / "one") == _tree_bytes(tmp_path / "described")

    run_cli("convert", src, tmp_path / "renamed", "--to", "dp=1", "--tag-out", "resharded", "--quiet",
            "--memory-budget", "1MiB", check=0)
    assert (tmp_path / "renamed" / "latest").read_text().strip() == "resharded"
    assert reshard.open_checkpoint(tmp_path / "renamed").tag == "resharded"
    assert run_cli("convert", src, tmp_path / "x", "--to", "dp=2", "--memory-budget", "lots").returncode == 2


@pytest.mark.parametrize("digest", ["blake3", "sha256", "xxh3-128"])
def test_manifest_records_every_file_and_validate_checks_it(tmp_path, digest):
    """Every file's size and digest, BLAKE3 by default, sha256 with --digest sha256 (what sha256sum prints) or XXH3-128
    (xxh128sum's), each checked by validate --checksums; the controls: a flipped byte and a longer file caught."""
    import hashlib
    import json

    import blake3
    import xxhash
    out = tmp_path / "out"
    chosen = () if digest == "blake3" else ("--digest", digest)
    run_cli("convert", fixture_dir("z2_fp32_dp2"), out, "--to", "dp=3", "--quiet", *chosen, check=0)
    manifest = json.loads((out / "reshard-manifest.json").read_text())
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"reshard-manifest.json"}
    assert set(manifest["files"]) == files
    reference = {"blake3": blake3.blake3, "sha256": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}[digest]
    for rel, entry in manifest["files"].items():
        data = (out / rel).read_bytes()
        assert entry == {"size": len(data), digest: reference(data).hexdigest()}
    assert manifest["source"]["topology"] == "dp=2,tp=1,pp=1,zero=2" and manifest["reshard_version"]
    assert "files checked against" in run_cli("validate", out, "--checksums", check=0).stdout

    victim = out / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[-200] ^= 0xFF          # same size, one flipped byte in the zip's central directory
    victim.write_bytes(bytes(data))
    proc = run_cli("validate", out, "--checksums", check=1)
    assert any(str(victim) in line and digest in line for line in proc.stdout.splitlines()), proc.stdout
    victim.write_bytes(bytes(data) + b"x")
    proc = run_cli("validate", out, check=1)    # sizes are checked even without --checksums
    assert any(str(victim) in line and "manifest says" in line for line in proc.stdout.splitlines())
