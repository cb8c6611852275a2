"""The daemon: builds the pool, index, registry and server, runs them, shuts them down in order.

Shutdown sequence (SIGTERM or SIGINT)
    1. stop accepting (close the listener, unlink the socket);
    2. reject new work with SHUTTING_DOWN;
    3. drain in-flight copies within ``shutdown_timeout_s``;
    4. close connections (which releases leases and pins), the copy engine and the pool.
Exit code 0 after a clean shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hkvd.daemon.cma import HostCopyEngine
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.eviction import make_policy
from hkvd.daemon.index import Index
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.pool import HugePagePool
from hkvd.daemon.registry import Registry
from hkvd.daemon.server import Server
from hkvd.daemon.service import KVService

log = logging.getLogger("hkvd")

LEASE_SWEEP_S = 1.0


class Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self.pool: HugePagePool | None = None
        self.server: Server | None = None
        self.service: KVService | None = None
        self.ready_hooks: list[Callable[[], None]] = []

    def request_stop(self) -> None:
        self._stop.set()

    def _progress(self) -> Callable[[int, int], None]:
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0 or done == total:
                last[0] = now
                log.info("pre-faulting pool: %d / %d MiB (%.0f%%)", done >> 20, total >> 20, 100 * done / total)

        return report

    async def serve(self) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self.pool = HugePagePool(cfg.l1_size_bytes, cfg.hugepages, progress=self._progress(),  # type: ignore[arg-type]
                                 superblock_bytes=cfg.superblock_bytes)
        executor = ThreadPoolExecutor(max_workers=cfg.copy_threads, thread_name_prefix="hkvd-copy")
        try:
            log.info("pool: %d MiB of %s memory", self.pool.size >> 20, self.pool.kind)
            gbps = await loop.run_in_executor(executor, self.pool.prefault)
            log.info("pool pre-faulted at %.1f GB/s", gbps)
            self.metrics.inc("prefault_gbps", gbps)
            copy_engine = HostCopyEngine(self.pool)
            index = Index(self.pool, make_policy(cfg.eviction_policy))
            registry = Registry(cfg.chunk_size, copy_engine)
            self.service = KVService(cfg, index, registry, executor, self.metrics)
            self.server = Server(cfg, self.service)
            await self.server.start()
            self.ready.set()
            for hook in self.ready_hooks:
                hook()
            log.info("hkvd ready on %s (chunk size %d tokens, eviction %s)", cfg.socket_path, cfg.chunk_size,
                     cfg.eviction_policy)
            async with asyncio.TaskGroup() as tg:
                sweeper = tg.create_task(self._sweep_leases(index))
                await self._stop.wait()
                sweeper.cancel()
            await self._shutdown()
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
            if self.pool is not None:
                self.pool.close()
        log.info("hkvd stopped")
        return 0

    async def _sweep_leases(self, index: Index) -> None:
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            expired = index.expire_leases()
            if expired:
                self.metrics.inc("leases_expired", expired)

    async def _shutdown(self) -> None:
        assert self.server is not None and self.service is not None
        log.info("shutting down: stop accepting, reject new work, drain in-flight copies")
        await self.server.stop_accepting()
        self.service.shutting_down = True
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while any(c.inflight for c in self.server.connections.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = sum(c.inflight for c in self.server.connections.values())
        if left:
            log.warning("%d copies still running after %.0f s; closing anyway", left, self.cfg.shutdown_timeout_s)
        for conn in list(self.server.connections.values()):
            self.service.disconnect(conn)
        with contextlib.suppress(Exception):
            self.service.registry.copy_engine.close()
