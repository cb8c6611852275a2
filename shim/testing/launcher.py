"""Start and stop an ``hkvd serve`` subprocess: for tests, benchmarks and smoke checks.

``DaemonProcess.start`` returns once the daemon answers a ping on its socket (bounded by
``timeout_s``); ``stop`` sends SIGTERM and waits, killing the process if it outlives the deadline.
``wait_status`` polls any daemon's status until a condition holds (``prefault_over``: its pool's pre-fault
has ended), bounded by its timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hkvd.shim.client import DaemonClient
from hkvd.transport.errors import KVError


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float = 20.0) -> int:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return proc.returncode


def daemon_status(socket_path: str) -> dict[str, Any]:
    """What ``hkvd status`` shows, from the daemon on ``socket_path``."""
    with DaemonClient(socket_path, client_name="probe", role="tool", timeout_s=5.0) as c:
        return c.status()


def wait_status(socket_path: str, pred: Callable[[dict[str, Any]], bool], timeout_s: float,
                poll_s: float = 0.02) -> dict[str, Any]:
    """The first status of the daemon on ``socket_path`` for which ``pred`` holds; ``AssertionError`` with the
    last one after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = daemon_status(socket_path)
        if pred(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s; last status: {status}")
        time.sleep(poll_s)


def prefault_over(status: dict[str, Any]) -> bool:
    """The pool's pre-fault has ended (done or failed), or the daemon reports none."""
    pool = status.get("pool")
    prefault = pool.get("prefault") if isinstance(pool, dict) else None
    return not isinstance(prefault, dict) or bool(prefault.get("done")) or bool(prefault.get("error"))


class DaemonProcess:
    def __init__(self, socket_path: str, args: list[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        self.socket_path = socket_path
        self.args = args
        self.log_path = log_path
        self.env = env
        self.prefix = prefix or []  # a command the daemon runs under, e.g. ["prlimit", "--nofile=1024:4096", "--"]
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> DaemonProcess:
        out: IO[bytes] | int = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "hkvd.daemon", "serve", "--socket", self.socket_path, *self.args],
            stdout=out, stderr=subprocess.STDOUT, env=self.env,
        )
        return self

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        self.spawn()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hkvd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with DaemonClient(self.socket_path, client_name="probe", role="tool", timeout_s=1.0) as c:
                    c.ping()
                return
            except KVError:
                time.sleep(0.05)
        raise RuntimeError(f"hkvd did not become ready in {timeout_s} s:\n{self.log()}")

    def status(self) -> dict[str, Any]:
        return daemon_status(self.socket_path)

    def wait_status(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float,
                    poll_s: float = 0.02) -> dict[str, Any]:
        """The first status for which ``pred`` holds; ``AssertionError`` with the last one after ``timeout_s``."""
        return wait_status(self.socket_path, pred, timeout_s, poll_s)

    def stop(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        return stop_process(self.proc, timeout_s)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
