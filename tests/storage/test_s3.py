"""Checkpoints in object storage: every command given an s3:// URL, against a real S3 server (SeaweedFS `weed
mini`, conftest.s3_server), with boto3 itself (tools/s3_server.py: upload, download) putting the sources there and
fetching the results for the real consumers. The engine's resume of what was converted in the bucket is in
tests/storage/test_s3_engine.py.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import s3_server as servers
from tests.helpers.cli import run_cli
from tests.helpers.fixtures import fixture_dir, truth_tensors
from tests.helpers.repo import REPO, SCRIPTS

pytestmark = pytest.mark.s3
FIXTURE = "z2_fp32_dp2"


@pytest.fixture(scope="module")
def source(s3_server):
    """The fixture's save dir uploaded (by boto3) under src/; its URL."""
    return servers.upload(s3_server, str(fixture_dir(FIXTURE)), f"src/{FIXTURE}")


def _same(remote, url, local, folder) -> None:
    """The command's output for the URL is its output for the local copy, the names aside."""
    assert remote.returncode == local.returncode == 0, remote.stderr + local.stderr
    assert remote.stdout.replace(url, "SRC") == local.stdout.replace(str(folder), "SRC")


@pytest.mark.parametrize("command", [["inspect"], ["validate", "--deep", "--checksums"], ["inspect", "--json"]])
def test_inspect_and_validate_read_a_bucket_as_they_read_a_disk(s3, source, command):
    folder = fixture_dir(FIXTURE)
    _same(run_cli(*command, source), source, run_cli(*command, folder), folder)


def test_plan_from_a_bucket_is_the_plan_from_disk(s3, source):
    folder = fixture_dir(FIXTURE)
    remote, local = (run_cli("plan", where, "--to", "dp=3", check=0) for where in (source, folder))
    free = [line for line in remote.stdout.splitlines() if not line.startswith("disk ")]
    assert free == [line for line in local.stdout.replace(str(folder), source).splitlines()
                    if not line.startswith("disk ")]


def test_plan_for_a_bucket_destination_needs_no_local_disk(s3, source, tmp_path):
    """`plan --dst s3://…` says no local disk is needed and checks none; the control, a local --dst, states its
    free space."""
    dst = s3.url("out/planned")
    text = run_cli("plan", source, "--to", "dp=3", "--dst", dst, check=0).stdout
    assert f"disk     none needed: the output goes to object storage at {dst}" in text, text
    data = json.loads(run_cli("plan", source, "--to", "dp=3", "--dst", dst, "--json", check=0).stdout)
    assert data["free_disk_bytes"] is None and data["disk_ok"] is True and data["free_disk_at"] == dst
    local = run_cli("plan", source, "--to", "dp=3", "--dst", tmp_path / "dp3", check=0).stdout
    assert f"free at {tmp_path}: enough" in local, local
    assert not servers.keys(s3, "out/planned")


def test_diff_of_a_bucket_and_its_local_copy_finds_them_equal(s3, source):
    proc = run_cli("diff", source, fixture_dir(FIXTURE), "--json", check=0)
    assert json.loads(proc.stdout)["equal"] is True


