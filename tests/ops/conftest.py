"""Ops fixtures: a notify socket opened by the test, a daemon spawned with a chosen environment, HTTP GETs."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hkvd.shim.testing.launcher import stop_process


class NotifySocket:
    """The service manager's side of sd_notify: an AF_UNIX datagram socket the daemon sends to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: list[dict[str, str]] = []

    def recv(self, timeout_s: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        msg = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append(msg)
        return msg

    def wait_for(self, key: str, timeout_s: float = 30.0,
                 on_message: Callable[[dict[str, str]], None] | None = None) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if msg is None:
                break
            if on_message is not None:
                on_message(msg)
            if key in msg:
                return msg
        raise AssertionError(f"no {key} within {timeout_s} s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    ns = NotifySocket(str(tmp_path / "notify.sock"))
    yield ns
    ns.close()


class Spawned:
    def __init__(self, proc: subprocess.Popen[bytes], socket_path: str, log_path: Path) -> None:
        self.proc, self.socket_path, self.log_path = proc, socket_path, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, needle: str, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log()
            if needle in text:
                return text
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not logged within {timeout_s} s:\n{self.log()}")

    def stop(self, timeout_s: float = 20.0) -> int:
        return stop_process(self.proc, timeout_s)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Spawned]]:
    """Start ``hkvd serve`` without waiting for it (the test decides what "ready" means)."""
    procs: list[Spawned] = []

    def start(*args: str, env: dict[str, str] | None = None, name: str = "hkvd") -> Spawned:
        sock, log_path = str(tmp_path / f"{name}.sock"), tmp_path / f"{name}.log"
        full_env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        full_env.update(env or {})
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", sock,
                                     "--hugepages", "off", *args],
                                    stdout=log, stderr=subprocess.STDOUT, env=full_env)
        s = Spawned(proc, sock, log_path)
        procs.append(s)
        return s

    yield start
    for s in procs:
        if s.proc.poll() is None:
            s.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout_s: float = 5.0, method: str = "GET") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def wait_http(port: int, path: str, status: int, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            code, body = http_get(port, path, timeout_s=2.0)
            if code == status:
                return body
            last = (code, body)
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"GET {path} never answered {status} within {timeout_s} s; last: {last}")


@pytest.fixture
def web() -> SimpleNamespace:
    """HTTP helpers for tests (conftest modules cannot be imported under --import-mode=importlib)."""
    return SimpleNamespace(free_port=free_port, get=http_get, wait=wait_http)
