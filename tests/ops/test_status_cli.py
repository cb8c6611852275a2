"""``hkvd status`` against a real daemon: the text a person reads, and --json for scripts."""

from __future__ import annotations

import json
import subprocess
import sys

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine


def hkvd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hkvd.daemon", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_status_text_and_json(daemon, engine_proc):
    engine_proc(daemon.socket_path, "store", "--tokens", "256", "--seed", "3")
    engine_proc(daemon.socket_path, "fetch", "--tokens", "256", "--seed", "3")
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, 4096)], num_blocks=16, model="live-model")
    try:
        out = hkvd("status", "--socket", daemon.socket_path)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        lines = {line.split()[0]: line for line in text.splitlines() if line and not line.startswith(" ")}
        assert lines["state"].endswith("serving")
        assert "/ 128.0 MiB used" in lines["pool"]
        assert "8 ready (8 full)" in lines["entries"]
        assert "128.0 KiB stored, 128.0 KiB retrieved" in lines["traffic"]
        assert "100.0% of chunks (8 hit, 0 missed in 1 lookups)" in lines["hit"]
        assert "1 connected" in lines["engines"]
        assert "live-model rank 0/1" in text
        assert "objects frozen in 1 freezes (every 10000 entries)" in lines["gc"]  # the start-up freeze
        assert all(len(line) <= 120 for line in text.splitlines())  # fits a terminal

        js = hkvd("status", "--socket", daemon.socket_path, "--json")
        assert js.returncode == 0, js.stderr
        s = json.loads(js.stdout)
        assert s["index"]["ready"] == 8
        assert s["counters"]["lookup_hit_chunks"] == 8
        assert [e["model"] for e in s["engines"]] == ["live-model"]
        assert s["shutting_down"] is False
        assert s["heap"]["freezes"] == 1 and s["heap"]["frozen_objects"] > 10_000  # the imported modules, at least
    finally:
        eng.close()


def test_status_without_a_daemon_fails_clearly(tmp_path):
    out = hkvd("status", "--socket", str(tmp_path / "none.sock"), "--timeout-s", "2")
    assert out.returncode == 1
    assert out.stderr.startswith("hkvd status:")
