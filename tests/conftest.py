"""pytest's configuration of the tests: the session fixtures and the xdist scheduling of the modules that share
torchrun launches. The helpers the tests import are the package tests/helpers/."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from tests.helpers import lifecycle_runs
from tests.helpers.fixtures import FIXTURE_NAMES, FIXTURES
from tests.helpers.repo import REPO
from tests.helpers.torchrun import run_torchrun


@pytest.fixture(scope="session")
def lifecycle_template(tmp_path_factory):
    """The DeepSpeed run directory of lifecycle_runs.deepspeed_run, made once; tests take a copy each."""
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


LONGEST = ("test_engine_resume", "test_lightning_deepspeed", "test_tp_pp_convert", "test_accelerate_deepspeed",
           "test_hf_trainer_deepspeed", "test_faults", "test_properties", "test_moe_engine", "test_engine_llama_export",
           "test_dcp", "test_single_process", "test_distributed", "test_tp_pp_3d", "test_lifecycle_watch",
           "test_properties_parallel", "test_torchrun_jobs", "test_lifecycle_prune", "test_lifecycle_units",
           "test_hf_folders")      # 400 s ... 30 s


@functools.cache
def launch_groups() -> dict[str, str]:
    """The test modules (as in a node id, `tests/test_x.py`) that share torchrun launches, with their group
    (tests/helpers/engine_launches.py), read from the sources once per process."""
    from tests.helpers import engine_launches
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
    order = list(LONGEST)    # module names
    members: dict[str, list[str]] = {}
    for path, group in launch_groups().items():
        members.setdefault(group, []).append(path)

    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        stems = [Path(p).stem for p in members.get(group_of(path), [path])]
        return min(order.index(stem) if stem in order else len(order) for stem in stems)
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


@pytest.fixture(scope="session")
def engine_launches(request, tmp_path_factory):
    """The engine tests' torchrun launches, each run once for every module that needs it
    (tests/helpers/engine_launches.py)."""
    from tests.helpers import engine_launches as shared
    return shared.Launches(request.session, tmp_path_factory, run_torchrun)
