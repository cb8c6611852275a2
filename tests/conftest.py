"""Shared fixtures: a real ``hkvd serve`` process on a private socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hkvd.shim.client import DaemonClient
from hkvd.transport.wire.errors import KVError


class DaemonProc:
    def __init__(self, socket_path: str, args: list[str], log_path: Path) -> None:
        self.socket_path = socket_path
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> DaemonProc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hkvd.daemon", "serve", "--socket", self.socket_path, "--hugepages", "off",
             "--log-level", "debug", *self.args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hkvd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with DaemonClient(self.socket_path, client_name="probe", role="tool", timeout_s=1.0) as c:
                    c.ping()
                return self
            except KVError:
                time.sleep(0.05)
        raise RuntimeError(f"hkvd did not become ready in {timeout_s} s:\n{self.log()}")

    def status(self) -> dict:
        with DaemonClient(self.socket_path, client_name="probe", role="tool", timeout_s=5.0) as c:
            return c.status()

    def stop(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


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

    out = subprocess.run([sys.executable, "-m", "hkvd.shim.synthetic", "--socket", socket_path, *args],
                         capture_output=True, timeout=timeout_s, check=False, env=dict(os.environ))
    if out.returncode != 0:
        raise RuntimeError(f"engine failed ({out.returncode}):\n{out.stderr.decode(errors='replace')}")
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@pytest.fixture
def engine_proc() -> Callable[..., dict]:
    return run_engine