def _digests(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file() and p.name != "reshard-manifest.json"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The local conversion every other route must equal, byte for byte."""
    out = tmp_path_factory.mktemp("s3-reference") / "dp3"
    run_cli("convert", fixture_dir(FIXTURE), out, "--to", "dp=3", "--quiet", check=0)
    return _digests(out)


def _calls(*argv) -> list:
    """The S3 operations `reshard ARGV` (in this process) asked the server for, (name, key), seen on the client's
    own event hook."""
    from reshard.storage import s3 as objects
    calls: list = []

    def note(model, params, **_):
        calls.append((model.name, params.get("Key")))
    client = objects.client()
    client.meta.events.register("before-parameter-build.s3.*", note)
    try:
        run_cli(*argv, check=0)
    finally:
        client.meta.events.unregister("before-parameter-build.s3.*", note)
    return calls


def test_convert_bucket_to_bucket_to_disk_and_disk_to_bucket_write_the_same_bytes(s3, source, reference, tmp_path):
    # a new destination is written in place and committed by its manifest: no object is copied server-side
    # (the files carried over as they are, DeepSpeed's scripts, are the only objects copied)
    calls = _calls("convert", source, s3.url("out/s3-to-s3"), "--to", "dp=3", "--quiet")
    copied = [key for name, key in calls if name in ("CopyObject", "UploadPartCopy")]
    assert ("PutObject", "out/s3-to-s3/global_step3/mp_rank_00_model_states.pt") in calls, calls
    assert sorted(copied) == ["out/s3-to-s3/zero_to_fp32.py", "out/s3-to-s3/zero_to_torch.py"], copied
    # replacing it is staged beside it and copied into place (the old one whole until the new one is)
    calls = _calls("convert", source, s3.url("out/s3-to-s3"), "--to", "dp=3", "--quiet", "--overwrite")
    assert ("CopyObject", "out/s3-to-s3/global_step3/mp_rank_00_model_states.pt") in calls, calls
    run_cli("convert", fixture_dir(FIXTURE), s3.url("out/disk-to-s3"), "--to", "dp=3", "--quiet", check=0)
    run_cli("convert", source, tmp_path / "s3-to-disk", "--to", "dp=3", "--quiet", check=0)
    assert _digests(tmp_path / "s3-to-disk") == reference
    for prefix in ("out/s3-to-s3", "out/disk-to-s3"):
        keys = servers.download(s3, prefix, str(tmp_path / prefix))
        assert f"{prefix}/reshard-manifest.json" in keys
        assert _digests(tmp_path / prefix) == reference, prefix
        assert not [k for k in servers.keys(s3, "out/") if "reshard-tmp" in k or "reshard-lock" in k]
        # validate --checksums re-reads every object against the manifest
        run_cli("validate", "--checksums", s3.url(prefix), check=0)


def test_export_from_a_bucket_is_what_from_pretrained_reads(s3, source, tmp_path):
    run_cli("export", source, tmp_path / "s3.safetensors", "--quiet", check=0)
    # and into the bucket: one object and its manifest beside it, fetched by boto3 for safetensors to read
    run_cli("export", source, s3.url("exports/model.safetensors"), "--quiet", check=0)
    assert servers.keys(s3, "exports/") == ["exports/model.safetensors",
                                            "exports/model.safetensors.reshard-manifest.json"]
    servers.download(s3, "exports", str(tmp_path / "exports"))
    run_cli("export", fixture_dir(FIXTURE), tmp_path / "disk.safetensors", "--quiet", check=0)
    ours, theirs, truth = (load_file(str(tmp_path / "s3.safetensors")), load_file(str(tmp_path / "disk.safetensors")),
                           truth_tensors(FIXTURE))
    into_bucket = load_file(str(tmp_path / "exports" / "model.safetensors"))
    assert into_bucket.keys() == ours.keys() and all(torch.equal(into_bucket[k], v) for k, v in ours.items())
    assert ours.keys() == theirs.keys() and ours
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
        if f"module/{key}" in truth:
            assert torch.equal(value, truth[f"module/{key}"]), key


def _one_line(proc, url: str) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert url in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("variable", ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"])
def test_wrong_credentials_are_one_line_naming_the_url(s3, source, monkeypatch, variable):
    monkeypatch.setenv(variable, "wrong")
    assert "access denied" in _one_line(run_cli("inspect", source), source)


def test_no_such_bucket_is_one_line_naming_the_url(s3, tmp_path):
    url = "s3://reshard-no-such-bucket/run"
    assert "no such bucket" in _one_line(run_cli("inspect", url), url)
    assert "no such bucket" in _one_line(run_cli("convert", fixture_dir(FIXTURE), url, "--to", "dp=1"), url)


def _faulty(fault: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "s3_kill_driver.py"), fault, *map(str, argv)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_an_upload_failing_mid_file_aborts_its_parts_and_leaves_nothing(s3, source):
    """The 2nd part's upload refused: one line naming the file, exit 1; no object at the destination, no staging
    object and no upload left open (its parts aborted)."""
    dst = s3.url("out/failed")
    failed = _faulty("fail:2", "convert", source, dst, "--to", "dp=3", "--quiet")
    assert failed.returncode == 1 and "injected upload failure" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr and failed.stderr.count("\n") == 1, failed.stderr
    assert not [k for k in servers.keys(s3, "out/") if "failed" in k]
    assert servers.uploads(s3, "out/") == []


def test_a_convert_killed_mid_upload_leaves_nothing_complete_and_resume_finishes_it(s3, source, reference, tmp_path):
    """SIGKILL at the 3rd part a multipart upload sends (tests/scripts/s3_kill_driver.py makes parts small), the output
    written in place: its unfinished marker is there and no manifest, so validate refuses it, `list` of the run
    prefix says it is in progress and `prune --delete-incomplete --yes` leaves it alone; --resume keeps the objects
    the journal lists whole and completes it byte for byte, leaving no marker, journal, staging object or open
    upload. The control: once finished, `list` says complete."""
    from reshard.storage.names import UNFINISHED
    run, dst = s3.url("killrun"), s3.url("killrun/ckpt-dp3")
    killed = _faulty("kill:3", "convert", source, dst, "--to", "dp=3", "--quiet")
    assert killed.returncode == -9, killed.stderr
    left = servers.keys(s3, "killrun/")
    assert f"killrun/ckpt-dp3/{UNFINISHED}" in left and "killrun/ckpt-dp3/reshard-manifest.json" not in left, left
    assert servers.uploads(s3, "killrun/"), "the kill was not mid-upload"
    assert "has not finished" in _one_line(run_cli("validate", dst), dst)
    assert [(name, state) for name, _, state, _, _ in _listed(run)] == [("ckpt-dp3", "in progress")]
    run_cli("prune", run, "--delete-incomplete", "--recent", "0", "--yes", check=0)
    assert servers.keys(s3, "killrun/") == left
    run_cli("convert", source, dst, "--to", "dp=3", "--quiet", "--resume", check=0)
    run_cli("validate", "--checksums", dst, check=0)
    servers.download(s3, "killrun/ckpt-dp3", str(tmp_path / "killed"))
    assert _digests(tmp_path / "killed") == reference
    assert servers.uploads(s3, "killrun/") == []
    assert not [k for k in servers.keys(s3, "killrun/") if "reshard-" in k and not k.endswith("reshard-manifest.json")]
    assert [(name, state) for name, _, state, _, _ in _listed(run)] == [("ckpt-dp3/global_step3", "complete")]


def test_resume_keeps_the_objects_a_killed_convert_journaled_and_writes_the_rest(s3, source, reference, tmp_path):
    """SIGKILL once the 2nd file is journaled: --resume writes none of the objects the journal lists (each read
    back, its sha256 matching) and every other one, and the result is byte for byte the local conversion's."""
    dst = s3.url("out/journaled")
    killed = _faulty("journaled:2", "convert", source, dst, "--to", "dp=3", "--quiet")
    assert killed.returncode == -9, killed.stderr
    whole = [k for k in servers.keys(s3, "out/journaled/") if "/global_step" in k]
    assert len(whole) == 2, whole
    tag = f"{dst}/global_step3"     # a tag folder of it, its output's marker a folder up, is no checkpoint either
    assert "has not finished" in _one_line(run_cli("inspect", tag), tag)
    writes = {key for name, key in _calls("convert", source, dst, "--to", "dp=3", "--quiet", "--resume")
              if name in ("PutObject", "CreateMultipartUpload")}
    written = {k for k in servers.keys(s3, "out/journaled/") if "/global_step" in k}
    assert writes & written == written - set(whole), (whole, writes)    # kept, not written again; the rest written
    servers.download(s3, "out/journaled", str(tmp_path / "journaled"))
    assert _digests(tmp_path / "journaled") == reference


def _dcp_loaded(where) -> dict:
    """dcp.load (torch's own) of everything the checkpoint at `where` serves, through reshard.dcp_reader.Reader,
    into tensors of the metadata's shapes filled with NaN."""
    import torch.distributed.checkpoint as dcp

    import reshard.dcp_reader
    metadata = reshard.dcp_reader.Reader(where).read_metadata()
    flat = {key: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype)
            if m.properties.dtype.is_floating_point else torch.zeros(tuple(m.size), dtype=m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(flat, storage_reader=reshard.dcp_reader.Reader(where))
    return flat


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_through_the_reader_from_a_bucket_gives_the_engine_truth(s3, source, monkeypatch):
    ours, theirs, truth = _dcp_loaded(source), _dcp_loaded(fixture_dir(FIXTURE)), truth_tensors(FIXTURE)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, equal_nan=True, msg=key)
    masters = {k.split("/", 1)[1]: v for k, v in truth.items() if k.startswith("fp32/")}
    assert masters and all(torch.equal(ours[f"model.{name}"], value) for name, value in masters.items())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")      # the control: the same URL, refused
    import reshard.dcp_reader
    from reshard.errors import ReshardError
    with pytest.raises(ReshardError, match="access denied"):
        reshard.dcp_reader.Reader(source)


def test_reshard_imports_no_s3_client_until_a_url_is_used():
    """The base install needs no boto3: `import reshard` and a local command import none of it."""
    code = ("import sys; import reshard, reshard.api, reshard.cli; from reshard.cli import main; "
            f"main(['inspect', {str(fixture_dir(FIXTURE))!r}]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 's3transfer')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout


def test_a_destination_another_writer_holds_is_refused(s3, source):
    """The lock object (a conditional PUT) of a convert running on another host: refused in one line, nothing
    written."""
    dst, lock = s3.url("out/locked"), "out/.locked.reshard-lock"
    servers.put(s3, lock, json.dumps({"host": "another-host", "pid": 1}).encode())
    try:
        assert "another reshard is writing it" in _one_line(run_cli("convert", source, dst, "--to", "dp=1"), dst)
        assert servers.keys(s3, "out/locked") == []
    finally:
        servers.delete(s3, lock)


def test_a_convert_fetches_each_source_byte_once_joining_adjacent_reads(s3, source, tmp_path):
    """The GETs a convert makes (counted on the client's own event hook): no two ranges of an object overlap,
    and reads side by side share a request (fewer GETs than reads; each range only what is read)."""
    import reshard
    from reshard.commands.convert import make_plan
    from reshard.execution.executor import execute
    from reshard.storage import s3 as objects
    plan = make_plan(reshard.open_checkpoint(source), "dp=3")
    reads = sum(len(r) for f in plan.files for r in f.source_reads().values())
    gets = []

    def note(params, **_):
        gets.append((params["url_path"], params["headers"].get("Range")))     # (the request as it is sent)
    client = objects.client()
    client.meta.events.register("before-call.s3.GetObject", note)
    try:
        execute(plan, str(tmp_path / "out"), progress=False)
    finally:
        client.meta.events.unregister("before-call.s3.GetObject", note)
    by_key = {}
    for key, text in gets:
        first, last = (int(x) for x in text.removeprefix("bytes=").split("-"))
        by_key.setdefault(key, []).append((first, last + 1))
    for key, ranges in by_key.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)), (key, ranges)
    data = sum(len(r) for k, r in by_key.items() if "optim_states" in k or "model_states" in k)
    assert 0 < data < reads, (data, reads)


