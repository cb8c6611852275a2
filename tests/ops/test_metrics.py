"""/metrics and /healthz scraped for real from a daemon process."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from hkvd.daemon.app import Daemon
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.http import HTTPEndpoint
from hkvd.shim.client import DaemonClient
from hkvd.transport.errors import NotRegistered


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_and_healthz_from_a_real_daemon(daemon_factory, engine_proc, web):
    port = web.free_port()
    d = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "32", "--metrics-port", str(port))
    assert web.wait(port, "/healthz", 200) == "ok\n"
    stored = engine_proc(d.socket_path, "store", "--tokens", "256", "--seed", "3")
    fetched = engine_proc(d.socket_path, "fetch", "--tokens", "256", "--seed", "3")
    assert fetched["hit_chunks"] == 8 and fetched["digest"] == stored["digest"]
    engine_proc(d.socket_path, "fetch", "--tokens", "256", "--seed", "4")  # 8 misses
    with DaemonClient(d.socket_path, client_name="bad", role="tool", timeout_s=5.0) as c:
        rid = c.submit_lookup([b"\0" * 16])
        comp = c.wait([rid], timeout_s=5.0)[rid]
        assert isinstance(comp.error, NotRegistered)
        code, body = web.get(port, "/metrics")
    assert code == 200
    m = samples(body)
    assert m[("hkvd_lookup_hit_chunks_total", ())] == 8
    assert m[("hkvd_lookup_miss_chunks_total", ())] == 8
    assert m[("hkvd_stored_bytes_total", (("kind", "full"),))] > 0
    assert m[("hkvd_retrieved_bytes_total", (("kind", "full"),))] == m[("hkvd_stored_bytes_total",
                                                                        (("kind", "full"),))]
    assert m[("hkvd_errors_total", (("code", "NOT_REGISTERED"),))] == 1
    assert 0 < m[("hkvd_pool_occupancy_ratio", ())] < 1
    assert m[("hkvd_pool_bytes", (("state", "total"),))] == 128 << 20
    assert m[("hkvd_entries", (("state", "ready"),))] == 8
    for name in ("hkvd_evictions_total", "hkvd_leases", "hkvd_pinned_entries", "hkvd_step_event_gaps_total",
                 "hkvd_copy_timeouts_total", "hkvd_ready", "hkvd_connections"):
        assert (name, ()) in m, name
    assert m[("hkvd_ready", ())] == 1
    assert m[("hkvd_engines", (("role", "worker"),))] == 0  # the engines have exited
    assert ("hkvd_process_resident_memory_bytes", ()) in m
    assert web.get(port, "/nope")[0] == 404
    assert web.get(port, "/healthz", method="POST")[0] == 405
    assert d.stop() == 0


def test_connected_engines_gauge_counts_a_live_engine(daemon_factory, web):
    from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine

    port = web.free_port()
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", "32", "--metrics-port", str(port))
    eng = SyntheticEngine(d.socket_path, [GroupShape("full", 2, 4096)], num_blocks=16)
    try:
        m = samples(web.get(port, "/metrics")[1])
        assert m[("hkvd_engines", (("role", "worker"),))] == 1
    finally:
        eng.close()


def test_metrics_port_is_loopback_only(daemon_factory, web):
    import socket

    port = web.free_port()
    daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", "32", "--metrics-port", str(port))
    web.wait(port, "/healthz", 200)
    addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
    for addr in addrs:  # any non-loopback address of this host refuses
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((addr, port)) != 0


def test_healthz_is_503_before_ready_and_while_shutting_down():
    daemon = Daemon(DaemonConfig(socket_path="/nonexistent/x.sock"))
    assert daemon.health() == (False, "starting: pre-faulting the pool")
    daemon.ready.set()
    assert daemon.health() == (True, "ok")
    daemon.stopping = True
    assert daemon.health() == (False, "shutting down")


async def test_http_endpoint_answers_health_states_and_survives_garbage():
    state = {"ok": False}
    ep = HTTPEndpoint(0, lambda: (state["ok"], "ok" if state["ok"] else "starting"), lambda: b"x 1\n")
    await ep.start()
    try:
        async def get(raw: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", ep.port)
            w.write(raw)
            await w.drain()
            async with asyncio.timeout(5):
                data = await r.read()
            w.close()
            return data

        assert (await get(b"GET /healthz HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.0 503")
        state["ok"] = True
        assert (await get(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")).startswith(
            b"HTTP/1.1 200")
        assert (await get(b"garbage\r\n\r\n")).startswith(b"HTTP/1.0 400")
        assert (await get(b"GET /metrics HTTP/1.0\r\n\r\n")).endswith(b"x 1\n")
    finally:
        await ep.close()


def test_metrics_port_without_prometheus_client_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from hkvd.daemon.cli import main\n"
            f"sys.exit(main(['serve', '--socket', '{tmp_path}/s.sock', '--metrics-port', '9999']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "pip install 'hkvd[metrics]'" in out.stderr
