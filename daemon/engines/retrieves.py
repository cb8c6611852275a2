"""Retrieves: READY pool entries copied into an engine's blocks, under a lease or not; lease watches.

Role
    Serves ``Retrieve`` (whole or not at all: a missing, unready or quarantined entry fails the job
    with ``NotFound`` before any copy) and ``WatchLease`` (the scheduler side hears when every rank's
    retrieve under a lease wrote its blocks).

Threading
    Event loop; the copies run through ``Copies``. A device copy answers once enqueued, and its pages
    stay pinned until the device has read them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hkvd.daemon.cache import Cache, Entry, EntryState
from hkvd.daemon.engines.connection import registered_engine
from hkvd.daemon.engines.stores import count_bytes
from hkvd.transport import layout
from hkvd.transport.copy_engine import CopyResult, Direction
from hkvd.transport.errors import ErrorCode, NotFound, OutOfRange
from hkvd.transport.wire import kv

if TYPE_CHECKING:
    import asyncio

    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.copies import Copies
    from hkvd.daemon.engines.engine_traffic import EngineTraffic
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.engines.reshards import Reshards
    from hkvd.daemon.integrity.quarantine import Quarantine
    from hkvd.daemon.metrics import Metrics

log = logging.getLogger("hkvd.service")


class Retrieves:
    """Reads from the pool. ``quarantine``: (fingerprint, group) pairs never served."""

    def __init__(self, index: Cache, copies: Copies, metrics: Metrics, traffic: EngineTraffic,
                 quarantine: Quarantine, reshards: Reshards | None = None) -> None:
        self.index = index
        self.reshards = reshards  # reads of another TP size's entries; None: this world's format only
        self.copies = copies
        self.metrics = metrics
        self.traffic = traffic
        self.quarantine = quarantine

    async def retrieve(self, conn: Conn, msg: kv.Retrieve) -> None:
        t0 = time.perf_counter()
        engine = registered_engine(conn, copy=True)
        items = msg.items
        groups = [engine.check_item(it) for it in items]
        try:
            entries = self._entries(engine, msg)
            segments = layout.segments_for_entries(
                [(g, it.block_ids, e.alloc.extents) for it, g, e in zip(items, groups, entries, strict=True)])
        except (OutOfRange, NotFound):
            # Not in this world's format: another TP size's entries, re-sharded (daemon/engines/reshards.py).
            found = self.reshards.read(engine, msg) if self.reshards is not None else None
            if found is None:
                raise
            entries, segments = found
        unpin = self.index.pin_for_read(entries)
        try:
            # A device copy answers once it is enqueued (the engine's stream waits on its done event):
            # the pages stay pinned until the device has read them (``settled``).
            result, settled = await self.copies.run(conn, engine.attachment, segments, Direction.FROM_POOL,
                                                    answer_enqueued=True)
        except BaseException as exc:
            if msg.lease_id:
                self.index.use_lease(msg.lease_id, written=False)
            self.copies.release_after(exc, unpin)
            raise
        if settled is None:
            unpin()
        else:
            settled.add_done_callback(functools.partial(self._settled, unpin))
        self.traffic.retrieved(engine.spec.model, engine.spec.rank,
                               count_bytes(self.metrics, "retrieved_bytes", entries))
        conn.send(kv.RetrieveResult(msg.req_id, result.nbytes, len(entries), result.done_event,
                                    time.perf_counter() - t0))
        if msg.lease_id:
            # Every byte is in the engine's blocks, unless the engine's stream must still wait for
            # the copy (a GPU done event): only the worker can report that load.
            self.index.use_lease(msg.lease_id, written=not result.done_event)

    def _entries(self, engine: EngineState, msg: kv.Retrieve) -> list[Entry]:
        """The READY entries ``msg.items`` name, each covered by ``msg.lease_id`` when it names one;
        ``OutOfRange`` or ``NotFound`` for the first that is not."""
        items = msg.items
        get, fp, ready = self.index.get, engine.fingerprint, EntryState.READY
        if msg.lease_id:
            lease = self.index.check_lease(msg.lease_id)
            if (k := lease.uncovered((fp, it.group_id, it.key) for it in items)) is not None:
                raise OutOfRange(f"lease {msg.lease_id} does not cover group {k[1]} chunk key {k[2].hex()[:12]} of "
                                 f"engine {engine.engine_id} (rank {engine.spec.rank}); it was granted for other "
                                 "entries: look the prefix up again")
        entries: list[Entry] = []
        for it in items:
            e = get((fp, it.group_id, it.key))
            if e is None or e.state is not ready:
                self.metrics.inc("retrieve_misses")
                raise NotFound(f"group {it.group_id} chunk {it.chunk_index} is not in the cache (evicted, "
                               "or never stored); recompute it")
            if (fp, it.group_id) in self.quarantine:
                self.metrics.inc("retrieve_misses")
                raise NotFound(f"group {it.group_id} of this engine's layout is quarantined (its entries diverged "
                               "from their recomputation; docs/verification.md); recompute it")
            entries.append(e)
        return entries

    def _settled(self, unpin: Callable[[], None], settled: asyncio.Future[CopyResult]) -> None:
        """A retrieve answered once enqueued has settled on the device: unpin its pages (once the device
        is done with them, after a failure). The engine was told of the copy already; its stream waits on
        the done event, which a failed copy that still runs completes late, and a faulted one never."""
        exc = None if settled.cancelled() else settled.exception()
        if exc is None:
            unpin()
            return
        log.warning("a retrieve answered once enqueued failed on the device: %s", exc)
        self.copies.release_after(exc, unpin)

    def watch_lease(self, conn: Conn, msg: kv.WatchLease) -> None:
        """Answer once every retrieve under the lease wrote its bytes (LeaseWritten) or the lease ended
        otherwise (Error): the scheduler side reports a load a step before a worker could."""
        registered_engine(conn, copy=False)

        def notify(written: bool) -> None:
            if written:
                conn.send(kv.LeaseWritten(msg.req_id))
            else:
                conn.send(kv.Error(msg.req_id, int(ErrorCode.LEASE_EXPIRED),
                                   f"lease {msg.lease_id} ended before every rank's retrieve wrote its blocks"))

        self.index.watch_lease(msg.lease_id, conn.conn_id, notify)