def _reads(monkeypatch) -> list:
    """The size of every read reshard's S3 source storage is asked for from now on (each a buffer of that size in
    memory: a window too is one), noted on reshard.storage.s3.ObjectSource.read_into."""
    from reshard.storage import s3 as objects
    sizes: list = []
    original = objects.ObjectSource.read_into

    def noted(self, path, offset, out):
        sizes.append(memoryview(out).nbytes)
        return original(self, path, offset, out)
    monkeypatch.setattr(objects.ObjectSource, "read_into", noted)
    return sizes


def test_validate_deep_and_diff_read_a_bucket_in_bounded_windows(s3, source, monkeypatch):
    """With the windows made 256 bytes, no read validate --deep or diff asks of the object store is bigger, and
    they say what they say of the local copy; the control, the default windows, reads bigger pieces (so the
    fixture's fragments are bigger than the window, and the bound is no accident)."""
    from reshard.commands import diff as comparison
    from reshard.reading import source_bytes
    reads = _reads(monkeypatch)
    run_cli("validate", source, "--deep", check=0)
    assert max(reads) > 256, max(reads)
    reads.clear()
    monkeypatch.setattr(source_bytes, "WINDOW_BYTES", 256)
    monkeypatch.setattr(comparison, "BLOCK", 64)      # fp32 elements: 256 bytes a side
    folder = fixture_dir(FIXTURE)
    _same(run_cli("validate", source, "--deep"), source, run_cli("validate", folder, "--deep"), folder)
    assert json.loads(run_cli("diff", source, folder, "--json", check=0).stdout)["equal"] is True
    assert reads and max(reads) <= 256, max(reads)


