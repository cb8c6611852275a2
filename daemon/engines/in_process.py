"""The daemon's service in this process, over a small host pool: for tests that drive it message by message.

Not used in serving.

``in_process_service`` builds what ``hkvd serve`` builds for one pool, without its socket, threads of its
own or start-up checks: a ``HugePagePool`` (backed as ``cfg.hugepages`` says; tests pass ``off``), a copy
engine over it (``HostCopyEngine`` unless ``make_engine`` says otherwise), a ``Cache`` with the quarantine
that verification needs, a ``Registry`` and a ``KVService``. It closes all of it on the way out. A test
that wants the control socket wraps ``parts.service`` in a ``Server`` (``hkvd.daemon.server``) with
``parts.cfg``; one that sends messages itself calls ``service.handle`` with a connection from ``own_conn``
(this process as the engine, its replies appended to a list).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hkvd.daemon.cache import Cache, HugePagePool, make_policy
from hkvd.daemon.config import ConfigCell, DaemonConfig
from hkvd.daemon.engines.client_process import ClientProcess
from hkvd.daemon.engines.connection import Conn
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.registry import Registry
from hkvd.daemon.engines.service import KVService
from hkvd.daemon.integrity.quarantine import Quarantine
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.tiers.disk import DiskTier
from hkvd.transport.wire import Message


@dataclasses.dataclass
class ServiceParts:
    """What ``in_process_service`` built; ``service`` is the one a test talks to."""

    cfg: DaemonConfig
    pool: HugePagePool
    copy_engine: Any
    cache: Cache
    executor: ThreadPoolExecutor
    service: KVService


@contextlib.contextmanager
def in_process_service(cfg: DaemonConfig, make_engine: Callable[[HugePagePool], Any] = HostCopyEngine,
                       threads: int = 1, step_threads: int = 0,
                       tiers: Callable[[HugePagePool], dict[str, Any]] | None = None,
                       **service_kw: Any) -> Iterator[ServiceParts]:
    """A ``KVService`` over a pool of ``cfg.l1_size_bytes``, copies on ``threads`` threads (and step events'
    copies on ``step_threads`` of their own when more than 0); ``tiers`` builds lower tiers over the pool
    (``{"disk": ...}``; the caller closes them), ``service_kw`` goes to ``KVService`` as it is."""
    pool = HugePagePool(cfg.l1_size_bytes, cfg.hugepages)  # type: ignore[arg-type]  # DaemonConfig checks it
    copy_engine = make_engine(pool)
    executor = ThreadPoolExecutor(threads)
    step_executor = ThreadPoolExecutor(step_threads) if step_threads > 0 else None
    try:
        if tiers is not None:
            service_kw = {**service_kw, **tiers(pool)}
        cache = Cache(pool, make_policy("lru"), withheld=Quarantine())
        service = KVService(ConfigCell(cfg), cache, Registry(cfg.chunk_size, copy_engine, pool=pool), copy_engine,
                            executor, Metrics(), step_executor=step_executor, **service_kw)
        yield ServiceParts(cfg, pool, copy_engine, cache, executor, service)
    finally:
        executor.shutdown()
        if step_executor is not None:
            step_executor.shutdown()
        close = getattr(copy_engine, "close", None)
        if close is not None:
            close()
        pool.close()


def own_conn(sent: list[Message], conn_id: int = 1) -> Conn:
    """A connection from this process (its pid and uid) whose replies are appended to ``sent``."""
    return Conn(conn_id=conn_id, pid=os.getpid(), uid=os.getuid(), send=sent.append,
                process=ClientProcess.open(os.getpid()))


def disk_tier(root: str, keep: Callable[[DiskTier], None]) -> Callable[[HugePagePool], dict[str, Any]]:
    """A ``tiers`` builder for ``in_process_service``: a 1 GiB disk tier in ``root`` over the pool, opened and
    started on the running loop, handed to ``keep`` (the caller closes it)."""
    def build(pool: HugePagePool) -> dict[str, Any]:
        disk = DiskTier(root, 1 << 30, pool.buffer, queue_bytes=1 << 30)
        disk.open()
        disk.start(asyncio.get_running_loop())
        keep(disk)
        return {"disk": disk}
    return build
