# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the shim's tests: tiny models, a real ``hkvd serve`` subprocess, vLLM runs.

Every test here needs vLLM (``make vllm``); without it the whole folder skips with a reason.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (torchvision operator errors)
        skip = pytest.mark.skip(reason=f"vllm is not importable ({type(e).__name__}: {e}); run `make vllm`")
        for item in items:
            if HERE in Path(str(item.fspath)).resolve().parents:
                item.add_marker(skip)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(autouse=True)
def strict_request_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request state transition the shim's table lacks raises, in this process and in the engines the
    tests start (``hkvd.shim.request_state``; in production it is logged and the request recomputed)."""
    monkeypatch.setenv("HKVD_STRICT_STATES", "1")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # HKVD_TEST_MODELS=DIR keeps the built models between runs; unset, they go to a temp dir
    # (Path("") would be the current directory).
    env_root = os.environ.get("HKVD_TEST_MODELS")
    return Path(env_root) if env_root else tmp_path_factory.mktemp("models")


def _local_module(name: str):  # type: ignore[no-untyped-def]
    """Import a helper module of this folder (pytest's importlib mode puts no test folder on sys.path)."""
    sys.path.insert(0, str(HERE))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(HERE))


@pytest.fixture(scope="session")
def tiny_lib():  # type: ignore[no-untyped-def]
    """The tiny_models module (builders of random-weight models and adapters)."""
    return _local_module("tiny_models")


@pytest.fixture(scope="session")
def outputs():  # type: ignore[no-untyped-def]
    """The outputs module: ``hits(run)``, ``compare(ref, got, what)``, ``LOGPROB_TOL``."""
    return _local_module("outputs")


@pytest.fixture(scope="session")
def step_counts():  # type: ignore[no-untyped-def]
    """The step_counts module: ``check(timeline_path, async_scheduling)``, ``FLOOR``."""
    return _local_module("step_counts")


@pytest.fixture(scope="session")
def tiny_models(tiny_lib, models_root: Path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    return {k: tiny_lib.build(k, models_root) for k in ("qwen3_next", "gemma3")}


class Daemon:
    """A real ``hkvd serve`` process on a private socket; ``restart()`` keeps the socket path."""

    def __init__(self, workdir: Path, chunk_size: int, args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.args = list(args)  # more `hkvd serve` flags (--l2-path DIR, ...)
        self.socket = str(workdir / "hkvd.sock")
        self.chunk_size = chunk_size
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"daemon-{self.starts}.log", "wb")  # noqa: SIM115 - lives with the process
        # HKVD_TEST_SERVE: run another entry point (a development wrapper) instead of the CLI.
        entry = os.environ.get("HKVD_TEST_SERVE")
        cmd = [sys.executable, entry] if entry else [sys.executable, "-m", "hkvd.daemon"]
        cmd += ["serve", "--socket", self.socket, "--chunk-size", str(self.chunk_size), "--l1-size-gb", "0.25",
                *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log_text = (self.workdir / f"daemon-{self.starts}.log").read_text()
                raise RuntimeError(f"hkvd serve did not start: {log_text}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)

    def restart(self) -> None:
        """Stop, start, and wait until the new pool is fully pre-faulted. Its prefault threads take every
        core of a small VM for about a second, and a Mamba state copy that cannot finish before the
        engine's step s + 2 is dropped (docs/design.md, "Step-ordered snapshots"): a live engine stepping
        through a prompt meanwhile would store only part of it."""
        self.stop()
        self.start()
        self.wait_prefaulted()

    def wait_prefaulted(self, timeout_s: float = 30.0) -> None:
        """Wait until ``hkvd status`` reports the pool's prefault over; raise if it failed or after ``timeout_s``."""
        from hkvd.shim.testing.launcher import prefault_over, wait_status

        prefault = wait_status(self.socket, prefault_over, timeout_s, poll_s=0.05)["pool"].get("prefault") or {}
        if prefault.get("error"):
            raise RuntimeError(f"hkvd serve could not pre-fault its pool: {prefault['error']}")


@pytest.fixture
def daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    made: list[Daemon] = []

    def make(chunk_size: int = 128, *args: str) -> Daemon:
        d = Daemon(tmp_path_factory.mktemp("hkvd"), chunk_size, args)
        d.start()
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


_SESSION_ENV = dict(os.environ)  # before any test's monkeypatch: the zygote's imports see no test's settings


def run_engine(args: dict, *, timeout_s: float = 240, on_pause=None,  # type: ignore[no-untyped-def]
               expect_failure: bool = False) -> dict:
    """Run tests/shim/e2e_run.py as an engine process of its own; return its JSON result.

    An engine is a fork of the session's engine zygote (hkvd.shim.testing.zygote: vLLM imported once), and so
    are its engine core and workers where it has processes of its own (``vllm_cache.forks_engine_processes``);
    with ``HKVD_TEST_FORK_PROCESSES=0`` such an engine is a fresh interpreter that spawns them, as vLLM's CPU
    platform does.
    ``on_pause(i)`` runs when the engine pauses before prompt ``i`` (``args["pause_before"]``).
    ``expect_failure``: the engine must fail to start; returns ``{"log": ..., "rc": ...}``.
    """
    from hkvd.shim.testing.vllm_cache import core_in_own_process, forks_engine_processes
    from hkvd.shim.testing.zygote import engine_env, fork_engine

    env = engine_env(os.environ)
    argv = [str(HERE / "e2e_run.py"), json.dumps(args)]
    chunks: list[bytes] = []
    if core_in_own_process(args) and not forks_engine_processes():
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        lines = iter(proc.stdout.readline, b"")  # type: ignore[union-attr]
    else:
        proc = fork_engine(argv, env, _SESSION_ENV)
        lines = proc.lines()
    # A reader thread drains the output (vLLM logs a lot) while this thread watches for pauses.
    reader = threading.Thread(target=lambda: chunks.extend(lines), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    paused = set()
    while proc.poll() is None:
        for i in args.get("pause_before", []):
            if i not in paused and Path(args["sync_dir"], f"paused-{i}").exists():
                paused.add(i)
                if on_pause is not None:
                    on_pause(i)
                Path(args["sync_dir"], f"go-{i}").write_text("")
        if time.monotonic() > deadline:
            proc.kill()
            reader.join(10)
            tail = b"".join(chunks).decode(errors="replace")[-4000:]
            raise TimeoutError(f"engine run exceeded {timeout_s} s:\n{tail}")
        time.sleep(0.05)
    reader.join(30)
    out = b"".join(chunks)
    text = out.decode(errors="replace")
    if expect_failure:
        assert proc.returncode != 0 and "HKVD_RESULT " not in text, text[-3000:]
        return {"log": text, "rc": proc.returncode}
    for line in text.splitlines():
        if line.startswith("HKVD_RESULT "):
            res = json.loads(line[len("HKVD_RESULT "):])
            res["log"] = text
            return res
    raise AssertionError(f"engine run failed (rc {proc.returncode}):\n{text[-6000:]}")


@pytest.fixture
def engine_runner():  # type: ignore[no-untyped-def]
    return run_engine