def test_a_sparse_gather_from_a_bucket_reads_in_bounded_slabs(s3, monkeypatch):
    """A column slice of a wide matrix (a sparse box: its span is 16 times its bytes), gathered from an object
    by reshard.execution.target_bytes.SourceFiles, is numpy's slice of it, read in slabs no bigger than the window; the
    control, a big window, reads the whole span at once."""
    import numpy as np

    from reshard.execution import target_bytes
    from reshard.storage.routing import sources
    matrix = np.arange(64 * 512, dtype=np.float32).reshape(64, 512)
    servers.put(s3, "sparse/matrix.bin", matrix.tobytes())
    url = s3.url("sparse/matrix.bin")
    reads = _reads(monkeypatch)
    for window, largest in ((4096, 4096), (1 << 30, matrix.nbytes)):
        monkeypatch.setattr(target_bytes, "WINDOW_BYTES", window)
        reads.clear()
        files = target_bytes.SourceFiles({}, storage=sources())
        try:
            out = np.full((64, 32), np.nan, dtype=np.float32)
            files.copy_box(out, url, 100 * 4, (512, 1), "float32", "float32")
        finally:
            files.close()
        assert np.array_equal(out, matrix[:, 100:132]), window
        assert max(reads) <= largest and (window > 4096 or len(reads) > 1), (window, reads)
    assert reads == [(63 * 512 + 32) * 4]       # the control: the span whole


