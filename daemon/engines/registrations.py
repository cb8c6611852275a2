"""Registrations: an engine rank registered on a connection, and what the connection held released at its end.

Role
    Serves ``Register`` (the engine's spec into the registry, with the pool its process mapped for in-step
    loads, ``Register.mapped_pool``; its format into the cache, its step ordering, its KV events) and ends a
    connection's hold on the daemon (``disconnect``: leases, unconfirmed boundary states, the registration,
    the pinned process). ``engine_gone`` has the copy
    engine abandon the copies that wait on an engine process that exited, so ``disconnect`` follows.

Threading
    Event loop only; nothing here awaits.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hkvd.daemon.engines.snapshots import SnapshotOrdering
from hkvd.transport.errors import RegistrationError
from hkvd.transport.wire import control

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.registry import Registry
    from hkvd.daemon.engines.step_events import StepEvents
    from hkvd.daemon.metrics import Metrics
    from hkvd.daemon.routing.announcer import Announcer
    from hkvd.daemon.routing.zmq_publisher import ZmqPublisher
    from hkvd.transport.copy_engine import CopyEngine

log = logging.getLogger("hkvd.service")


class Registrations:
    """Engines in and out. ``announcer``, ``publisher``: KV events (``daemon/routing``), or None."""

    def __init__(self, index: Cache, registry: Registry, copy_engine: CopyEngine, step_events: StepEvents,
                 metrics: Metrics, announcer: Announcer | None, publisher: ZmqPublisher | None,
                 in_step: bool = False) -> None:
        self.index = index
        self.registry = registry
        self.copy_engine = copy_engine
        self.step_events = step_events
        self.metrics = metrics
        self.announcer = announcer
        self.publisher = publisher
        self.in_step = in_step  # whether lookups may be answered with places (--in-step-loads; RegisterAck.in_step)

    def register(self, conn: Conn, msg: control.Register) -> None:
        """Register the engine rank ``msg`` names on ``conn`` (once per connection) and acknowledge it."""
        if conn.register_refusal is not None:
            raise conn.register_refusal
        if conn.engine is not None:
            raise RegistrationError("this connection already registered an engine; open one connection "
                                    "per engine rank")
        spec = msg.engine_spec()
        if spec.regions and conn.role == "scheduler":
            raise RegistrationError("a scheduler connection registers without regions (lookup only)")
        state = self.registry.register(spec, conn.process or conn.pid, conn.conn_id, msg.mapped_pool)
        conn.engine = state
        conn.snapshots = SnapshotOrdering(state.engine_id)
        if self.announcer is not None:
            self.announcer.register(state)
        self.index.add_format(state.rank_fingerprints, state.kinds)  # every rank's entries have this rank's format
        self.metrics.inc("engines_registered")
        log.info("registered engine %d (pid %d, model %s, rank %d/%d, %s, %d groups, fingerprint %s)",
                 state.engine_id, conn.pid, spec.model, spec.rank, spec.world_size,
                 "worker" if state.can_copy else "lookup-only", len(state.groups), state.fingerprint.hex()[:12])
        conn.send(control.RegisterAck(msg.req_id, state.engine_id, state.fingerprint, state.chunk_size,
                                      self._kv_events_mode(), lease_watch=True, verify=True, pins=True,
                                      pin_partials=True, step_tenants=True, lookup_tails=True,
                                      partial_notes=True, turn_ends=True, in_step=self.in_step, hints=True,
                                      request_tiers=True))

    def _kv_events_mode(self) -> int:
        """What this daemon does with KV-event notes (``RegisterAck.kv_events``)."""
        if self.announcer is None:
            return control.KV_EVENTS_UNSUPPORTED
        return control.KV_EVENTS_PUBLISHED if self.publisher is not None else control.KV_EVENTS_ACCEPTED

    def engine_gone(self, conn: Conn) -> None:
        """The engine process exited or its connection ended: end its copies that wait on it (its
        step events) now, so ``disconnect`` follows once they return. Idempotent; never blocks."""
        if conn.gone:
            return
        conn.gone = True
        engine = conn.engine
        if engine is not None and engine.attachment is not None:
            self.copy_engine.abandon(engine.attachment)

    def disconnect(self, conn: Conn) -> None:
        """Release at once what the connection held: leases, unconfirmed states, its registration."""
        released = self.index.release_owner(conn.conn_id)
        if conn.snapshots is not None:
            self.step_events.drop_jobs(conn, conn.snapshots.on_disconnect())
            conn.snapshots = None  # a later Abort or re-registration must not reach the closed ordering
        for job in {*conn.pending, *conn.verifying}:
            self.step_events.drop_jobs(conn, [job])
        if conn.engine is not None:
            self.registry.unregister(conn.engine.engine_id)
            log.info("engine %d (pid %d) disconnected; released %d leases", conn.engine.engine_id, conn.pid,
                     released)
            conn.engine = None
        if conn.unwatch is not None:  # before its pidfd is closed
            conn.unwatch()
            conn.unwatch = None
        if conn.process is not None:
            conn.process.close()
            conn.process = None
