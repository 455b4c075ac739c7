"""Shared helpers: the committed fixtures (real DeepSpeed checkpoints) and their engine truth."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import torchrun_jobs  # noqa: E402
from torchrun_jobs import free_port  # noqa: E402,F401  (the one free port for tests)

FIXTURES = Path(os.environ.get("RESHARD_FIXTURES", REPO / "fixtures"))
ALL_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if (p / "truth.json").exists()) if FIXTURES.exists() else []
# Mixture-of-experts fixtures (truth.json "kind": "autoep" or "moe", tools/fixture_moe.py) have tests of their own
# (tests/test_moe.py); the tests over every fixture take the others.
MOE_FIXTURES = [n for n in ALL_FIXTURES if json.loads((FIXTURES / n / "truth.json").read_text()).get("kind")
                in ("autoep", "moe")]
ALL_FIXTURES = [n for n in ALL_FIXTURES if n not in MOE_FIXTURES]
# Tensor/pipeline-parallel fixtures (truth.json "kind": "autotp" or "pipe") train other models: they have
# tests of their own (tests/test_tp_pp.py); the parametrized data-parallel tests take the others.
FIXTURE_NAMES = [n for n in ALL_FIXTURES if "kind" not in json.loads((FIXTURES / n / "truth.json").read_text())]
PARALLEL_FIXTURES = [n for n in ALL_FIXTURES if n not in FIXTURE_NAMES]


def fixture_dir(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def truth_json(name: str) -> dict:
    return json.loads((FIXTURES / name / "truth.json").read_text())


def truth_tensors(name: str) -> dict:
    from safetensors.torch import load_file
    return load_file(str(FIXTURES / name / "truth.safetensors"))


def copy_fixture(name: str, dest: Path) -> Path:
    """A writable copy of a fixture's save dir, for tests that break it."""
    target = dest / name
    shutil.copytree(fixture_dir(name), target)
    return target


def tag_dir(save_dir: Path) -> Path:
    return save_dir / (save_dir / "latest").read_text().strip()


