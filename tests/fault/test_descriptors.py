"""Thousands of engine connections: past descriptor 1023 nothing fails, and past the limit the refusal is typed.

Each engine connection holds three descriptors in the daemon (socket, pidfd, /proc/PID/mem). Four
``crowd`` processes (tests/fault/fault_engines.py) open 500 real client connections each and register
an engine on every one. The daemon starts under ``prlimit --nofile=1024:HARD``: ``hkvd serve`` raises
its soft limit to HARD itself.

- HARD 8192: every one of the 2,000 registrations succeeds (descriptors past 6,000).
- HARD 3072: registrations succeed until the descriptor reserve is reached, every later one is
  refused with RESOURCE_EXHAUSTED naming LimitNOFILE; an engine registered before keeps storing and
  retrieving byte-exact, ``hkvd status`` and ``/metrics`` answer and show the descriptors, and once
  the crowd leaves a new engine registers again.

Neither run may answer INTERNAL (``internal_errors`` stays 0).
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hkvd.shim.testing.launcher import DaemonProcess
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys

PROCESSES, PER_PROCESS = 4, 500
SMALL = [GroupShape("full", 2, 16 << 10)]


def _daemon(tmp_path: Path, hard: int, *args: str) -> DaemonProcess:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard and os.geteuid() != 0:
        pytest.skip(f"needs an open-file hard limit of {hard} (ulimit -Hn) or root")
    return DaemonProcess(str(tmp_path / "hkvd.sock"), ["--hugepages", "off", "--l1-size-gb", "0.125",
                                                       "--chunk-size", "32", *args],
                         tmp_path / "hkvd.log", prefix=["prlimit", f"--nofile=1024:{hard}", "--"]).start(60)


def _crowd(fault: Any, d: DaemonProcess, stop: Path) -> tuple[list[Any], list[dict[str, Any]]]:
    procs = [fault.spawn(d, "crowd", "--engines", str(PER_PROCESS), "--stop-file", str(stop))
             for _ in range(PROCESSES)]
    return procs, [p.ready(90) for p in procs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _roundtrip(eng: SyntheticEngine, seed: int) -> None:
    keys = chunk_keys(prompt_tokens(32 * 4, seed=seed), eng.chunk_size)
    eng.fill_random(0, range(1, 9), seed=seed)
    want = [eng.block_bytes(0, b) for b in range(1, 9)]
    assert eng.store(eng.items(0, keys, first_block=1)).ok
    hit, lease = eng.lookup(keys)
    assert hit == 4
    eng.zero(0, range(9, 17))
    eng.retrieve(eng.items(0, keys, first_block=9), lease)
    assert [eng.block_bytes(0, b) for b in range(9, 17)] == want


def test_two_thousand_engines_register_past_descriptor_1023(tmp_path: Path, fault: Any) -> None:
    d = _daemon(tmp_path, 8192)
    try:
        _, ready = _crowd(fault, d, tmp_path / "stop")
        assert [r["registered"] for r in ready] == [PER_PROCESS] * PROCESSES
        assert [r["refused"] for r in ready] == [{}] * PROCESSES and sum(r["dropped"] for r in ready) == 0
        s = d.status()
        assert len([e for e in s["engines"] if e["model"] == "crowd"]) == PROCESSES * PER_PROCESS
        assert s["descriptors"]["used"] > 3 * PROCESSES * PER_PROCESS > 1024
        assert s["descriptors"]["limit"] == 8192  # raised by hkvd serve from prlimit's 1024
        assert s["counters"].get("internal_errors", 0) == 0
        eng = SyntheticEngine(d.socket_path, SMALL, num_blocks=24)
        _roundtrip(eng, seed=1)
        eng.close()
        print(f"\nRELIABILITY {PROCESSES * PER_PROCESS} engine connections from {PROCESSES} processes: all "
              f"registered, {s['descriptors']['used']} descriptors open (limit 8192), 0 internal errors")
    finally:
        (tmp_path / "stop").touch()
        d.stop()
    assert "soft limit raised from 1024 to 8192, hard limit 8192" in d.log()


def test_out_of_descriptors_is_a_typed_refusal_and_served_engines_go_on(tmp_path: Path, fault: Any) -> None:
    port = _free_port()
    d = _daemon(tmp_path, 3072, "--metrics-port", str(port))
    stop = tmp_path / "stop"
    try:
        first = SyntheticEngine(d.socket_path, SMALL, num_blocks=24)  # registered before the crowd
        procs, ready = _crowd(fault, d, stop)
        registered = sum(r["registered"] for r in ready)
        refused = sum(r["refused"].get("RESOURCE_EXHAUSTED", 0) for r in ready)
        # Every connection registered or got the typed refusal: no other error, none closed without a word.
        assert [set(r["refused"]) - {"RESOURCE_EXHAUSTED"} for r in ready] == [set()] * PROCESSES
        assert sum(r["dropped"] for r in ready) == 0
        assert registered + refused == PROCESSES * PER_PROCESS
        assert 3 * registered > 3072 * 3 // 4 and refused > 0  # most of the limit went to engines
        message = next(r["messages"]["RESOURCE_EXHAUSTED"] for r in ready if r["refused"])
        assert "out of file descriptors" in message and "LimitNOFILE" in message

        _roundtrip(first, seed=2)  # the engine served before is untouched
        out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "status", "--socket", d.socket_path],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("files "))
        assert "of 3072 open (hard 3072, 192 reserved): room for ~0 engines" in line
        assert line.endswith(f"; {refused} refused: raise LimitNOFILE") and len(line) <= 120
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert f'hkvd_connections_refused_total{{reason="descriptors"}} {float(refused)}' in metrics
        assert "hkvd_process_max_fds 3072.0" in metrics and "hkvd_internal_errors_total 0.0" in metrics
        s = d.status()
        assert s["counters"].get("internal_errors", 0) == 0
        assert s["counters"]["connections_refused"] == refused
        print(f"\nRELIABILITY {PROCESSES * PER_PROCESS} engine connections against an open-file limit of 3072: "
              f"{registered} registered, {refused} refused with RESOURCE_EXHAUSTED, 0 closed without a word, "
              f"{s['descriptors']['used']} descriptors open, 0 internal errors")

        stop.touch()
        results = [p.result(60) for p in procs]
        assert sum(r["alive"] for r in results) == registered  # every registered connection still answered
        s = d.wait_status(lambda s: len(s["engines"]) == 1, 60)
        late = SyntheticEngine(d.socket_path, SMALL, num_blocks=24)  # room again: it registers
        _roundtrip(late, seed=3)
        late.close()
        first.close()
        assert d.status()["counters"].get("internal_errors", 0) == 0
    finally:
        stop.touch()
        d.stop()
    log = d.log()
    assert "engine connection(s)" in log and "LimitNOFILE" in log