def test_a_prefix_emptied_by_a_delete_is_no_folder(s3):
    """The server keeps the folder of a deleted object's prefix (SeaweedFS's filer, as some stores do) and lists it
    among the common prefixes; reshard lists only prefixes holding objects, as isdir and isfile find them, so a
    pruned `epoch=0-step=2.ckpt/` is not then taken for a file."""
    from reshard.storage import files as fs
    prefix = "emptied"
    for key in ("kept.ckpt/a", "gone.ckpt/a", "gone.ckpt/sub/b", "top"):
        servers.put(s3, f"{prefix}/{key}", b"x")
    for key in ("gone.ckpt/a", "gone.ckpt/sub/b"):
        servers.delete(s3, f"{prefix}/{key}")
    url = s3.url(prefix)
    assert sorted(fs.listdir(url)) == ["kept.ckpt", "top"]
    assert not fs.exists(f"{url}/gone.ckpt") and fs.isdir(f"{url}/kept.ckpt")
    with pytest.raises(FileNotFoundError):
        fs.listdir(f"{url}/gone.ckpt")


# -- a run prefix: list and prune ----------------------------------------------------------------------------------

@pytest.fixture
def run_prefix(s3, request):
    """The fixture's save dir (global_step2, global_step3, `latest` naming 3) under a prefix of this test's own."""
    prefix = f"runs/{request.node.name}"
    return prefix, servers.upload(s3, str(fixture_dir(FIXTURE)), prefix)


def _listed(where) -> list:
    listed = run_cli("list", where, "--recent", "0", "--json")
    rows = json.loads(listed.stdout)["checkpoints"]
    # exit 1 exactly when an incomplete checkpoint is shown (--json unchanged)
    assert listed.returncode == int(any(r["status"] == "incomplete" for r in rows)), listed.stderr
    return [(r["name"], r["step"], r["status"], r["files"], r["bytes"]) for r in rows]


def test_list_of_a_run_prefix_is_the_list_of_its_local_copy(run_prefix):
    _, url = run_prefix
    assert _listed(url) == _listed(fixture_dir(FIXTURE)) and len(_listed(url)) == 2


