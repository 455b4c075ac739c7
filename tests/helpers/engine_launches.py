"""Shared torchrun launches: each (script, world size, group) runs once per session, with the jobs of every test
module that needs it.

Starting the ranks (torchrun, importing torch and DeepSpeed, the process group) costs more than most jobs, so a
module does not launch its own: it registers a provider with `@shares(script)`, a function that prepares its
checkpoints in a directory of its own and returns its jobs as `(world, group, job)`; `group` keeps apart jobs
that cannot share a process (None where any can). The first module to ask for results of a script
(`Launches.results`) runs that script's providers of every module with a selected engine test, launches each
(script, world, group) once with all their jobs, in the order they came, and hands each module the results of its
own jobs, in its order. The modules sharing a script run in one process (`launch_groups`); those of other scripts
can run beside them. A provider
registered `after` others (resumes of what a save launch wrote) is given their results and runs in the next round,
with every other provider ready then. A launch that fails fails every module with a job in it, with its output,
and no other.
"""
from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Provider = Callable[..., list]      # (out, *results of the providers it comes after) -> [(world, group, job)]


@dataclass(frozen=True)
class Launch:
    script: str
    world: int
    group: object = None        # jobs with another group run in another launch

    @property
    def stem(self) -> str:
        group = "" if self.group is None else f"-{self.group}"
        return f"{Path(self.script).stem}-w{self.world}{group}".replace("/", "-").replace(":", "-")


_PROVIDERS: dict[Provider, tuple[str, tuple]] = {}     # provider -> (script, providers it needs the results of)


def shares(script: str, after: tuple = ()):
    """Register a provider of `script`'s jobs; with `after`, providers whose results it is given:
    provider(out, *their results), run once theirs are back."""
    def register(provider: Provider) -> Provider:
        _PROVIDERS[provider] = (script, tuple(after))
        return provider
    return register


def launch_groups(tests: Path) -> dict[str, str]:
    """The test modules under `tests` that register providers (`@shares(script)`), by path under `tests`, each with the
    name of its group: the modules whose providers share a script are one group, whose tests must run in one
    process (`Launches` runs a script's launches for the modules of its group only). Read from their source:
    pytest-xdist's controller, which asks, imports no test module."""
    scripts: dict[str, set[str]] = {}       # module file name -> the scripts its providers launch
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) for target in node.targets
                     if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            for decorator in node.decorator_list if isinstance(node, ast.FunctionDef) else ():
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "shares":
                    script = decorator.args[0]
                    name = script.value if isinstance(script, ast.Constant) else constants[script.id]
                    scripts.setdefault(path.relative_to(tests).as_posix(), set()).add(name)
    groups: list[tuple[set[str], set[str]]] = []    # (scripts, modules), joined where they share a script
    for module, launched in scripts.items():
        joined = [g for g in groups if g[0] & launched]
        groups = [g for g in groups if not g[0] & launched]
        groups.append((launched.union(*(g[0] for g in joined)), {module}.union(*(g[1] for g in joined))))
    return {module: "launches of " + ", ".join(sorted(launched)) for launched, modules in groups
            for module in modules}


class Launches:
    """The session's shared launches; `run(script, world, jobs, out, stem)` runs one (conftest.run_torchrun)."""

    def __init__(self, session, tmp_path_factory, run):
        self._wanted = {item.module.__name__ for item in session.items
                        if item.get_closest_marker("engine") and getattr(item, "module", None)}
        self._tmp, self._run = tmp_path_factory, run
        self._results: dict = {}        # provider -> its results, or the failure of one of its launches

    def results(self, provider: Provider) -> list:
        """The results of `provider`'s jobs, in its order; where its preparation or a launch of its jobs failed,
        that failure is raised (a launch's: an AssertionError with its output)."""
        assert provider in _PROVIDERS, f"{provider.__qualname__} is not registered with @shares"
        needed = self._needed(provider)
        while provider not in self._results:
            ready = [p for p in needed if p not in self._results and all(q in self._results for q in _PROVIDERS[p][1])]
            assert ready, f"no provider of {provider.__qualname__}'s round is ready"
            self._launch(ready)
        outcome = self._results[provider]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _needed(self, asked: Provider) -> list:
        """`asked`, the providers of its script of the modules with a selected engine test, and those they come
        after."""
        script = _PROVIDERS[asked][0]
        needed, todo = [], [p for p in _PROVIDERS
                            if p is asked or (_PROVIDERS[p][0] == script and p.__module__ in self._wanted)]
        while todo:
            provider = todo.pop()
            if provider not in needed:
                needed.append(provider)
                todo += _PROVIDERS[provider][1]
        return [p for p in _PROVIDERS if p in needed]      # in registration order

    def _launch(self, providers: list) -> None:
        """Prepare the jobs of `providers` (each once those it comes after are back) and run them."""
        jobs: dict[Launch, list] = {}           # launch -> [(provider, index of the job in its list, job)]
        for provider in providers:
            script, after = _PROVIDERS[provider]
            failed = next((self._results[q] for q in after if isinstance(self._results[q], Exception)), None)
            if failed is not None:
                self._results[provider] = failed
                continue
            out = self._tmp.mktemp(f"{provider.__module__}-{provider.__name__}")
            try:
                prepared = provider(out, *(self._results[q] for q in after))
            except Exception as failure:        # a check of its preparation, or a command it ran
                self._results[provider] = failure
                continue
            self._results[provider] = {}
            for index, (world, group, job) in enumerate(prepared):
                jobs.setdefault(Launch(script, world, group), []).append((provider, index, job))
        launches_dir = self._tmp.mktemp("launches")
        for launch, owned in jobs.items():
            try:
                results = self._run(launch.script, launch.world, [job for _, _, job in owned], launches_dir,
                                    launch.stem)
                assert len(results) == len(owned), f"{len(results)} results for {len(owned)} jobs"
            except AssertionError as failure:
                for provider, _, _ in owned:
                    if not isinstance(self._results[provider], Exception):
                        self._results[provider] = AssertionError(f"{launch}: {failure}")
                continue
            for (provider, index, _), result in zip(owned, results, strict=True):
                if not isinstance(self._results[provider], Exception):
                    self._results[provider][index] = result
        for provider in providers:
            got = self._results[provider]
            if not isinstance(got, Exception):
                self._results[provider] = [got[i] for i in sorted(got)]
