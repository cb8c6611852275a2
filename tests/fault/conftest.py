"""Fault-suite fixtures: engine processes (tests/fault/fault_engines.py), status polling, the sweep.

``fault`` (a namespace, since conftest modules cannot be imported under --import-mode=importlib):

- ``fault.spawn(daemon, role, *args)`` starts an engine process; ``.ready()`` waits for its
  ready line, ``.result()`` for its final JSON, ``.kill()`` sends SIGKILL and reaps it.
- ``fault.wait_until(daemon, pred, timeout_s)`` polls ``hkvd status`` until ``pred(status)``;
  returns (status, seconds waited).
- ``fault.sweep(daemon, seed)`` stores more than the pool holds from a fresh layout and returns
  the pool figure afterwards (free bytes, entries, bytes stored). LRU evicts every older entry
  first, so two sweeps give the same figure exactly when nothing in between was left pinned,
  leased, pending, half-written or leaked: "the pool's free bytes come back to the same figure".
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

HERE = Path(__file__).resolve().parent
SWEEP_ENTRY = 1 << 20


class EngineProc:
    def __init__(self, role: str, args: list[str]) -> None:
        self.role = role
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fault_engines.py"), role, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[dict[str, Any]] = []
        self.err = b""
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._cv:
                self.lines.append(json.loads(raw))
                self._cv.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    def _wait_line(self, key: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for line in self.lines:
                    if key in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                self._cv.wait(min(left, 0.2))
        self.proc.wait(5) if self.proc.poll() is not None else None
        time.sleep(0.2)
        raise AssertionError(f"{self.role}: no {key!r} line within {timeout_s} s (rc {self.proc.poll()}):\n"
                             f"{self.err.decode(errors='replace')[-3000:]}")

    def ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self._wait_line("ready", timeout_s)

    def result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        res = self._wait_line("result", timeout_s)["result"]
        self.proc.wait(30)
        return res

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def wait_until(daemon: Any, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    while True:
        st = daemon.status()
        waited = time.monotonic() - t0
        if pred(st) or waited > timeout_s:
            return st, waited
        time.sleep(0.01)


def sweep(daemon: Any, seed: int) -> tuple[int, int, int]:
    st = daemon.status()
    total = st["pool"]["total_bytes"]
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, SWEEP_ENTRY // 2)], num_blocks=2,
                          tokens_per_block=16, chunk_size=16, model="sweeper", timeout_s=60)
    try:
        keys = chunk_keys(prompt_tokens(16 * (total // SWEEP_ENTRY + 32), seed=900_000 + seed), 16)
        for i in range(0, len(keys), 16):
            eng.store([Item(0, c, keys[c], [1]) for c in range(i, min(i + 16, len(keys)))])
        # Room a store could not take at the moment (an entry pinned for a scrub pass's read, a copy still
        # settling) is taken by a few more entries, so that the figure does not depend on such a moment.
        for extra in range(4):
            st = daemon.status()
            if st["pool"]["free_bytes"] < SWEEP_ENTRY:
                break
            more = chunk_keys(prompt_tokens(16 * 8, seed=950_000 + 10 * seed + extra), 16)
            eng.store([Item(0, c, more[c], [1]) for c in range(len(more))])
    finally:
        eng.close()
    st = daemon.status()
    return st["pool"]["free_bytes"], st["index"]["entries"], st["index"]["bytes_stored"]


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of ``pid`` in KiB, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            out[key] = int(value.split()[0])
    return out


@pytest.fixture
def fault() -> Iterator[SimpleNamespace]:
    procs: list[EngineProc] = []

    def spawn(daemon: Any, role: str, *args: str) -> EngineProc:
        p = EngineProc(role, ["--socket", daemon.socket_path, *args])
        procs.append(p)
        return p

    yield SimpleNamespace(spawn=spawn, wait_until=wait_until, sweep=sweep, rss_kib=rss_kib)
    for p in procs:
        if p.proc.poll() is None:
            p.kill()
