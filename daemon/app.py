"""The daemon: builds the pool, index, registry and server, runs them, shuts them down in order.

Start-up
    The health endpoint (``--metrics-port``) and the systemd watchdog start first, so both answer
    while the pool's first slice pre-faults and the disk tier (``--l2-path``) is scanned;
    ``READY=1`` (and ``/healthz`` 200) follow once both are done and the control socket accepts.
    The rest of the pool is faulted in behind serving by ``--prefault-threads`` threads, each
    superblock handed to the allocator once faulted (daemon/cache/prefault.py); ``STATUS=`` reports the
    faulted share every second until it is all in. Before ready, every second with progress sends
    ``EXTEND_TIMEOUT_USEC`` so systemd's start timeout never kills a start that is progressing
    (``daemon/prefault_progress.py``).

Shutdown sequence (SIGTERM or SIGINT)
    0. tell systemd ``STOPPING=1``; ``/healthz`` turns 503;
    1. stop accepting (close the listener, unlink the socket);
    2. reject new work with SHUTTING_DOWN;
    3. drain in-flight copies within ``shutdown_timeout_s``;
    4. flush the disk tier's write-behind queue within what is left of that deadline (what is not
       flushed is logged; it is missing from the disk copy only);
    5. close connections (which releases leases and pins), the copy engine and the pool.
Exit code 0 after a clean shutdown.

Reload (SIGHUP)
    Re-reads ``--config`` (flags still win) and applies what can change safely while serving:
    ``log-level``, ``lease-ttl-s`` (new leases only), and the cluster tier's fleet keys (both key
    files are read again, even under unchanged names). Every other changed key is logged as
    "needs a restart" and ignored. A config that fails to parse or validate, or a key file that
    fails its checks, is logged and ignored. The running config is one ``ConfigCell``
    (``daemon/config.py``), swapped whole by a reload; the service reads it at each use. The reload
    itself is ``daemon/reload.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hkvd.daemon.cache import (
    Cache,
    HugePagePool,
    Tenants,
    default_threads,
    first_slice_bytes,
    make_policy,
)
from hkvd.daemon.config import ConfigCell, DaemonConfig
from hkvd.daemon.engines.engine_factory import make_copy_engine
from hkvd.daemon.engines.registry import Registry
from hkvd.daemon.engines.service import KVService
from hkvd.daemon.engines.service_stats import ServiceStats
from hkvd.daemon.heap import HeapPolicy
from hkvd.daemon.hints.endpoint import HintsEndpoint
from hkvd.daemon.http import HTTPEndpoint, Request, Response, build_registry, ipaddress_is_loopback, text
from hkvd.daemon.integrity.checksums import Checksums
from hkvd.daemon.integrity.quarantine import Quarantine
from hkvd.daemon.integrity.scrub import Scrubber
from hkvd.daemon.metrics import CounterStats, Metrics
from hkvd.daemon.notify import Notifier
from hkvd.daemon.peers.links import PeerService, peers_wanted
from hkvd.daemon.prefault_progress import EXTEND_TIMEOUT_S, PrefaultProgress
from hkvd.daemon.reload import log_fleet_keys, reload_config
from hkvd.daemon.routing.announcer import Announcer
from hkvd.daemon.routing.kv_events import MEDIUM_CLUSTER, MEDIUM_DISK, Batch, EventLog
from hkvd.daemon.routing.usable_prefix import FormatBook, UsablePrefix
from hkvd.daemon.routing.zmq_publisher import ZmqPublisher
from hkvd.daemon.server import Server, ServerStats
from hkvd.daemon.startup_errors import StartupError
from hkvd.daemon.tiers.cluster import ClusterSettings, ClusterTier
from hkvd.daemon.tiers.cluster_value import FleetKeys
from hkvd.daemon.tiers.disk import DiskTier
from hkvd.transport.copy_engine import CopyEngine
from hkvd.transport.errors import KVError, PoolError, ProtocolViolation
from hkvd.transport.stat_fields import metric, part
from hkvd.transport.wire import control

log = logging.getLogger("hkvd")

HOUSEKEEPING_S = 1.0
STATUS_EVERY_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonStats:
    """What /metrics exports: every counter, readiness, the service's statistics (also ``hkvd status``) once
    it exists, the control socket's connections once it listens."""

    counters: CounterStats = part()
    ready: bool = metric("hkvd_ready", "1 while serving (pool pre-faulted, socket accepting)")
    service: ServiceStats | None = part()
    server: ServerStats | None = part()


