"""Session pins and tenant quotas in a real ``hkvd serve`` over its socket: a pinned session survives a flood
that evicts an unpinned one, `hkvd unpin` and ``POST /unpin`` end pins, the TTL lapses, `hkvd status` and
/metrics show them; a tenant flooding the pool past its quota evicts only its own entries."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys

from hkvd.daemon.cli import format_status
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys

CHUNK = 32
PER_STORE = 32  # chunks per store: 64 blocks of the engine's 66
ENTRY = 2 * (128 << 10) * 2  # two layers of 128 KiB pages, two blocks per chunk: 512 KiB
POOL = ("--l1-size-gb", "0.0625", "--chunk-size", str(CHUNK))  # 64 MiB: about 120 entries


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(port: int, method: str, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _sample(body: str, series: str) -> float:
    """The value of ``series`` (name and labels as exposed) in a /metrics body; 0 when absent."""
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def _engine(daemon) -> SyntheticEngine:
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 2, 128 << 10)], num_blocks=66)
    assert eng.ack.pins  # the daemon says it takes pins and tenants
    eng.fill_random(0, range(66), seed=3)
    return eng


def _keys(seed: int) -> list[bytes]:
    return chunk_keys(prompt_tokens(CHUNK * PER_STORE, seed=seed), CHUNK)


def _store(eng: SyntheticEngine, keys: list[bytes], tenant: str = "") -> int:
    return eng.run(eng.client.submit_store(eng.items(0, keys, first_block=1), tenant=tenant)).result.stored


def _flood(eng: SyntheticEngine, first_seed: int, stores: int, tenant: str = "") -> None:
    for i in range(stores):
        _store(eng, _keys(first_seed + i), tenant)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hkvd.daemon", *args], capture_output=True, text=True,
                          timeout=30, check=False, env=dict(os.environ))


def test_a_pinned_session_survives_a_flood_and_hkvd_unpin_frees_it(daemon_factory):
    daemon = daemon_factory(*POOL)
    eng = _engine(daemon)
    try:
        pinned, loose = _keys(1)[:8], _keys(2)[:8]
        assert _store(eng, pinned) == 8 and _store(eng, loose) == 8
        eng.client.pin("chat-1", "", 300.0, pinned)
        st = daemon.wait_status(lambda s: s["pins"]["sessions"] == 1, 10)
        assert st["pins"]["pinned_bytes"] == 8 * ENTRY
        _flood(eng, 100, 6)  # 192 entries through a pool of about 120
        st = daemon.status()
        assert st["index"]["evictions"] > 50
        assert eng.lookup(pinned, lease=False)[0] == 8
        assert eng.lookup(loose, lease=False)[0] == 0
        text = format_status(st)  # hkvd status
        assert "pins      4.0 MiB pinned of 32.0 MiB allowed, 1 sessions (1 pins)" in text
        assert "  chat-1: 1 pins, 30" in text  # about 300 s left

        out = _cli("unpin", "chat-1", "--socket", daemon.socket_path)
        assert out.returncode == 0 and out.stdout.strip() == "unpinned chat-1: 1 pins ended", out
        out = _cli("unpin", "chat-1", "--socket", daemon.socket_path)
        assert out.returncode == 0 and out.stdout.strip() == "no pins held for session chat-1", out
        out = _cli("unpin", "bad id", "--socket", daemon.socket_path)
        assert out.returncode == 1 and "printable ASCII characters without spaces" in out.stderr
        st = daemon.status()
        assert st["pins"]["sessions"] == 0 and st["pins"]["lapsed"]["unpin"] == 1
        _flood(eng, 200, 6)
        assert eng.lookup(pinned, lease=False)[0] == 0
    finally:
        eng.close()


def test_the_ttl_lapses_and_post_unpin_ends_a_session_with_metrics(daemon_factory):
    port = _free_port()
    daemon = daemon_factory(*POOL, "--metrics-port", str(port))
    eng = _engine(daemon)
    try:
        short, long_ = _keys(1)[:4], _keys(2)[:4]
        _store(eng, short)
        _store(eng, long_)
        eng.client.pin("brief", "salt:ab", 1.0, short)
        eng.client.pin("agent-7", "salt:ab", 300.0, long_)
        st = daemon.wait_status(lambda s: s["pins"]["lapsed"]["ttl"] == 1, 10)  # housekeeping, every second
        assert [r["session"] for r in st["pins"]["longest"]] == ["agent-7"]
        _flood(eng, 100, 6)
        assert eng.lookup(short, lease=False)[0] == 0
        assert eng.lookup(long_, lease=False)[0] == 4

        status, body = _http(port, "GET", "/metrics")
        assert status == 200
        assert _sample(body, "hkvd_pinned_bytes") == 4 * ENTRY
        assert _sample(body, "hkvd_pin_sessions") == 1
        assert _sample(body, 'hkvd_pins_lapsed_total{reason="ttl"}') == 1
        assert _sample(body, 'hkvd_tenant_bytes{tenant=""}') > 0

        assert _http(port, "POST", "/unpin?session=agent-7") == (200, '{"session": "agent-7", "unpinned": 1}')
        assert _http(port, "POST", "/unpin?session=agent-7") == (200, '{"session": "agent-7", "unpinned": 0}')
        status, body = _http(port, "POST", "/unpin")
        assert status == 400 and "POST /unpin?session=ID" in json.loads(body)["error"]
        assert _http(port, "GET", "/unpin")[0] == 405
        body = _http(port, "GET", "/metrics")[1]
        assert _sample(body, "hkvd_pin_sessions") == 0
        assert _sample(body, 'hkvd_pins_lapsed_total{reason="unpin"}') == 1
    finally:
        eng.close()


def test_a_tenant_flooding_the_pool_evicts_only_its_own_entries_over_its_quota(daemon_factory):
    daemon = daemon_factory(*POOL, "--tenant-quota", "0.5")
    eng = _engine(daemon)
    try:
        quiet = _keys(1)[:20]
        assert _store(eng, quiet, "salt:b") == 20
        _flood(eng, 100, 8, "salt:a")  # 256 entries of tenant a
        st = daemon.status()
        assert eng.lookup(quiet, lease=False)[0] == 20
        t = st["tenants"]
        assert t["quotas"] and set(t["evictions"]) == {"salt:a"} and t["evictions"]["salt:a"] > 100
        assert t["bytes"]["salt:b"] == 20 * ENTRY
        assert st["index"]["stores_dropped"] == 0
        text = format_status(st)
        assert "tenants   2, quotas on" in text and "  salt:b: 10.0 MiB of 32.0 MiB, 0 evicted" in text
    finally:
        eng.close()


def test_pins_do_not_survive_a_restart_the_disk_tier_brings_the_entries_back(daemon_factory, tmp_path):
    l2 = str(tmp_path / "l2")
    first = daemon_factory(*POOL, "--l2-path", l2, "--l2-size-gb", "1", name="first")
    eng = _engine(first)
    pinned = _keys(1)[:8]
    try:
        assert _store(eng, pinned) == 8
        eng.client.pin("chat-1", "", 300.0, pinned)
        first.wait_status(lambda s: s["pins"]["sessions"] == 1 and s["l2"]["writes"] >= 8, 20)
    finally:
        eng.close()
    assert first.stop() == 0
    second = daemon_factory(*POOL, "--l2-path", l2, "--l2-size-gb", "1", name="second")
    eng = _engine(second)
    try:
        assert second.status()["pins"]["sessions"] == 0  # pins live in memory only
        assert eng.lookup(pinned, lease=False)[0] == 8  # the disk tier's files serve the hit
    finally:
        eng.close()
