"""Shared fixtures: a real ``hkvd serve`` process on a private socket."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from hkvd.shim.testing.launcher import DaemonProcess


class DaemonProc(DaemonProcess):
    """``hkvd serve`` on a private socket, with huge pages off and debug logs (tests only)."""

    def __init__(self, socket_path: str, args: list[str], log_path: Path) -> None:
        super().__init__(socket_path, ["--hugepages", "off", "--log-level", "debug", *args], log_path)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from hkvd.shim.testing.zygote import stop_session_zygote

    stop_session_zygote()  # the real-vLLM tests' engine zygote, if any started it


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    procs: list[DaemonProc] = []

    def make(*args: str, name: str = "hkvd") -> DaemonProc:
        d = DaemonProc(str(tmp_path / f"{name}.sock"), list(args), tmp_path / f"{name}.log")
        procs.append(d)
        return d.start()

    yield make
    for d in procs:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProc]) -> DaemonProc:
    return daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "32")


def run_engine(socket_path: str, *args: str, timeout_s: float = 60.0) -> dict:
    """Run a synthetic engine in its own process and return its JSON output."""
    import json

    out = subprocess.run([sys.executable, "-m", "hkvd.shim.testing.synthetic", "--socket", socket_path, *args],
                         capture_output=True, timeout=timeout_s, check=False, env=dict(os.environ))
    if out.returncode != 0:
        raise RuntimeError(f"engine failed ({out.returncode}):\n{out.stderr.decode(errors='replace')}")
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@pytest.fixture
def engine_proc() -> Callable[..., dict]:
    return run_engine


# The fast tier lives in tests/unit alone (tests/unit/conftest.py gives the rule): under exactly `-m fast`,
# the other folders are not even imported, which saves their collection (vLLM's import among it).
_UNIT = Path(__file__).resolve().parent / "unit"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("markexpr") != "fast":
        return None
    path = collection_path.resolve()
    if path == _UNIT or _UNIT in path.parents or path in _UNIT.parents:
        return None
    return True


# Per-tier time budgets and the durations report (tests/budgets.py, docs/testing.md), loaded by path: the
# importlib import mode puts no test folder on sys.path.
def load_budgets() -> ModuleType:
    name = "hkvd_test_budgets"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("budgets.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclass looks its module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(load_budgets().BudgetPlugin(Path(__file__).resolve().parent), "hkvd-budgets")
    if os.environ.get("HKVD_TEST_LEDGER"):
        # Under pytest-xdist (make test-fast) each worker deselects; only the controller writes.
        writes = not hasattr(config, "workerinput")
        config.pluginmanager.register(Ledger(Path(os.environ["HKVD_TEST_LEDGER"]), writes), "hkvd-ledger")


# A run ledger (HKVD_TEST_LEDGER=FILE): each test that passes is written to FILE, and a test that FILE already
# names as passed is not run again. .ci/run runs README's quick checks in a clean venv without vLLM and then
# `make test` with the same ledger, so every test runs once; a test skipped there (it needs vLLM) runs here.
class Ledger:
    def __init__(self, path: Path, writes: bool = True) -> None:
        self.path = path
        self.writes = writes
        self.passed = set(path.read_text().split("\n")) - {""} if path.exists() else set()
        self.failed: set[str] = set()

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        done = [item for item in items if item.nodeid in self.passed]
        if done:
            items[:] = [item for item in items if item.nodeid not in self.passed]
            config.hook.pytest_deselected(items=done)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test passed once its teardown passed too (the budget check fails a test there).
        if not self.writes:
            return
        if report.when == "teardown" and report.passed and report.nodeid not in self.failed:
            with self.path.open("a") as f:
                f.write(report.nodeid + "\n")
        elif not report.passed:
            self.failed.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.passed and self.writes:
            terminalreporter.write_line(f"ledger {self.path}: {len(self.passed)} tests had passed in an earlier "
                                        "run and were not run again")