def test_a_staged_or_broken_checkpoint_in_a_bucket_is_never_complete(s3, run_prefix):
    """What a killed convert leaves (its staging prefix, or its unfinished marker and no manifest) is in progress,
    unless a later step's checkpoint is complete (abandoned: incomplete); a checkpoint missing a rank file is
    incomplete; prune --delete-incomplete leaves what is in progress alone."""
    prefix, url = run_prefix
    tag = fixture_dir(FIXTURE) / "global_step2"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        servers.put(s3, f"{prefix}/.global_step9.reshard-tmp/global_step9/{name}", (tag / name).read_bytes())
    servers.delete(s3, f"{prefix}/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    # conversions written in place (their unfinished marker, no manifest), every file there: step 8 is later than
    # the newest complete checkpoint (in progress); step 1 is older (abandoned, as a staging folder is on disk)
    from reshard.storage.names import UNFINISHED
    for step in (1, 8):
        servers.put(s3, f"{prefix}/global_step{step}/{UNFINISHED}", b"{}")
        for name in (tag.iterdir()):
            servers.put(s3, f"{prefix}/global_step{step}/{name.name}", name.read_bytes())
    status = {name: state for name, _, state, _, _ in _listed(url)}
    assert status == {".global_step9.reshard-tmp": "in progress", "global_step2": "incomplete",
                      "global_step3": "complete", "global_step8": "in progress", "global_step1": "incomplete"}, status
    run_cli("prune", url, "--delete-incomplete", "--recent", "0", "--yes", check=0)
    keys = servers.keys(s3, prefix + "/")
    assert not [k for k in keys if "/global_step2/" in k or "/global_step1/" in k]
    assert [k for k in keys if ".global_step9.reshard-tmp" in k] and [k for k in keys if "/global_step3/" in k]
    assert f"{prefix}/global_step8/{UNFINISHED}" in keys


def test_prune_of_a_run_prefix_keeps_the_newest_deletes_in_batches_and_a_dry_run_deletes_nothing(s3, run_prefix):
    prefix, url = run_prefix
    before = servers.keys(s3, prefix + "/")
    dry = run_cli("prune", url, "--keep-last", "1", "--recent", "0", check=0)
    assert "dry run" in dry.stdout and servers.keys(s3, prefix + "/") == before
    # keep only step 2: the newest complete (3) is kept all the same
    plan = json.loads(run_cli("prune", url, "--keep-steps", "2", "--recent", "0", "--json", check=0).stdout)
    assert {d["name"]: d["action"] for d in plan["decisions"]} == {"global_step2": "keep", "global_step3": "keep"}
    calls = [name for name, _ in _calls("prune", url, "--keep-last", "1", "--recent", "0", "--yes")]
    after = servers.keys(s3, prefix + "/")
    assert after == [k for k in before if "/global_step2/" not in k]
    assert calls.count("DeleteObjects") >= 1 and "DeleteObject" not in calls, calls
    assert [name for name, *_ in _listed(url)] == ["global_step3"]


def test_watch_of_a_run_prefix_reports_each_checkpoint_once_and_prunes_keeping_the_newest(s3, run_prefix):
    """One pass reports both checkpoints and prunes to the last one, its state an object in the run prefix (its
    lock gone after); a restarted watcher reports nothing again; without its state (the control) it reports
    what is there again."""
    from reshard.storage.names import WATCH_LOCK, WATCH_STATE
    prefix, url = run_prefix
    done = "{}: validated {} ({} complete, 0 incomplete), kept 0 unverifiable or unknown unread, left 0 in " \
           "progress, deleted {}"
    first = run_cli("watch", url, "--once", "--recent", "0", "--keep-last", "1", "--settle", "0", check=0)
    assert "global_step2" in first.stdout and "global_step3" in first.stdout, first.stdout
    assert first.stdout.splitlines()[-1] == done.format(url, "2 checkpoints", 2, 1), first.stdout
    keys = servers.keys(s3, prefix + "/")
    assert f"{prefix}/{WATCH_STATE}" in keys and f"{prefix}/{WATCH_LOCK}" not in keys
    assert not [k for k in keys if "/global_step2/" in k] and [k for k in keys if "/global_step3/" in k]
    again = run_cli("watch", url, "--once", "--recent", "0", "--settle", "0", check=0)
    assert again.stdout.splitlines()[-1] == done.format(url, "0 checkpoints", 0, 0), again.stdout
    servers.delete(s3, f"{prefix}/{WATCH_STATE}")
    control = run_cli("watch", url, "--once", "--recent", "0", "--settle", "0", check=0)
    assert control.stdout.splitlines()[-1] == done.format(url, "1 checkpoint", 1, 0), control.stdout


def test_torchrun_ranks_share_a_bucket_to_bucket_convert(s3, source, reference, tmp_path):
    """2 ranks (forked as torchrun's), no shared filesystem between them but the bucket: each writes its share,
    rank 0 commits; the bytes are the single process's."""
    from tests.helpers.torchrun import torchrun
    dst = s3.url("out/torchrun")
    proc = torchrun(2, "-m", "reshard", "convert", source, dst, "--to", "dp=3", "--quiet", check=False,
                    deepspeed=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    servers.download(s3, "out/torchrun", str(tmp_path / "torchrun"))
    assert _digests(tmp_path / "torchrun") == reference
    assert not [k for k in servers.keys(s3, "out/") if "torchrun.reshard" in k]


def test_a_bucket_itself_is_no_destination(s3, source):
    proc = run_cli("convert", source, s3.url(), "--to", "dp=1")
    assert proc.returncode == 2 and "name a prefix in it" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(REPO / "s3:")


def test_reads_cut_off_or_throttled_are_fetched_again(s3, source, monkeypatch):
    """A connection cut in the middle of a GET's body and a 503 SlowDown (tests/helpers/s3_faults.py, a relay in front
    of the server): `validate --deep` reads every byte again as from the local copy. The control: the same faults reach
    a client that does not retry (botocore with one attempt) as errors."""
    import boto3
    import botocore.config
    import botocore.exceptions

    from tests.helpers.s3_faults import FaultyRelay
    faults = ["reset", "throttle", "reset", "throttle"]
    relay = FaultyRelay(s3.endpoint, faults)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
        _same(run_cli("validate", "--deep", source), source, run_cli("validate", "--deep", fixture_dir(FIXTURE)),
              fixture_dir(FIXTURE))
        assert relay.injected == faults
        bare = boto3.client("s3", endpoint_url=relay.endpoint, config=botocore.config.Config(
            retries={"total_max_attempts": 1, "mode": "standard"}))
        bucket, _, key = source[len("s3://"):].partition("/")
        name = next(o["Key"] for o in bare.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"])
        relay.faults = ["throttle", "reset"]
        with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
            bare.get_object(Bucket=bucket, Key=name, Range="bytes=0-1023")
        body = bare.get_object(Bucket=bucket, Key=name, Range="bytes=0-1023")["Body"]
        with pytest.raises((botocore.exceptions.ResponseStreamingError, botocore.exceptions.IncompleteReadError)):
            body.read()
    finally:
        relay.close()


def _written(folder: Path) -> dict:
    """{file: its entry (size and digest)} of what a conversion wrote, from its manifest (computed as the bytes were
    written)."""
    manifest = json.loads((folder / "reshard-manifest.json").read_text())
    return manifest["files"]


def test_descriptor_and_rule_files_in_a_bucket_are_read_as_on_disk(s3, tmp_path):
    """`--to s3://…/dp3.json` (written to the bucket by Layout.save itself), `--layout-rules s3://…` and `--names
    s3://…` read through the storage: the same output as the same files on disk, byte for byte. The negative
    controls: a missing object named in one line, exit 2 for --to, nothing written."""
    from reshard.formats import read
    source = fixture_dir(FIXTURE)
    layout = read(str(source)).layout.with_degrees({"dp": 3})
    remote, local = s3.url("rules/dp3.json"), tmp_path / "dp3.json"
    layout.save(remote)
    layout.save(local)
    assert servers.keys(s3, "rules/dp3.json") == ["rules/dp3.json"]
    for where, to in (("remote", remote), ("local", local)):
        run_cli("convert", source, tmp_path / where, "--to", to, "--quiet", check=0)
    assert _written(tmp_path / "remote") == _written(tmp_path / "local")
    assert any("mp_rank" in name for name in _written(tmp_path / "remote"))
    assert "dp=3" in run_cli("inspect", tmp_path / "remote", check=0).stdout

    megatron = fixture_dir("megatron_tp2_z1_fp32_dp2")       # refused without rules: it carries no TP layout
    servers.put(s3, "rules/megatron-gpt.json", (REPO / "reshard/layouts/tp-rules/megatron-gpt.json").read_bytes())
    shipped = run_cli("inspect", megatron, "--layout-rules", "megatron-gpt", check=0).stdout
    assert run_cli("inspect", megatron, "--layout-rules", s3.url("rules/megatron-gpt.json"), check=0).stdout == shipped
    assert "tp=2" in shipped

    servers.put(s3, "rules/names.json", (REPO / "reshard/layouts/export-names/mixtral-autoep-hf.json").read_bytes())
    for where, names in (("hf-remote", s3.url("rules/names.json")), ("hf-local", "mixtral-autoep-hf")):
        run_cli("export", fixture_dir("autoep2_z1_fp32"), tmp_path / where, "--names", names, "--quiet", check=0)
    assert _written(tmp_path / "hf-remote") == _written(tmp_path / "hf-local")
    assert any("experts" in key for key in load_file(next((tmp_path / "hf-remote").glob("*.safetensors"))))

    missing = s3.url("rules/nothere.json")
    for args, status in ((("convert", source, tmp_path / "never", "--to", missing), 2),
                         (("inspect", megatron, "--layout-rules", missing), 1),
                         (("export", fixture_dir("autoep2_z1_fp32"), tmp_path / "never", "--names", missing), 1)):
        proc = run_cli(*args, check=status)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and missing in lines[0], proc.stderr
        assert not (tmp_path / "never").exists()


def test_a_prefix_walks_and_measures_as_its_local_copy_and_a_new_put_changes_its_identity(s3, source):
    """files.walk and files.found_under of the uploaded fixture: the folders and files os.walk and the sizes
    os.stat give for the local copy; files.identity of an object changes when it is put again (the control: the
    same object asked twice is the same)."""
    from reshard.storage import files
    local = fixture_dir(FIXTURE)
    walked = {os.path.relpath(folder, source): (sorted(dirs), sorted(names)) for folder, dirs, names in
              files.walk(source)}
    assert walked == {os.path.relpath(folder, local): (sorted(dirs), sorted(names)) for folder, dirs, names in
                      os.walk(local)}
    sizes = {os.path.relpath(f.path, source): f.size for f in files.found_under(source)}
    assert sizes == {os.path.relpath(os.path.join(folder, n), local): os.path.getsize(os.path.join(folder, n))
                     for folder, _, names in os.walk(local) for n in names}
    servers.put(s3, "ident/x", b"one")
    first = files.identity(s3.url("ident/x"))
    assert first == files.identity(s3.url("ident/x")) and first[1] == 3
    servers.put(s3, "ident/x", b"two!")
    assert files.identity(s3.url("ident/x")) != first and files.identity(s3.url("ident/nothere")) == ()



def test_a_checkpoint_read_from_a_bucket_asks_what_each_path_is_once(s3, source, monkeypatch):
    """Reading a checkpoint (inside `fs.settled()`, as every read is) asks the store what each object is once: at
    most one HEAD per object, against several per object with the block made a no-op (the control), the same
    catalog either way. Nothing is remembered past the block: an object replaced after it is seen as it now is."""
    import contextlib

    import reshard
    from reshard.storage import files as fs, s3 as objects
    heads: list[str] = []
    client = objects.client()
    client.meta.events.register("provide-client-params.s3.HeadObject", lambda params, **_: heads.append(params["Key"]))
    try:
        settled = reshard.open_checkpoint(source)
        asked, heads[:] = list(heads), []
        with monkeypatch.context() as m:
            m.setattr(fs, "settled", contextlib.nullcontext)
            unsettled = reshard.open_checkpoint(source)
        assert asked and len(asked) == len(set(asked)) and len(heads) > len(set(heads)), (asked, heads)
        assert settled.tensors.keys() == unsettled.tensors.keys()
    finally:
        client.meta.events.unregister("provide-client-params.s3.HeadObject")
    bucket, key = objects.split(source)
    url = objects.url_of(bucket, "settled/one-object")
    client.put_object(Bucket=bucket, Key="settled/one-object", Body=b"12345")
    with fs.settled():
        assert fs.getsize(url) == 5
        client.put_object(Bucket=bucket, Key="settled/one-object", Body=b"1234567")
        assert fs.getsize(url) == 5         # within the block: asked once
    assert fs.getsize(url) == 7
    with fs.settled():       # a small object opened twice is fetched once; outside the block, as it now is
        with fs.open(url, "rb") as f:
            assert f.read() == b"1234567" and f.name == url
        client.put_object(Bucket=bucket, Key="settled/one-object", Body=b"7654321")
        with fs.open(url, "rb") as f:
            assert f.read() == b"1234567"
    with fs.open(url, "rb") as f:
        assert f.read() == b"7654321"
