"""The KV service: what each message means. Sans-socket: the server adapter feeds it messages.

Role
    Dispatches validated messages from one connection to the part that serves their family, and sends
    replies through ``Conn.send``. It owns no sockets; ``daemon/server.py`` moves frames. The parts:
    ``lookup_replies`` (Lookup; ``places`` under it: where a leased hit lies in the pool, for engines that
    copy it themselves), ``stores`` (Store), ``retrieves`` (Retrieve, WatchLease),
    ``step_events`` (StepEvent), ``verification`` (Verify, sampled hits' comparisons),
    ``registrations`` (Register, a connection's end), and ``copies`` under them (every copy between an
    engine and the pool). Pins, aborts, KV-event polls and status stay here.

Threading
    Event loop only. ``handle`` answers at once, or returns the coroutine of the part that waits
    (copies, a lookup's reads from the lower tiers) for the adapter to run as a task. When the engine
    process is gone (``engine_gone``: its pidfd or its connection said so), the copy engine abandons
    the copies that wait on it (``CopyEngine.abandon``), so its jobs end and ``disconnect`` follows.

Errors
    Anything the client got wrong raises a ``KVError`` that the adapter sends back as
    ``Error(req_id, code, message)``; the connection keeps serving. A job either completes whole (its
    reply message: ``StoreResult``, ``RetrieveResult``, ...) or fails whole (``Error``) -- a retrieve never
    reports success for part of its items.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Coroutine
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from hkvd.daemon.cache import Cache
from hkvd.daemon.config import ConfigCell
from hkvd.daemon.engines.connection import Conn, registered_engine, request_log
from hkvd.daemon.engines.copies import Copies
from hkvd.daemon.engines.engine_traffic import EngineTraffic
from hkvd.daemon.engines.latency import Latencies
from hkvd.daemon.engines.lookup_replies import LookupReplies
from hkvd.daemon.engines.places import Places
from hkvd.daemon.engines.registrations import Registrations
from hkvd.daemon.engines.registry import Registry
from hkvd.daemon.engines.reshards import Reshards
from hkvd.daemon.engines.retrieves import Retrieves
from hkvd.daemon.engines.service_stats import KeepingStats, KVEventsStats, RateStats, ServiceStats
from hkvd.daemon.engines.step_events import StepEvents
from hkvd.daemon.engines.stores import Stores
from hkvd.daemon.engines.verification import Verification
from hkvd.daemon.fd_budget import DescriptorBudget
from hkvd.daemon.heap import HeapPolicy
from hkvd.daemon.hints.effects import COUNTER, Hints, hint_target
from hkvd.daemon.integrity.quarantine import Quarantine
from hkvd.daemon.integrity.scrub import Scrubber
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.announcer import Announcer
from hkvd.daemon.tiers.contract import Tier
from hkvd.daemon.tiers.disk import DiskTier
from hkvd.daemon.tiers.promotion import Promoter
from hkvd.transport.copy_engine import CopyEngine, Direction
from hkvd.transport.errors import NotFound, PermissionDenied, ProtocolViolation, ShuttingDown
from hkvd.transport.hint_envelope import Action
from hkvd.transport.stat_fields import status_dict
from hkvd.transport.wire import Message, control, events, kv, peer

if TYPE_CHECKING:  # types only: the service never builds these (daemon/app.py does), and they import NIXL's host, zmq
    from hkvd.daemon.peers.links import PeerService
    from hkvd.daemon.routing.zmq_publisher import ZmqPublisher
    from hkvd.daemon.tiers.cluster import ClusterStats


log = logging.getLogger("hkvd.service")


# Timed from request to reply (hkvd.daemon.engines.latency).
_TIMED: dict[type, str] = {kv.Lookup: "lookup", kv.Store: "store", kv.Retrieve: "retrieve"}


class KVService:
    """Built whole by ``daemon/app.py``, its collaborators given at construction and never swapped:

    - ``config``: the running config, read at each use; SIGHUP swaps it (``ConfigCell``);
    - ``index``: the cache (``hkvd.daemon.cache``): every hit, lease, store and read goes through it;
    - ``copy_engine``: moves bytes between engines' memory and the pool; the one ``registry`` attaches
      engines with (``daemon/app.py`` builds it and hands both the same one);
    - ``disk``, ``cluster``: the tiers below the pool, or None;
    - ``peers``: peer links (pulls), or None: a ``Pull`` is refused;
    - ``heap``: the GC policy, for ``status`` only;
    - ``announcer``, ``publisher``: KV events (``daemon/routing``). No announcer: registrations say KV
      events are unsupported, and notes are ignored; no publisher: they are kept for polls only;
    - ``step_executor``: the thread for step events' copies too large for the loop (Mamba states, due
      before step s+2 is reported), so they never queue behind the stores and loads on ``executor``,
      whose copies have seconds; None: they share ``executor``.
    """

    def __init__(self, config: ConfigCell, index: Cache, registry: Registry, copy_engine: CopyEngine,
                 executor: Executor, metrics: Metrics, *, disk: DiskTier | None = None,
                 cluster: Tier[ClusterStats] | None = None, peers: PeerService | None = None,
                 heap: HeapPolicy | None = None, announcer: Announcer | None = None,
                 publisher: ZmqPublisher | None = None, step_executor: Executor | None = None,
                 scrubber: Scrubber | None = None) -> None:
        self.config = config
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self.disk = disk  # the cold-restart tier (--l2-path), or None
        self.cluster = cluster  # the cluster tier (--cluster), or None
        tiers: list[Tier[object]] = [t for t in (disk, cluster) if t is not None]  # local before remote
        self.shutting_down = False
        self.peers = peers
        self.heap = heap
        self.announcer = announcer
        self.publisher = publisher
        self.scrubber = scrubber  # entry checksums and the scrubber (daemon/integrity/), for their stats
        self.descriptors = DescriptorBudget.current()  # the control socket's share (daemon/server.py)
        self.traffic = EngineTraffic()  # per (model, rank): lookups, stores, retrieves
        self.latencies = Latencies()  # lookup, store, retrieve: request to reply
        # Sampled hits' comparisons: the cache withholds its pairs from every plan (given at its construction).
        if not isinstance(index.withheld, Quarantine):
            raise TypeError("KVService needs a cache built with withheld=Quarantine(): the quarantine its "
                            "verification records and every lookup plan withholds")
        self.quarantine = index.withheld
        # copy_timeout_s is not reloadable
        self.copies = Copies(copy_engine, executor, step_executor or executor, metrics, config.current.copy_timeout_s)
        # This daemon run's identity (HelloAck.server_id): also the pool's, which an engine that mapped it names
        # in Register.mapped_pool.
        self.server_id = uuid.uuid4().hex[:12]
        # In-step loads (--in-step-loads, not reloadable): the one place that reads the option. Lookups answer
        # with places, Register answers in_step, and the server offers the pool's fd, only where this is set.
        self.places = Places(index, registry, self.server_id) if config.current.in_step_loads else None
        # Entries of other TP sizes of a model, re-sharded on read (daemon/engines/reshards.py).
        self.reshards = Reshards(index, metrics, self.quarantine, enabled=config.current.tp_reshard)
        self.lookups = LookupReplies(config, index, Promoter(index, metrics, tiers), metrics, self.traffic,
                                     self.places, self.reshards)
        # KV hints (docs/hints.md): an engine's kv.Hints here, a router's POST /v1/kv/hints (daemon/app.py).
        self.hints = Hints(index, metrics, self.lookups.promoter, registry.engines)
        self.stores = Stores(config, index, self.copies, metrics, self.traffic, tiers, announcer)
        self.retrieves = Retrieves(index, self.copies, metrics, self.traffic, self.quarantine, self.reshards)
        self.verification = Verification(config, index, self.copies, executor, self.quarantine)
        self.step_events = StepEvents(index, self.stores, self.verification, metrics)
        self.registrations = Registrations(index, registry, copy_engine, self.step_events, metrics, announcer,
                                           publisher, in_step=self.places is not None)

    # ---- dispatch ------------------------------------------------------------------------------
    def handle(self, conn: Conn, msg: Message) -> Coroutine[Any, Any, None] | None:
        """Serve ``msg`` now; return the coroutine of the part that must wait, if any.

        Store, retrieve and step events wait on copies, and a lookup the pool cannot answer may
        wait on disk reads: the caller runs the returned coroutine as a task. Everything else is
        answered before this returns. Jobs enter ``conn.jobs`` here, before any later frame (an
        Abort of one) is served. Lookups, stores and retrieves are timed until their reply or error
        (``hkvd.daemon.engines.latency``).
        """
        op = _TIMED.get(type(msg))
        if op is None:
            return self._handle(conn, msg)
        t0 = time.perf_counter()
        try:
            rest = self._handle(conn, msg)
        except BaseException:
            self.latencies.observe(op, time.perf_counter() - t0)
            raise
        if rest is None:
            self.latencies.observe(op, time.perf_counter() - t0)
            return None
        return self._timed(op, t0, rest)

    async def _timed(self, op: str, t0: float, rest: Awaitable[None]) -> None:
        try:
            await rest
        finally:
            self.latencies.observe(op, time.perf_counter() - t0)

    def _handle(self, conn: Conn, msg: Message) -> Coroutine[Any, Any, None] | None:
        if self.shutting_down and not isinstance(msg, (kv.Release, control.Bye, kv.Abort, control.Status, kv.Pin,
                                                       kv.Hints)):
            raise ShuttingDown("hkvd is shutting down; the engine will recompute and reconnect later")
        match msg:
            case kv.Lookup():
                return self.lookups.lookup(conn, msg)
            case kv.Store():
                conn.jobs.add(msg.req_id)
                return self.stores.store(conn, msg)
            case kv.Retrieve():
                conn.jobs.add(msg.req_id)
                return self.retrieves.retrieve(conn, msg)
            case events.StepEvent():
                conn.jobs.add(msg.req_id)
                return self.step_events.step_event(conn, msg)
            case kv.Verify():
                conn.jobs.add(msg.req_id)
                return self.verification.verify(conn, msg)
            case events.KVEventsPoll():
                self._poll_events(conn, msg)
            case control.Ping():
                conn.send(control.Pong(msg.req_id))
            case kv.Release():
                self.index.release(msg.lease_id)
            case kv.WatchLease():
                self.retrieves.watch_lease(conn, msg)
            case kv.Pin():
                self._pin(conn, msg)
            case kv.Hints():
                self._hints(conn, msg)
            case control.Unpin():
                n = self.index.sessions.unpin(msg.session)
                log.info("unpinned session %r: %d pins ended", msg.session[:40], n)
                conn.send(control.Unpinned(msg.req_id, n))
            case kv.Uncacheable():
                registered_engine(conn, copy=False)
                self.metrics.inc("uncacheable_requests", reason=msg.reason)
            case peer.Pull():
                self._pull(conn, msg)
            case kv.Abort():
                self._abort(conn, msg.req_id)
                conn.send(kv.AbortAck(msg.req_id))
            case control.Register():
                self.registrations.register(conn, msg)
            case control.Unregister():
                self.disconnect(conn)
                conn.send(control.Unregistered(msg.req_id))
            case control.Status():
                conn.send(control.StatusReply(msg.req_id, self.status()))
            case control.LiftQuarantine():
                lifted = (self.quarantine.lift_all("hkvd quarantine --clear all") if msg.fingerprint == "all"
                          else self.quarantine.lift(msg.fingerprint))
                conn.send(control.QuarantineLifted(msg.req_id, ",".join(f"{fp.hex()}/{g}" for fp, g in lifted)))
            case control.Hello() | control.Bye():
                pass  # handled by the adapter
            case _:
                raise ProtocolViolation(f"{type(msg).__name__} is not a request a client may send")
        return None

    def _pull(self, conn: Conn, msg: peer.Pull) -> None:
        """Peer pulls run as tasks of the peer service; the reply reaches ``conn`` when they end."""
        if self.peers is None:
            raise PermissionDenied("this hkvd does not pull from peers; start it with --peer-token-file (the "
                                   "token of the prefill node's daemon)")
        self.peers.submit_pull(conn.engine, msg, conn)

    def _pin(self, conn: Conn, msg: kv.Pin) -> None:
        """Hold the chunks of a finished request for its session (``daemon/cache/pins.py``). No reply, and
        nothing fails: a pin the daemon cannot place is logged."""
        if self.shutting_down:
            return
        if conn.engine is None:
            log.warning("a Pin of session %r came before its connection registered an engine; ignored (the "
                        "client sends Pin only after Register)", msg.session[:40], extra=request_log(conn, 0))
            return
        self.index.sessions.pin(conn.engine.rank_fingerprints, msg.session, msg.tenant, msg.keys, msg.ttl_s,
                                msg.partial_keys)

    def _hints(self, conn: Conn, msg: kv.Hints) -> None:
        """A request's KV hints about its chunks (docs/hints.md): applied and counted. No reply, and nothing
        fails: each hint's outcome is counted (and a rejected one logged)."""
        if self.shutting_down:
            return
        if conn.engine is None:
            log.warning("KV hints came before their connection registered an engine; ignored (the client sends "
                        "Hints only after Register)", extra=request_log(conn, 0))
            return
        for label, n in msg.counted.items():
            action, _, outcome = label.partition("/")
            self.hints.counted(action, outcome, n)
        if not msg.actions:
            return
        target = hint_target(conn.engine, msg.keys, msg.tenant)
        for action, ttl, session in zip(msg.actions, msg.ttls_s, msg.sessions, strict=True):
            out = self.hints.apply(Action(action, "", {}, ttl or None, session or None), target)
            if out.outcome == "rejected":
                log.info("a request's %s hint was rejected: %s", action, out.reason, extra=request_log(conn, 0))

    # ---- KV events, aborts ----------------------------------------------------------------------
    def _poll_events(self, conn: Conn, msg: events.KVEventsPoll) -> None:
        engine = registered_engine(conn, copy=False)
        if self.announcer is None:
            raise NotFound("this hkvd keeps no KV events (its RegisterAck said so); do not poll it")
        conn.send(self.announcer.poll(engine, msg.req_id, msg.since))

    def _abort(self, conn: Conn, req_id: int) -> None:
        log.info("abort requested", extra=request_log(conn, req_id))
        if req_id in conn.jobs:  # an abort of a finished (or unknown) job changes nothing and is not kept
            conn.aborted.add(req_id)
        if conn.snapshots is not None:
            conn.snapshots.on_abort([req_id])
        self.step_events.drop_jobs(conn, [req_id] if req_id in conn.pending or req_id in conn.verifying else [])

    # ---- lifecycle -----------------------------------------------------------------------------
    def engine_gone(self, conn: Conn) -> None:
        """The engine process exited or its connection ended (``Registrations.engine_gone``)."""
        self.registrations.engine_gone(conn)

    def disconnect(self, conn: Conn) -> None:
        """Release at once what the connection held (``Registrations.disconnect``)."""
        self.registrations.disconnect(conn)

    def statistics(self) -> ServiceStats:
        """Every component's ``statistics()``; ``status()`` and /metrics are derived from it."""
        kv_events = None
        if self.announcer is not None:
            kv_events = KVEventsStats(self.announcer.statistics(),
                                      self.publisher.statistics() if self.publisher is not None else None)
        entries = self.index.statistics()
        return ServiceStats(
            registry=self.registry.statistics(),
            pool=self.index.pool.statistics(),
            index=entries,
            counters={name: self.metrics.total(name) for name in sorted(self.metrics.counters)},
            by_kind={name: self._by_kind(name) for name in ("lookup_hit_entries", "lookup_miss_entries", "l2_hits",
                                                             "cluster_hits")},
            uncacheable_requests=self._by_label("uncacheable_requests", "reason"),
            rates=RateStats({d.value: self.metrics.rate("copy", direction=d.value) for d in Direction}),
            l2=self.disk.statistics() if self.disk is not None else None,
            cluster=self.cluster.statistics() if self.cluster is not None else None,
            peer=self.peers.statistics() if self.peers is not None else None,
            heap=self.heap.statistics() if self.heap is not None else None,
            kv_events=kv_events,
            descriptors=self.descriptors.statistics(),
            shutting_down=self.shutting_down,
            engine_traffic=self.traffic.statistics(),
            latency=self.latencies.statistics(),
            integrity=self.scrubber.statistics() if self.scrubber is not None else None,
            verify=self.quarantine.statistics(),
            pins=self.index.sessions.statistics(),
            tenants=self.index.tenants.statistics(),
            hints=self._hint_counts(),
            keeping=self._keeping(entries.bytes_stored),
        )

    def _keeping(self, pool_bytes: int) -> KeepingStats:
        """Stores by outcome and hits per pool byte (``KeepingStats``)."""
        hit = self.metrics.total("retrieved_bytes")
        return KeepingStats(stores=self._by_label("store_entries", "outcome"),
                            store_bytes=self._by_label("store_bytes", "outcome"),
                            tiers_left_out=self._by_label("tier_writes_left_out", "tier"),
                            hit_bytes=hit, pool_bytes=pool_bytes,
                            hits_per_pool_byte=hit / pool_bytes if pool_bytes else 0.0)

    def _hint_counts(self) -> dict[str, dict[str, float]]:
        """``hkvd_hints_total`` as action -> outcome -> total (``hkvd status``; docs/hints.md)."""
        out: dict[str, dict[str, float]] = {}
        for labels, v in self.metrics.counters.get(COUNTER, {}).items():
            named = dict(labels)
            out.setdefault(named.get("action", ""), {})[named.get("outcome", "")] = v
        return out

    def _by_kind(self, name: str) -> dict[str, float]:
        return self._by_label(name, "kind")

    def _by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(labels).get(label, ""): v for labels, v in self.metrics.counters.get(name, {}).items()}

    def status(self) -> dict[str, Any]:
        """The status JSON (``hkvd status``, the control socket's ``StatusReply``): ``statistics()`` as dicts."""
        return status_dict(self.statistics())