class Daemon:
    def __init__(self, cfg: DaemonConfig, *, notifier: Notifier | None = None,
                 reload_config: Callable[[], DaemonConfig] | None = None) -> None:
        self.config = ConfigCell(cfg)  # the one running config: reload swaps it, the service reads it
        self.metrics = Metrics()
        self.heap = HeapPolicy(cfg.gc_freeze_every, self.metrics)
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self.stopping = False
        self.pool: HugePagePool | None = None
        self.server: Server | None = None
        self.service: KVService | None = None
        self.disk: DiskTier | None = None
        self.checks: Checksums | None = None  # entry checksums and the scrubber, once the index is built
        self.scrubber: Scrubber | None = None
        self.cluster: ClusterTier | None = None  # with --cluster
        self.copy_engine: CopyEngine | None = None  # built here, closed here (shutdown, or a failed start)
        self.ready_hooks: list[Callable[[], None]] = []
        self.notifier = notifier if notifier is not None else Notifier()
        self.reload_config = reload_config
        self.http: HTTPEndpoint | None = None  # when --metrics-port is set
        self.routing: UsablePrefix | None = None  # routers' lookups on the metrics port, once the service exists
        self.hints: HintsEndpoint | None = None  # routers' KV hints on the metrics port (docs/hints.md), likewise
        self.peers: PeerService | None = None  # when --peer-listen or a peer token is set
        self.publisher: ZmqPublisher | None = None  # with --kv-events-endpoint
        self.announcer: Announcer | None = None

    @property
    def cfg(self) -> DaemonConfig:
        """The running config (``config.current``); a reload replaces it."""
        return self.config.current

    def request_stop(self) -> None:
        self._stop.set()

    def health(self) -> tuple[bool, str]:
        """(serving?, why) for /healthz: not before pre-fault + accepting, not while shutting down."""
        if self.stopping:
            return False, "shutting down"
        if not self.ready.is_set():
            return False, "starting: pre-faulting the pool" if self.server is None else "starting"
        return True, "ok"

    def statistics(self) -> DaemonStats:
        """What /metrics exports (``hkvd.daemon.http``); ``hkvd status`` is the service's part."""
        return DaemonStats(counters=self.metrics.statistics(), ready=self.health()[0],
                           service=self.service.statistics() if self.service is not None else None,
                           server=self.server.statistics() if self.server is not None else None)

    def summary(self) -> str:
        """One line for STATUS=: engines, pool occupancy, chunk hit rate."""
        if self.service is None:
            return "starting"
        s = self.service.statistics()
        pool, c = s.pool, s.counters
        hits, misses = c.get("lookup_hit_chunks", 0), c.get("lookup_miss_chunks", 0)
        rate = f"{hits / (hits + misses):.0%}" if hits + misses else "n/a"
        used = pool.used_bytes / max(pool.total_bytes, 1)
        return f"serving {len(s.registry.engines)} engines; pool {used:.0%} used; chunk hit rate {rate}"

    async def _start_http(self) -> None:
        if not self.cfg.metrics_port:
            return
        from prometheus_client import generate_latest


        registry = build_registry(self.statistics)
        http = HTTPEndpoint(self.cfg.metrics_port, self.health, lambda: generate_latest(registry),
                            host=self.cfg.metrics_host)
        # Routers' usable-prefix lookups (docs/routing.md): 503 until the service exists.
        http.route("GET", "/v1/models", lambda req: self.routing.get_models(req) if self.routing is not None
                   else text(503, "starting"))
        http.route("POST", "/v1/usable_prefix", lambda req: self.routing.post(req) if self.routing is not None
                   else text(503, "starting"))
        # KV hints from routers and agent frameworks (docs/hints.md).
        http.route("POST", "/v1/kv/hints", lambda req: self.hints.post(req) if self.hints is not None
                   else text(503, "starting"))
        # A router or agent framework that knows a session ended (docs/pins.md).
        http.route("POST", "/unpin", self._unpin_route)
        self.http = http
        await http.start()
        if not ipaddress_is_loopback(self.cfg.metrics_host):
            log.warning("the metrics port listens on %s: other hosts can read the metrics and the prefix lengths "
                        "this node holds (--metrics-host)", self.cfg.metrics_host)

    def _unpin_route(self, req: Request) -> Response:
        """``POST /unpin?session=ID``: end that session's pins; JSON ``{"session", "unpinned"}``."""
        if self.service is None:
            return text(503, "starting")
        sessions = urllib.parse.parse_qs(req.query, keep_blank_values=True).get("session", [])
        try:
            if len(sessions) != 1:
                raise ProtocolViolation("name one session: POST /unpin?session=ID")
            control.check_session(sessions[0], "session")
        except ProtocolViolation as e:
            return Response(400, "application/json", json.dumps({"error": str(e)}).encode())
        n = self.service.index.sessions.unpin(sessions[0])
        log.info("unpinned session %r over HTTP: %d pins ended", sessions[0][:40], n)
        return Response(200, "application/json", json.dumps({"session": sessions[0], "unpinned": n}).encode())

    async def serve(self) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        self.notifier.status("starting")
        executor = ThreadPoolExecutor(max_workers=cfg.copy_threads, thread_name_prefix="hkvd-copy")
        # Step events' copies (Mamba states, due within two engine steps) never wait behind bulk copies.
        step_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkvd-step-copy")
        self.heap.install()
        try:
            await self._start_http()
            await self._run(executor, step_executor)
        except BaseExceptionGroup as eg:  # the TaskGroup wraps start-up errors; callers expect them bare
            if len(eg.exceptions) == 1:
                raise self._as_startup_error(eg.exceptions[0]) from None
            raise
        except (PoolError, OSError, KVError) as e:
            raise self._as_startup_error(e) from None
        finally:
            self.stopping = True
            self.heap.uninstall()
            if self.http is not None:
                await self.http.close()
            executor.shutdown(wait=True, cancel_futures=True)
            step_executor.shutdown(wait=True, cancel_futures=True)
            self._close_copy_engine()  # no-op after a clean shutdown; no copy runs once the executor is down
            if self.peers is not None:  # before the pool goes: the transport may still write into it
                await self.peers.aclose()
            if self.publisher is not None:  # no-op after a clean shutdown
                await asyncio.to_thread(self.publisher.close, 1.0)
            if self.disk is not None:
                self.disk.close(timeout_s=1.0)  # no-op after a clean shutdown; start-up failures land here
            if self.cluster is not None:  # before the pool goes: Mooncake moves bytes in and out of it
                await asyncio.to_thread(self.cluster.close, 1.0)
            hashing = self._stop_hashing()
            if hashing:
                log.warning("integrity: %s is still hashing; leaving the pool mapped until exit", hashing)
            elif self.disk is not None and self.disk.busy():
                log.warning("disk tier: a read or write is still running; leaving the pool mapped until exit")
            elif self.cluster is not None and self.cluster.busy():
                log.warning("cluster tier: a put or get is still running; leaving the pool mapped until exit")
            elif self.pool is not None:
                self.pool.close()
        log.info("hkvd stopped")
        return 0

    def _stop_hashing(self) -> str:
        """Stop the checksum and scrub threads (they read the pool); the name of one still running, if any."""
        if self.scrubber is not None and not self.scrubber.stop(1.0):
            return "the scrubber"
        if self.checks is not None and not self.checks.stop(1.0):
            return "the checksum thread"
        return ""

    def _as_startup_error(self, e: BaseException) -> BaseException:
        """A failure before ready (the pool, the socket, a tier, the peers) is a ``StartupError``."""
        if self.ready.is_set() or isinstance(e, StartupError) or not isinstance(e, (PoolError, OSError, KVError)):
            return e
        return StartupError(str(e))

    async def _run(self, executor: ThreadPoolExecutor, step_executor: ThreadPoolExecutor) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            background: list[asyncio.Task[None]] = []
            if self.notifier.watchdog_interval_s:
                background.append(tg.create_task(self._watchdog()))
            self.pool = HugePagePool(cfg.l1_size_bytes, cfg.hugepages,  # type: ignore[arg-type]
                                     superblock_bytes=cfg.superblock_bytes or None, faulted_only=True,
                                     numa_node=cfg.numa_node if cfg.numa_node >= 0 else None)
            prefault = self.pool.start_prefault(cfg.prefault_threads or default_threads())
            first = first_slice_bytes(prefault.total_bytes, self.pool.allocator.superblock_bytes)
            log.info("pool: %d MiB of %s memory%s, %d MiB superblocks; pre-faulting on %d threads, serving after "
                     "the first %d MiB", self.pool.size >> 20, self.pool.kind,
                     f" on NUMA node {cfg.numa_node}" if cfg.numa_node >= 0 else "",
                     self.pool.allocator.superblock_bytes >> 20, prefault.threads, first >> 20)
            progress = PrefaultProgress(self.pool, prefault, self.notifier, self.metrics, summary=self.summary,
                                        log_every_s=STATUS_EVERY_S)
            await progress.first_slice(first)
            if cfg.l2_path:
                await self._open_disk(loop)
            if cfg.cluster:
                self._open_cluster(loop)
            # Built in dependency order, each given what it uses at construction (nothing is patched in
            # later): pool -> tiers -> copy engine -> index -> registry -> KV events -> peers -> service
            # -> routing, server.
            index, copy_engine = self._build_cache(loop, self.pool)
            registry = Registry(cfg.chunk_size, copy_engine, pool=self.pool, formats=index.formats)
            announcer = self._start_kv_events(loop, index)
            if peers_wanted(cfg):

                self.peers = PeerService(cfg, self.pool, index, registry, self.metrics)
                self.peers.checks = self.checks
                await self.peers.start()
                background.append(tg.create_task(self.peers.run()))
            self.service = KVService(self.config, index, registry, copy_engine, executor, self.metrics,
                                     disk=self.disk, cluster=self.cluster, peers=self.peers, heap=self.heap,
                                     announcer=announcer, publisher=self.publisher,
                                     step_executor=step_executor, scrubber=self.scrubber)
            self.routing = UsablePrefix(self.service, self.metrics, book=FormatBook(index.formats))
            self.hints = HintsEndpoint(self.routing, self.service.hints)
            self.server = Server(cfg, self.service)
            await self.server.start()  # listening: connections are accepted from here on
            self.ready.set()
            for hook in self.ready_hooks:
                hook()
            log.info("hkvd ready on %s (chunk size %d tokens, eviction %s, admission %s)", cfg.socket_path,
                     cfg.chunk_size, cfg.eviction_policy, cfg.admission)
            self.notifier.ready(f"ready on {cfg.socket_path}; {self.pool.size >> 20} MiB "
                                f"{self.pool.backing().kind} pool, {progress.share()}")
            self.heap.start(index.writes)
            background.append(tg.create_task(progress.finish()))
            background.append(tg.create_task(self._housekeeping(index)))
            if self.notifier.enabled:
                background.append(tg.create_task(self._report_status()))
            await self._stop.wait()
            self.stopping = True
            self.notifier.stopping("shutting down: draining in-flight copies")
            await self._shutdown()
            for task in background:
                task.cancel()

    def _build_cache(self, loop: asyncio.AbstractEventLoop, pool: HugePagePool) -> tuple[Cache, CopyEngine]:
        """The copy engine, the cache over ``pool`` (its quotas, pins' share and quarantine given at construction)
        and the entry checksums and scrubber that read it."""
        cfg = self.cfg
        self.copy_engine = copy_engine = make_copy_engine(cfg.copy_engine, pool, copy_timeout_s=cfg.copy_timeout_s,
                                                          cuda_copy_method=cfg.cuda_copy_method,
                                                          cuda_pin_chunk_bytes=cfg.cuda_pin_chunk_gib << 30)
        quotas = Tenants(pool.allocator.capacity, cfg.tenant_quota, dict(cfg.tenant_quotas))
        # The quarantine (docs/verification.md): sampled hits' comparisons, whose pairs every plan withholds.
        index = Cache(pool, make_policy(cfg.eviction_policy), tenants=quotas,
                      pin_fraction=cfg.pin_max_fraction, withheld=Quarantine(), admission=cfg.admission)
        # Entry checksums (docs/checksums.md): taken as entries turn READY, checked by the tiers'
        # write-behind, peer pulls and the scrubber.
        self.checks = Checksums(index, pool.buffer)
        self.checks.start(loop)
        for tier in (self.disk, self.cluster):
            if tier is not None:
                tier.checks = self.checks
        if self.disk is not None:  # the disk tier's cap passes over pinned chunks' files (docs/pins.md)
            self.disk.held = index.sessions.holds
        self.scrubber = Scrubber(index, self.checks, cfg.scrub_rate_mb)
        self.scrubber.start(loop)
        return index, copy_engine

    def _start_kv_events(self, loop: asyncio.AbstractEventLoop, index: Cache) -> Announcer:
        """KV events (docs/routing.md): kept for engines' polls always; published node-wide with
        --kv-events-endpoint (bound here: a bad or busy endpoint fails the start). Before the service,
        which is given the announcer and the publisher."""
        cfg = self.cfg
        if cfg.kv_events_endpoint:
            self.publisher = ZmqPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                          buffer_batches=cfg.kv_events_buffer)
            self.publisher.start()
        log_ = EventLog(cfg.kv_events_buffer, sink=self._publish if self.publisher is not None else None,
                        schedule=loop.call_soon)
        disk = self.disk
        self.announcer = Announcer(index, log_, self.metrics, topic=cfg.kv_events_topic,
                                   disk=disk.__contains__ if disk is not None else None)
        announcer = self.announcer
        if disk is not None:
            disk.listener = lambda keys, present: announcer.tier_changed(MEDIUM_DISK, keys, present)
        if self.cluster is not None:
            self.cluster.listener = lambda keys, present: announcer.tier_changed(MEDIUM_CLUSTER, keys, present)
        announcer.start()
        return announcer

    def _publish(self, batch: Batch) -> None:
        assert self.publisher is not None
        if not self.publisher.submit(batch):
            self.metrics.inc("kv_event_batches_dropped")

    async def _open_disk(self, loop: asyncio.AbstractEventLoop) -> None:
        """Scan ``--l2-path`` into the catalog (on a thread; progress in the log and STATUS=)."""
        assert self.pool is not None
        cfg = self.cfg
        self.disk = DiskTier(cfg.l2_path, cfg.l2_size_bytes, self.pool.buffer, budget_s=cfg.io_timeout_s,
                             queue_bytes=max(cfg.l1_size_bytes // 8, 1 << 20))

        def progress(files: int, nbytes: float) -> None:  # runs on the scan thread; each call is progress
            self.notifier.extend(EXTEND_TIMEOUT_S, f"scanning disk tier: {files} files, {nbytes / (1 << 30):.1f} GiB")

        self.notifier.extend(EXTEND_TIMEOUT_S, f"scanning disk tier {cfg.l2_path}")
        await loop.run_in_executor(self.disk.readers, self.disk.open, progress)
        self.disk.start(loop)

    def _open_cluster(self, loop: asyncio.AbstractEventLoop) -> None:
        """Join the Mooncake cluster in the background: serving never waits for the master."""

        assert self.pool is not None
        cfg = self.cfg
        keys = FleetKeys.load(cfg.cluster_key_file, cfg.cluster_accept_key_file)
        self.cluster = ClusterTier(ClusterSettings(
            cfg.cluster, cfg.cluster_segment_bytes, cfg.cluster_protocol, cfg.cluster_devices, cfg.cluster_local_host,
            cfg.cluster_replicas, cfg.cluster_lookup_timeout_ms / 1000,
            queue_bytes=max(cfg.l1_size_bytes // 8, 1 << 20)), keys, self.pool.buffer, self.pool.base_addr)
        log_fleet_keys(keys)
        self.cluster.start(loop)

    async def _flush_disk(self, deadline: float) -> None:
        disk = self.disk
        assert disk is not None
        queued = disk.pending()
        if queued:
            log.info("disk tier: flushing %d queued entries", queued)
            self.notifier.status(f"shutting down: flushing {queued} entries to the disk tier")
        while disk.pending() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        left = await asyncio.to_thread(disk.close, max(deadline - time.monotonic(), 0.5))
        st = disk.statistics()
        if left:
            log.warning("disk tier: %d entries not written within shutdown-timeout-s (%.0f s); a restart misses "
                        "them", left, self.cfg.shutdown_timeout_s)
        log.info("disk tier: %d entries (%.2f GiB) on disk; %d written, %d not flushed, %d dropped (queue full) "
                 "since start", st.entries, st.bytes / (1 << 30), st.writes, left, st.queue_drops)

    async def _watchdog(self) -> None:
        """WATCHDOG=1 at half WatchdogSec, from the event loop: a hung loop stops the pings."""
        interval = self.notifier.watchdog_interval_s
        log.info("systemd watchdog: pinging every %.1f s", interval)
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def _report_status(self) -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            self.notifier.status(self.summary())

    async def _housekeeping(self, index: Cache) -> None:
        """Every second: expire leases and session pins; freeze the heap when enough entries were written
        (daemon/heap.py)."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            expired = index.expire()  # leases, and session pins
            if expired:
                self.metrics.inc("leases_expired", expired)
            self.heap.maybe_freeze(index.writes)

    def reload(self) -> None:
        """SIGHUP: lift every quarantine (docs/verification.md), then apply the reloadable keys of the
        re-read config and log the rest as needing a restart (``daemon/reload.py``)."""
        if self.service is not None:
            self.service.quarantine.lift_all("SIGHUP")
        reload_config(self.config, self.reload_config, cluster=self.cluster, notifier=self.notifier,
                      summary=self.summary)

    async def _shutdown(self) -> None:
        assert self.server is not None and self.service is not None
        log.info("shutting down: stop accepting, reject new work, drain in-flight copies")
        await self.server.stop_accepting()
        self.service.shutting_down = True
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while any(c.inflight for c in self.server.connections.values()) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        left = sum(c.inflight for c in self.server.connections.values())
        if left:
            log.warning("%d copies still running after %.0f s; closing anyway", left,
                        self.cfg.shutdown_timeout_s)
        await self.service.hints.drain(deadline - time.monotonic())  # prefetches read the tiers closed below
        if self.disk is not None:
            await self._flush_disk(deadline)
        for conn in list(self.server.connections.values()):
            self.service.disconnect(conn)
        self.server.close_connections()
        if self.announcer is not None:
            self.announcer.close()  # AllBlocksCleared: what this run announced goes with its pool
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close, max(deadline - time.monotonic(), 0.5))
        self._close_copy_engine()

    def _close_copy_engine(self) -> None:
        """Close the copy engine this daemon built, once: at shutdown, or after a failed start (``serve``'s
        ``finally``). A failure is logged: the pool is closed next either way."""
        engine, self.copy_engine = self.copy_engine, None
        if engine is None:
            return
        try:
            engine.close()
        except Exception:
            log.exception("closing the %s copy engine failed", type(engine).__name__)
