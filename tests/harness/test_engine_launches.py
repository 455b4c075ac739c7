"""The shared launches of the engine tests (tests/helpers/engine_launches.py), with a stand-in for torchrun: one launch
per (script, world, group) for every module with a selected engine test, each module given its own jobs' results in
its order, a failed launch failing only the modules with a job in it, and providers that come after others."""
from types import SimpleNamespace

import pytest

from tests.helpers import engine_launches
from tests.helpers.engine_launches import Launches, shares
from tests.helpers.repo import REPO


@pytest.fixture
def registry(monkeypatch):
    """An empty registry for the providers a test registers."""
    monkeypatch.setattr(engine_launches, "_PROVIDERS", {})


def _session(*modules):
    """A session whose selected items are one engine test in each of `modules`, and one other test."""
    engine = SimpleNamespace(name="engine")
    items = [SimpleNamespace(module=SimpleNamespace(__name__=m), get_closest_marker=lambda name: engine)
             for m in modules]
    items.append(SimpleNamespace(module=SimpleNamespace(__name__="quick"), get_closest_marker=lambda name: None))
    return SimpleNamespace(items=items)


class Torchrun:
    """Records each launch; echoes each job with its world; fails launches whose stem is in `failing`."""

    def __init__(self, failing=()):
        self.launches, self.failing = [], failing

    def __call__(self, script, world, jobs, out, stem):
        self.launches.append((script, world, stem, [job["id"] for job in jobs]))
        assert stem not in self.failing, f"exit 1: the output of {stem}"
        return [{**job, "world": world} for job in jobs]


def _provider(module, name, jobs, script="s.py", after=()):
    def provider(out, *earlier):
        assert out.is_dir()
        return [(world, group, {"id": job, "earlier": [len(e) for e in earlier]}) for world, group, job in jobs]
    provider.__module__, provider.__name__, provider.__qualname__ = module, name, name
    return shares(script, after)(provider)


def test_one_launch_per_script_world_and_group_for_every_module_and_each_its_own_results(registry, tmp_path_factory):
    a = _provider("test_a", "a", [(2, None, "a1"), (3, None, "a2"), (2, None, "a3")])
    b = _provider("test_b", "b", [(2, None, "b1"), (2, "tp", "b2")])
    other = _provider("test_c", "c", [(2, None, "c1")], script="t.py")
    unselected = _provider("test_d", "d", [(2, None, "d1")])
    run = Torchrun()
    launches = Launches(_session("test_a", "test_b", "test_c"), tmp_path_factory, run)
    assert [r["id"] for r in launches.results(b)] == ["b1", "b2"]
    # the launches of b's script, for every module: not yet those of another script (another group's, which may
    # run in another process)
    assert sorted(run.launches) == sorted([("s.py", 2, "s-w2", ["a1", "a3", "b1"]), ("s.py", 3, "s-w3", ["a2"]),
                                           ("s.py", 2, "s-w2-tp", ["b2"])])
    assert [(r["id"], r["world"]) for r in launches.results(a)] == [("a1", 2), ("a2", 3), ("a3", 2)]
    assert [r["id"] for r in launches.results(other)] == ["c1"] and run.launches[-1] == ("t.py", 2, "t-w2", ["c1"])
    assert len(run.launches) == 4           # once per session
    # a provider of a module with no selected engine test runs only when asked, in a launch of its own
    assert [r["id"] for r in launches.results(unselected)] == ["d1"] and run.launches[-1][3] == ["d1"]


def test_a_failed_launch_fails_the_modules_with_a_job_in_it_and_no_other(registry, tmp_path_factory):
    a = _provider("test_a", "a", [(2, None, "a1"), (3, None, "a2")])
    b = _provider("test_b", "b", [(2, None, "b1")])
    c = _provider("test_c", "c", [(3, None, "c1")])
    launches = Launches(_session("test_a", "test_b", "test_c"), tmp_path_factory, Torchrun(failing={"s-w2"}))
    for failed in (a, b, b):
        with pytest.raises(AssertionError, match="exit 1: the output of s-w2"):
            launches.results(failed)
    assert [r["id"] for r in launches.results(c)] == ["c1"]


def test_a_provider_after_others_is_given_their_results_and_shares_its_own_launches(registry, tmp_path_factory):
    saves = _provider("test_a", "saves", [(2, None, "s1"), (2, None, "s2")])
    resumes = _provider("test_a", "resumes", [(1, None, "r1")], after=(saves,))
    more = _provider("test_b", "more", [(1, None, "m1")], after=(saves,))
    run = Torchrun()
    launches = Launches(_session("test_a", "test_b"), tmp_path_factory, run)
    assert [r["earlier"] for r in launches.results(resumes)] == [[2]]    # the two results of saves
    assert [stem for _, _, stem, _ in run.launches] == ["s-w2", "s-w1"]
    assert run.launches[1][3] == ["r1", "m1"] and [r["id"] for r in launches.results(more)] == ["m1"]


def test_a_provider_after_a_failed_one_fails_with_its_failure(registry, tmp_path_factory):
    saves = _provider("test_a", "saves", [(2, None, "s1")])
    resumes = _provider("test_a", "resumes", [(1, None, "r1")], after=(saves,))
    run = Torchrun(failing={"s-w2"})
    launches = Launches(_session("test_a"), tmp_path_factory, run)
    with pytest.raises(AssertionError, match="s-w2"):
        launches.results(resumes)
    assert len(run.launches) == 1


def test_an_unregistered_provider_is_refused(registry, tmp_path_factory):
    launches = Launches(_session(), tmp_path_factory, Torchrun())
    with pytest.raises(AssertionError, match="not registered"):
        launches.results(lambda out: [])


def test_the_modules_that_share_launches_are_found_in_their_source_and_grouped_by_script(tmp_path):
    """pytest-xdist keeps each group in one worker (conftest.pytest_xdist_make_scheduler); its controller imports
    none. Modules are joined where their providers share a script, also through a third module."""
    (tmp_path / "test_sharing.py").write_text('@shares("engine_resume.py", after=(saves,))\ndef jobs(out): ...\n')
    (tmp_path / "test_also.py").write_text('SCRIPT = "engine_resume.py"\n@shares(SCRIPT)\ndef jobs(out): ...\n')
    (tmp_path / "test_x1.py").write_text('@shares("x.py")\ndef jobs(out): ...\n')
    (tmp_path / "test_x2.py").write_text('@shares("y.py")\ndef jobs(out): ...\n')
    (tmp_path / "test_x3.py").write_text('@shares("x.py")\ndef a(out): ...\n@shares("y.py")\ndef b(out): ...\n')
    (tmp_path / "test_calling.py").write_text('def jobs(out):\n    return shares("s.py")(out)\n')
    (tmp_path / "test_other.py").write_text('@pytest.mark.engine\ndef test_x(): ...\n')
    (tmp_path / "helper.py").write_text('@shares("s.py")\ndef jobs(out): ...\n')
    assert engine_launches.launch_groups(tmp_path) == {
        "test_also.py": "launches of engine_resume.py", "test_sharing.py": "launches of engine_resume.py",
        "test_x1.py": "launches of x.py, y.py", "test_x2.py": "launches of x.py, y.py",
        "test_x3.py": "launches of x.py, y.py"}
    real = {engine_launches.Path(path).name: group
            for path, group in engine_launches.launch_groups(REPO / "tests").items()}    # (one name each)
    assert real["test_engine_resume.py"] == real["test_crc.py"] == real["test_universal_engine.py"]
    assert real["test_tp_pp_convert.py"] == real["test_universal_tp.py"] != real["test_engine_resume.py"]
