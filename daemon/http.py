"""Loopback HTTP endpoint: Prometheus ``/metrics`` and ``/healthz`` on ``--metrics-port`` (127.0.0.1 only).

Role
    A small asyncio HTTP/1.0 server: it reads one ``GET`` (or ``HEAD``) request line and its headers
    within ``READ_TIMEOUT_S``, answers, and closes. ``/metrics`` is rendered by prometheus-client's
    ``generate_latest`` from the daemon's ``Metrics`` and ``KVService.status()`` at scrape time;
    ``/healthz`` is 503 until the pool is pre-faulted and the control socket accepts, 200 while
    serving, 503 again once shutdown begins.

Dependencies
    prometheus-client is optional (``pip install hkvd[metrics]``): it is imported only when this
    module builds the registry, so the base install runs without it. ``require_prometheus()`` gives
    the error the CLI prints when ``--metrics-port`` is set and it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from hkvd.daemon.errors import StartupError

log = logging.getLogger("hkvd.http")

READ_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
HOST = "127.0.0.1"

# Counters that always appear (0 until incremented), name -> help. Other Metrics counters are exported
# too, generically, as hkvd_<name>_total with their labels.
COUNTERS: dict[str, str] = {
    "lookups": "Lookup requests served",
    "lookup_hit_chunks": "Chunks that lookups found (the hybrid hit, in chunks)",
    "lookup_miss_chunks": "Chunks that lookups did not find",
    "stored_bytes": "Bytes stored into the pool, by group kind",
    "retrieved_bytes": "Bytes retrieved from the pool, by group kind",
    "retrieve_misses": "Retrieves of entries no longer in the pool",
    "stores_dropped": "Entries not stored because the pool was full of pinned entries, by kind",
    "step_events": "Step events, by outcome",
    "step_event_gaps": "Step-event sequence gaps (unconfirmed Mamba states invalidated)",
    "snapshots_invalidated": "Mamba snapshot jobs invalidated",
    "leases_expired": "Lookup leases that expired unreleased",
    "errors": "Errors sent to clients, by code",
    "internal_errors": "Internal errors (bugs)",
    "copy_timeouts": "Copies that exceeded their timeout",
    "copy_errors": "Copies that failed",
    "engines_registered": "Engine registrations",
    "lookup_hit_entries": "Entries the served hits load, by group kind",
    "lookup_miss_entries": "Entries whose absence cut a lookup's hit short, by group kind",
    "uncacheable_requests": "Requests the shim could not key safely, never cached, by reason",
    "connections_refused": "Engine connections refused at their Hello, by reason (descriptors: the open-file "
                           "limit's reserve was reached; raise LimitNOFILE)",
}
HELP = {
    **COUNTERS,
    "l2_hits": "Entries read from the disk tier into the pool for a lookup, by group kind",
    "l2_read_failures": "Disk-tier reads not served (checksum, truncated, io, timeout, pool_full), by reason",
    "cluster_hits": "Entries read from the cluster tier into the pool for a lookup, by group kind",
    "cluster_read_failures": "Cluster-tier reads not served (mac, size, header, gone, io, timeout, pool_full), by "
                             "reason",
    "gc_collections": "Cyclic garbage collections, by generation",
    "gc_pause_seconds": "Seconds the event loop stood still in garbage collections, by generation",
}
# The disk tier's counters (status()["l2"]), exported as hkvd_l2_<name>_total.
L2_COUNTERS = {
    "writes": "Entries written to the disk tier",
    "write_bytes": "Bytes written to the disk tier (headers included)",
    "write_errors": "Disk-tier writes that failed (disk full, I/O error)",
    "queue_drops": "Entries not written because the write-behind queue was full",
    "evictions": "Disk-tier files deleted to stay under --l2-size-gb",
    "reads": "Disk-tier files read and verified",
    "read_bytes": "Payload bytes read from the disk tier",
    "read_errors": "Disk-tier reads that failed with an I/O error",
}
# The cluster tier's counters (status()["cluster"]), exported as hkvd_cluster_<name>_total.
CLUSTER_COUNTERS = {
    "puts": "Entries put in the cluster (write-behind)",
    "put_bytes": "Bytes put in the cluster (headers included)",
    "gets": "Entries read from the cluster and verified",
    "get_bytes": "Payload bytes read from the cluster",
    "misses": "Entries a lookup asked the cluster for that it did not hold",
    "reconnects": "Times the master became reachable again after an outage",
}
CLUSTER_BY_REASON = {
    "skips": "Offers not put in the cluster (queue_full, unavailable, cluster_full, busy), by reason",
    "errors": "Cluster calls that failed (connect, exist, put, get), by operation",
    "corrupt": "Cluster values found unusable (mac: not sealed with a fleet key this node holds, or damaged; "
               "size, header) and removed, by reason",
}
GAUGE_COUNTERS = {"prefault_gbps"}  # kept with Metrics.inc once, exported as gauges


class PrometheusMissing(StartupError, RuntimeError):
    """--metrics-port without prometheus_client installed; the message names the install."""

    exit_code = 2


def require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise PrometheusMissing("--metrics-port needs prometheus-client: pip install 'hkvd[metrics]' "
                                "(or prometheus-client), or leave --metrics-port unset") from None


class DaemonCollector:
    """Reads the daemon's state at scrape time; ``daemon`` is ``hkvd.daemon.app.Daemon``."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, Metric

        d = self.daemon
        snap = d.metrics.snapshot()
        for name in sorted(set(COUNTERS) | set(snap)):
            if name in GAUGE_COUNTERS:
                continue
            m = Metric(f"hkvd_{name}", HELP.get(name, name.replace("_", " ")), "counter")
            series = snap.get(name) or {(): 0.0}
            for labels, value in sorted(series.items()):
                m.add_sample(f"hkvd_{name}_total", dict(labels), value)
            yield m
        yield GaugeMetricFamily("hkvd_ready", "1 while serving (pool pre-faulted, socket accepting)",
                                value=1.0 if d.health()[0] else 0.0)
        yield GaugeMetricFamily("hkvd_prefault_gbps", "Pool pre-fault bandwidth at start-up",
                                value=d.metrics.total("prefault_gbps"))
        service = d.service
        if service is None:
            return
        s = service.status()
        pool, idx = s["pool"], s["index"]
        g = GaugeMetricFamily("hkvd_pool_bytes", "Pool bytes by state", labels=["state"])
        for state in ("total", "used", "free", "faulted"):
            g.add_metric([state], pool[f"{state}_bytes"])
        yield g
        g = GaugeMetricFamily("hkvd_pool_page_size_bytes", "Page size backing the pool, by the kind the kernel "
                              "reports (hugetlb, thp or plain; /proc/self/smaps)", labels=["kind"])
        g.add_metric([pool["kind"]], pool["page_size"])
        yield g
        yield GaugeMetricFamily("hkvd_pool_huge_bytes", "Pool bytes backed by huge pages (hugetlb or THP)",
                                value=pool["huge_bytes"])
        yield GaugeMetricFamily("hkvd_pool_occupancy_ratio", "Used / total pool bytes",
                                value=pool["used_bytes"] / max(pool["total_bytes"], 1))
        g = GaugeMetricFamily("hkvd_entries", "Index entries by state", labels=["state"])
        for state in ("ready", "pending", "writing"):
            g.add_metric([state], idx[state])
        yield g
        g = GaugeMetricFamily("hkvd_entries_by_kind", "Index entries by group kind", labels=["kind"])
        for kind, n in sorted(idx.get("by_kind", {}).items()):
            g.add_metric([str(kind)], n)
        yield g
        yield GaugeMetricFamily("hkvd_bytes_stored", "Bytes held by index entries", value=idx["bytes_stored"])
        for name, help_ in (("evictions", "Entries evicted"), ("orphans_dropped", "Orphaned entries dropped"),
                            ("orphans_marked", "Entries found unable to serve any hit (evicted first by hybrid)"),
                            ("index_stores_dropped", "Stores the index dropped (pool full)")):
            m = Metric(f"hkvd_{name}", help_, "counter")
            m.add_sample(f"hkvd_{name}_total", {}, idx[name.removeprefix("index_")])
            yield m
        yield GaugeMetricFamily("hkvd_leases", "Lookup leases held", value=idx["leases"])
        yield GaugeMetricFamily("hkvd_pinned_entries", "Entries pinned by a copy or a lease",
                                value=idx["pinned_entries"])
        g = GaugeMetricFamily("hkvd_engines", "Registered engines by role", labels=["role"])
        roles: dict[str, int] = {"worker": 0, "scheduler": 0}
        for e in s["engines"]:
            roles[e["role"]] = roles.get(e["role"], 0) + 1
        for role, n in sorted(roles.items()):
            g.add_metric([role], n)
        yield g
        g = GaugeMetricFamily("hkvd_copy_gbps", "Copy throughput of the last 64 copies (submit to done), by "
                              "direction", labels=["direction"])
        for direction, gbps in sorted(s["rates"]["copy_gbps"].items()):
            g.add_metric([direction], gbps)
        yield g
        if s.get("l2") is not None:
            yield from self._l2(s["l2"])
        if s.get("cluster") is not None:
            yield from self._cluster(s["cluster"])
        fds = s["descriptors"]  # used and the limit: hkvd_process_open_fds and hkvd_process_max_fds
        yield GaugeMetricFamily("hkvd_descriptor_reserve", "Descriptors kept free for the engines served: new "
                                "engines are refused once fewer are left", value=fds["reserve"])
        server = d.server
        if server is not None:
            yield GaugeMetricFamily("hkvd_connections", "Open control connections",
                                    value=len(server.connections))
            yield GaugeMetricFamily("hkvd_inflight_copies", "Copies running now",
                                    value=sum(c.inflight for c in server.connections.values()))


    @staticmethod
    def _l2(l2: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, help_ in L2_COUNTERS.items():
            yield CounterMetricFamily(f"hkvd_l2_{name}", help_, value=l2[name])
        c = CounterMetricFamily("hkvd_l2_corrupt_files", "Disk-tier files skipped as unusable (and deleted, "
                                "except another format version), by reason", labels=["reason"])
        for reason, n in sorted(l2["corrupt"].items()):
            c.add_metric([reason], n)
        yield c
        for name, help_, value in (
                ("entries", "Entries in the disk tier's catalog", l2["entries"]),
                ("bytes", "Bytes of the disk tier's files", l2["bytes"]),
                ("capacity_bytes", "The disk tier's cap (--l2-size-gb)", l2["cap_bytes"]),
                ("queued_entries", "Entries waiting in the write-behind queue", l2["queued"]),
                ("write_gbps", "Disk-tier write throughput, last 64 files", l2["write_gbps"]),
                ("read_gbps", "Disk-tier read throughput, last 64 files", l2["read_gbps"])):
            yield GaugeMetricFamily(f"hkvd_l2_{name}", help_, value=value)


    @staticmethod
    def _cluster(c: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, help_ in CLUSTER_COUNTERS.items():
            yield CounterMetricFamily(f"hkvd_cluster_{name}", help_, value=c[name])
        for name, help_ in CLUSTER_BY_REASON.items():
            m = CounterMetricFamily(f"hkvd_cluster_{name}", help_, labels=["reason"])
            for reason, n in sorted(c[name].items()):
                m.add_metric([reason], n)
            yield m
        for name, help_, value in (
                ("connected", "1 while the cluster's master answers", 1.0 if c["connected"] else 0.0),
                ("insecure", "1 when values are sealed with the public key (--cluster-insecure)",
                 1.0 if c["insecure"] else 0.0),
                ("queued_entries", "Entries waiting in the cluster write-behind queue", c["queued"]),
                ("put_gbps", "Cluster put throughput, last 64 batches", c["put_gbps"]),
                ("get_gbps", "Cluster get throughput, last 64 batches", c["get_gbps"])):
            yield GaugeMetricFamily(f"hkvd_cluster_{name}", help_, value=value)


def build_registry(daemon: Any) -> Any:
    require_prometheus()
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    ProcessCollector(namespace="hkvd", registry=registry)
    return registry


class HTTPEndpoint:
    """``/metrics`` and ``/healthz`` on 127.0.0.1:port. ``health()`` -> (ok, reason)."""

    def __init__(self, port: int, health: Callable[[], tuple[bool, str]], metrics_body: Callable[[], bytes],
                 host: str = HOST) -> None:
        self.port = port
        self.host = host
        self.health = health
        self.metrics_body = metrics_body
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics and health on http://%s:%d/metrics and /healthz", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
            self._server = None

    def _respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        if path == "/healthz":
            ok, reason = self.health()
            return (200 if ok else 503), "text/plain", (reason + "\n").encode()
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST

            return 200, CONTENT_TYPE_LATEST, self.metrics_body()
        return 404, "text/plain", b"try /metrics or /healthz\n"

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                head = b""
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            if len(head) > MAX_REQUEST_BYTES:
                head = b""
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                code, ctype, body = 400, "text/plain", b"bad request\n"
                method = "GET"
            else:
                method = parts[0]
                try:
                    code, ctype, body = self._respond(method, parts[1])
                except Exception:  # a scrape must never take the daemon down
                    log.exception("error answering %s %s", parts[0], parts[1])
                    code, ctype, body = 500, "text/plain", b"internal error\n"
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                      500: "Internal Server Error", 503: "Service Unavailable"}[code]
            writer.write(f"HTTP/1.0 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if method != "HEAD":
                writer.write(body)
            async with asyncio.timeout(READ_TIMEOUT_S):
                await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()