def run_cli(*args, check=None, process=False, cwd=REPO):
    """`reshard ARGS` from `cwd` (the repository's root), as a CompletedProcess: in this process (reshard.cli.main,
    its stdout and stderr captured; argparse's exits and an escaping exception's traceback as a process would show
    them), or with `process` in a new interpreter, where the process boundary is what a test is about."""
    argv = [str(a) for a in args]
    if process:
        proc = subprocess.run([sys.executable, "-m", "reshard", *argv], capture_output=True, text=True, cwd=cwd,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    else:
        proc = subprocess.CompletedProcess(["reshard", *argv], *_in_process(argv, cwd))
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _in_process(argv: list, where) -> tuple:
    """(exit status, stdout, stderr) of reshard.cli.main(argv) run here, from the folder `where`."""
    from reshard import cli
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:     # argparse: --help (0), a bad argument (2)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:           # what the interpreter would print, and its status
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def lifecycle_template(tmp_path_factory):
    """The DeepSpeed run directory of lifecycle_runs.deepspeed_run, made once; tests take a copy each."""
    import lifecycle_runs  # here, not above: it imports this module
    root = tmp_path_factory.mktemp("template")
    lifecycle_runs.deepspeed_run(root)
    return root


@pytest.fixture
def lifecycle_copy(lifecycle_template, tmp_path):
    """A writable copy of it (mtimes kept: still an hour old)."""
    root = tmp_path / "run"
    shutil.copytree(lifecycle_template, root, symlinks=True)
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server for this worker's session (SeaweedFS `weed mini` on free ports, tools/s3_server.py), its
    data in the session's tmp folder; stopped (SIGTERM, then kill) when the session ends."""
    import s3_server as servers
    with servers.running(str(tmp_path_factory.mktemp("s3") / "data")) as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server's endpoint and credentials in the environment for one test (the standard AWS chain)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_name(request):
    return request.param


# The modules that run longest, with the launches they share (seconds at -n 2 on the 2-core machine, measured
# when the launches were grouped by script), started first under pytest-xdist so none is left running alone at the end.
LONGEST = ("test_engine_resume", "test_lightning_deepspeed", "test_tp_pp_convert", "test_accelerate_deepspeed",
           "test_hf_trainer_deepspeed", "test_faults", "test_properties", "test_moe_engine", "test_engine_llama_export",
           "test_dcp", "test_single_process", "test_distributed", "test_tp_pp_3d", "test_lifecycle_watch",
           "test_properties_parallel", "test_torchrun_jobs", "test_lifecycle_prune", "test_lifecycle_units",
           "test_hf_folders")      # 400 s ... 30 s


@functools.cache
def launch_groups() -> dict[str, str]:
    """The test modules (as in a node id, `tests/test_x.py`) that share torchrun launches, with their group
    (tests/engine_launches.py), read from the sources once per process."""
    import engine_launches
    return {f"tests/{module}": group for module, group in engine_launches.launch_groups(REPO / "tests").items()}


def group_of(path: str) -> str:
    """The group of the test module at `path` (as in a node id, `tests/test_x.py`): the modules sharing a script's
    torchrun launches are one group, any other module its own."""
    return launch_groups().get(path, path)


def pytest_collection_modifyitems(config, items):
    """The groups in LONGEST's order (a group where its first module is), then the others; each module's tests
    in their order."""
    if not FIXTURE_NAMES:
        raise pytest.UsageError(f"no fixtures under {FIXTURES}; run tools/make_fixtures.py")
    order = [f"tests/{module}.py" for module in LONGEST]
    members: dict[str, list[str]] = {}
    for path, group in launch_groups().items():
        members.setdefault(group, []).append(path)

    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return min(order.index(p) if p in order else len(order) for p in members.get(group_of(path), [path]))
    items.sort(key=rank)


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (README's test command, `-n 2`) each group runs in one worker: a module's tests
    together, so its module fixtures are made once, and the modules that share a script's torchrun launches in
    one, where those launches then run once. Groups start in the order collected (longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False      # not xdist's own order (the groups with most tests first)
    return ByGroup(config, log)


def torchrun_env() -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "PYTHONHASHSEED": "0"}  # every rank orders universal optimizer states alike (engine_resume.py)


@functools.cache
def deepspeed_ops_ready() -> bool:
    """DeepSpeed's CPU comm op built once, in this one process, before the first ranks start: ranks that
    compile and load it side by side on a busy machine start their process groups minutes apart."""
    return torchrun_jobs.build_deepspeed_ops(torchrun_env())


def torchrun(world: int, *args, check: bool = True, deepspeed: bool = True, timeout: float = 1800,
             forked: bool = True):
    """`torchrun ARGS` at `world` ranks on a free port (tools/torchrun_jobs.py); the CompletedProcess.
    With `check`, a failure shows the end of its output; `deepspeed=False` for ranks that never import it.
    The ranks are forked from one server that imported torch and the frameworks once (tools/forked_ranks.py:
    what torchrun's workers see, without an agent and ~10 CPU-seconds of imports per launch); `forked=False`
    where torchrun itself is what a test is about."""
    if deepspeed:
        deepspeed_ops_ready()
    proc = torchrun_jobs.launch(world, args, torchrun_env(), timeout=timeout, forked=forked)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_torchrun(script: str, world: int, jobs, out: Path, stem: str):
    """Run tests/`script` under torchrun at `world` ranks on `jobs` (written as JSON); what it writes back."""
    jobs_path, results_path = out / f"jobs-{stem}.json", out / f"results-{stem}.json"
    jobs_path.write_text(json.dumps(jobs))
    torchrun(world, REPO / "tests" / script, jobs_path, results_path)
    return json.loads(results_path.read_text())


@pytest.fixture(scope="session")
def engine_launches(request, tmp_path_factory):
    """The engine tests' torchrun launches, each run once for every module that needs it (tests/engine_launches.py)."""
    import engine_launches as shared
    return shared.Launches(request.session, tmp_path_factory, run_torchrun)


def write_in_zip(path, offset: int, data: bytes) -> None:
    """Write `data` at byte `offset` of a torch.save zip, inside one member, and give that member the CRC-32 of
    its new bytes (local header, data descriptor if any, central directory): a file saved with other values, as
    a writer would have made it, not a corrupt one (reshard checks every member's CRC-32 as it reads it)."""
    import struct
    import zipfile
    import zlib
    with zipfile.ZipFile(path) as zf:
        infos, directory = zf.infolist(), zf.start_dir
    with open(path, "r+b") as f:
        for info in infos:
            f.seek(info.header_offset)
            local = f.read(30)
            start = info.header_offset + 30 + sum(struct.unpack_from("<HH", local, 26))
            if start <= offset and offset + len(data) <= start + info.compress_size:
                break
        else:
            raise AssertionError(f"bytes [{offset}, {offset + len(data)}) are not inside one member of {path}")
        f.seek(offset)
        f.write(data)
        f.seek(start)
        crc = struct.pack("<I", zlib.crc32(f.read(info.compress_size)))
        if info.flag_bits & 0x08:        # streamed: the CRC is in a data descriptor after the data
            f.seek(start + info.compress_size)
            signed = f.read(4) == b"PK\x07\x08"
            f.seek(start + info.compress_size + 4 * signed)
        else:
            f.seek(info.header_offset + 14)
        f.write(crc)
        at = directory
        while True:
            f.seek(at)
            entry = f.read(46)
            assert entry[:4] == b"PK\x01\x02", f"no central directory entry for {info.filename}"
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", entry, 28)
            if f.read(name_len).decode() == info.filename:
                f.seek(at + 16)
                f.write(crc)
                return
            at += 46 + name_len + extra_len + comment_len


def change_dcp_element(folder, name: str, allowed: dict | None = None, state: str = "exp_avg") -> None:
    """One element of `name`'s exp_avg (or fp32 `state`: "module", its weights) changed in the DCP files under
    `folder` (its zip member's CRC-32 made to
    match, as a save of another value would have written it); `allowed`: the allow-list its `.metadata` needs
    (Megatron's), None for DCP's own."""
    import reshard
    from reshard.core.catalog import TensorKey
    from reshard.formats.dcp import metadata as dcp_metadata
    catalog = reshard.open_checkpoint(str(folder))
    fragment = catalog.tensors[TensorKey(name, state)].fragments[0]
    path = fragment.storage.file
    meta = dcp_metadata.read(os.path.join(os.path.dirname(path), ".metadata"), allowed)    # (the rank file's folder's)
    at = fragment.storage.offset + fragment.elem_offset * 4       # (an fp32 moment)
    start, length = next((info.offset, info.length) for info in meta.storage_data.values()
                         if info.relative_path == os.path.basename(path) and info.offset <= at < info.offset
                         + info.length)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    item = Path(folder).parent / "item.zip"
    item.write_bytes(bytes(data[start:start + length]))
    write_in_zip(item, at - start, bytes(b ^ 0x40 for b in data[at:at + 4]))
    data[start:start + length] = item.read_bytes()
    item.unlink()
    with open(path, "wb") as f:
        f.write(data)

def mutated(data, raw: bytes) -> bytes:
    """`raw` with 1-8 random flips, cuts, insertions and zeroed runs drawn from hypothesis `data`."""
    from hypothesis import strategies as st
    blob = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "zero"]))
        at = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if kind == "flip" and blob:
            blob[at] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del blob[at:at + data.draw(st.integers(1, 64))]
        elif kind == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            blob[at:at + 8] = bytes(min(8, len(blob) - at))
    return bytes(blob)
