"""The ``fast`` tier (``make test-fast``, ``pytest -m fast tests``): the unit tests that run in-process.

The rule
    Every test under tests/unit is ``fast`` unless one of these puts it out:

    - it carries ``out_of_process`` (``pytestmark = pytest.mark.out_of_process`` for a module,
      ``@pytest.mark.out_of_process`` for a test): it starts a process (``hkvd serve``, a child
      engine, ``python -c``, a compiler, ``ip netns``);
    - it uses a fixture that starts one (``SPAWNING_FIXTURES``: tests/conftest.py's daemons and
      engines);
    - it uses vLLM: its module's source imports vLLM anywhere, in a test or a helper (``import
      vllm``, ``from vllm ...``, ``pytest.importorskip("vllm...")``), or the module holds something
      of vLLM's after import, or the test carries ``vllm``. Such tests get the ``vllm`` marker too
      (``pytest -m vllm`` finds them).

    Nothing is listed by name, so a new module is in the tier from its first test.

How the rule is kept
    A ``fast`` test runs (its function-scoped fixtures, its call and their teardown; module- and
    session-scoped fixtures are set up outside it) with process creation refused: ``subprocess``,
    ``asyncio``'s subprocesses (through ``subprocess``), ``multiprocessing``, ``os.fork``,
    ``os.posix_spawn`` and ``os.system`` raise ``ProcessInFastTest``, and the test fails naming the
    marker to add, also where the code under test swallows the error. A ``fast`` test that imports
    vLLM fails the same way, where no earlier module has imported it (without vLLM installed, such a
    test skips or fails on its import). So a test that starts a process cannot join the tier
    unnoticed, and one that stops doing so only needs its marker removed. (A process started by
    uvloop's own ``subprocess_exec`` is not seen: tests run on asyncio's loop.)

    Together the tier runs in under a minute on two cores; the rest of tests/unit runs in
    ``make test-unit``.
"""

from __future__ import annotations

import multiprocessing.util
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The daemon imports ml_dtypes at its first comparison (0.7 s): here it is imported once at collection, so the
# first fast test that compares does not pay it against its 1 s budget.
import ml_dtypes  # noqa: F401
import pytest

HERE = Path(__file__).resolve().parent

#: tests/conftest.py's fixtures that start ``hkvd serve`` or an engine process.
SPAWNING_FIXTURES = frozenset({"daemon", "daemon_factory", "engine_proc"})

FIX = ("give the test @pytest.mark.out_of_process (or its module pytestmark = pytest.mark.out_of_process); "
       "the fast tier is in-process only (tests/unit/conftest.py)")


class ProcessInFastTest(RuntimeError):
    """A ``fast`` test started a process."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "out_of_process: a tests/unit test that starts a process (hkvd serve, a "
                            "child engine, python -c): out of the fast tier (tests/unit/conftest.py)")


VLLM_IMPORT = re.compile(r"^\s*(import|from)\s+vllm\b|importorskip\(\s*[\"']vllm\b", re.MULTILINE)


def _module_uses_vllm(module: types.ModuleType | None) -> bool:
    """Whether ``module`` holds something of vLLM's (it imported vLLM at its top)."""
    for value in vars(module).values() if module is not None else ():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and (name == "vllm" or name.startswith("vllm.")):
            return True
    return False


def _source_imports_vllm(path: Path) -> bool:
    """Whether the module's source imports vLLM anywhere (``import vllm``, ``from vllm ...``,
    ``pytest.importorskip("vllm...")``), in a test or in a helper."""
    try:
        return VLLM_IMPORT.search(path.read_text()) is not None
    except OSError:
        return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    fast, vllm = pytest.mark.fast, pytest.mark.vllm
    vllm_modules: dict[Path, bool] = {}
    for item in items:
        if HERE not in item.path.parents:
            continue
        module = getattr(item, "module", None)
        if item.path not in vllm_modules:
            vllm_modules[item.path] = _module_uses_vllm(module) or _source_imports_vllm(item.path)
        if vllm_modules[item.path] and item.get_closest_marker("vllm") is None:
            item.add_marker(vllm)
        if (item.get_closest_marker("out_of_process") is None and item.get_closest_marker("vllm") is None
                and not SPAWNING_FIXTURES.intersection(getattr(item, "fixturenames", ()))):
            item.add_marker(fast)


# ---- the guard ----------------------------------------------------------------------------------------------

def _refusing(what: str, seen: list[str]) -> Callable[..., Any]:
    def refuse(*_args: object, **_kwargs: object) -> Any:
        seen.append(what)
        raise ProcessInFastTest(f"a fast test started a process ({what}): {FIX}")
    return refuse


@pytest.fixture(autouse=True)
def _refuse_processes_in_fast_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse fixtures are set up before the others a test uses: their set-up is guarded too."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    seen: list[str] = []
    targets: list[tuple[object, str, str]] = [
        (subprocess.Popen, "_execute_child", "subprocess"),
        (multiprocessing.util, "spawnv_passfds", "multiprocessing"),
        (os, "fork", "os.fork"), (os, "forkpty", "os.forkpty"), (os, "posix_spawn", "os.posix_spawn"),
        (os, "posix_spawnp", "os.posix_spawnp"), (os, "system", "os.system"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets if hasattr(obj, name)]
    had_vllm = "vllm" in sys.modules
    for obj, name, what in targets:
        if hasattr(obj, name):
            setattr(obj, name, _refusing(what, seen))
    try:
        yield
    finally:
        for obj, name, original in saved:
            setattr(obj, name, original)
    if seen:  # also when the code under test caught the error
        pytest.fail(f"{request.node.nodeid} started a process ({', '.join(sorted(set(seen)))}): {FIX}",
                    pytrace=False)
    if not had_vllm and "vllm" in sys.modules:
        pytest.fail(f"{request.node.nodeid} imported vLLM, which the fast tier runs without: give it "
                    "@pytest.mark.vllm (tests/unit/conftest.py)", pytrace=False)
