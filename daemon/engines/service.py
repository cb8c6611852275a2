"""The KV service: what each message means. Sans-socket: the server adapter feeds it messages.

Role
    Turns validated messages from one connection into index changes and copy jobs, and sends
    replies through ``Conn.send``. It owns no sockets; ``daemon/server.py`` moves frames.

Threading
    Event loop only. Copies run on the daemon's copy thread pool through ``_run_copy`` with a
    timeout; a copy that outlives its timeout keeps its pins until the thread returns (the pool
    pages are in use), and its job fails with ``KVTimeout``. When the engine process is gone
    (``engine_gone``: its pidfd or its connection said so), the copy engine abandons the copies
    that wait on it (``CopyEngine.abandon``), so its jobs end and ``disconnect`` follows at once.
    With a disk or cluster tier, a lookup whose hit needs entries only they have awaits their
    reads (``daemon/tiers/promotion.py``, each tier's budget) before it replies; ``handle``
    returns that part as a coroutine, so the connection's later requests are not held behind it.

Errors
    Anything the client got wrong raises a ``KVError`` that the adapter sends back as
    ``Error(req_id, code, message)``; the connection keeps serving. A job either completes whole
    (``Done``) or fails whole (``Error``) -- a retrieve never reports success for part of its items.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Required, TypedDict

from hkvd.daemon.cache import Allocation, Cache, Entry, EntryState, Extent, HitPlan, mamba_checkpoint_keep
from hkvd.daemon.config import ConfigCell, DaemonConfig
from hkvd.daemon.engines.client_process import ClientProcess
from hkvd.daemon.engines.engine_traffic import EngineTraffic
from hkvd.daemon.engines.latency import Latencies
from hkvd.daemon.engines.registry import EngineState, Registry
from hkvd.daemon.engines.service_stats import KVEventsStats, RateStats, ServiceStats
from hkvd.daemon.engines.snapshots import SnapshotOrdering, StepOutcome
from hkvd.daemon.fd_budget import DescriptorBudget
from hkvd.daemon.heap import HeapPolicy
from hkvd.daemon.integrity.compare import entry_error, tolerance
from hkvd.daemon.integrity.quarantine import Quarantine
from hkvd.daemon.integrity.scrub import Scrubber
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.announcer import Announcer
from hkvd.daemon.tiers.contract import Tier
from hkvd.daemon.tiers.disk import DiskTier
from hkvd.daemon.tiers.promotion import Promoter
from hkvd.transport import layout
from hkvd.transport.copy_engine import Attachment, CopyEngine, CopyResult, Direction, EnqueuedCopy, Segment
from hkvd.transport.errors import (
    Aborted,
    CopyFailedError,
    ErrorCode,
    KVError,
    KVTimeout,
    NotFound,
    NotRegistered,
    OutOfRange,
    PagesInUse,
    PermissionDenied,
    PoolFull,
    ProtocolViolation,
    RegistrationError,
    ShuttingDown,
)
from hkvd.transport.keys import ROOT_KEY
from hkvd.transport.layout import GroupSpec
from hkvd.transport.stat_fields import status_dict
from hkvd.transport.turn_ends import TurnEnds
from hkvd.transport.wire import Message, control, events, kv, peer
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.kv import Item
from hkvd.transport.wire.replies import (
    Acknowledged,
    QuarantineLifted,
    RetrieveResult,
    StepResult,
    StoreResult,
    Unpinned,
    VerifyResult,
)

if TYPE_CHECKING:  # types only: the service never builds these (daemon/app.py does), and they import NIXL's host, zmq
    from hkvd.daemon.peers.links import PeerService
    from hkvd.daemon.routing.zmq_publisher import ZmqPublisher
    from hkvd.daemon.tiers.cluster import ClusterStats

log = logging.getLogger("hkvd.service")

TURN_END_CHUNKS = 65536  # chunk keys whose turn ends the daemon remembers, least recently used out first
TURN_ENDS_PER_CHUNK = 32  # turn ends remembered after one chunk key, oldest out first

# Timed from request to reply (hkvd.daemon.engines.latency).
_TIMED: dict[type, str] = {kv.Lookup: "lookup", kv.Store: "store", kv.Retrieve: "retrieve"}


@dataclass(slots=True)
class Conn:
    """One client connection as the service sees it."""

    conn_id: int
    pid: int
    uid: int
    send: Callable[[Message], None]
    process: ClientProcess | None = None  # pinned at accept (None only in tests that drive the service directly)
    role: str = ""
    engine: EngineState | None = None
    snapshots: SnapshotOrdering | None = None
    # step-event job id -> entries it wrote that await the engine's confirmation
    pending: dict[int, list[Entry]] = field(default_factory=dict)
    # step-event job id -> boundary states it copied for a sampled hit (scratch), compared once confirmed
    verifying: dict[int, list[Scratch]] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    jobs: set[int] = field(default_factory=set)  # job ids (store, retrieve, step event) not finished yet
    inflight: int = 0
    closed: bool = False
    # Set for a connection served from the descriptor reserve (daemon/server.py): it may not register.
    register_refusal: KVError | None = None
    # Stops the adapter watching ``process``'s pidfd (daemon/server.py); run before the pidfd is closed.
    unwatch: Callable[[], None] | None = None
    gone: bool = False  # the engine process exited or its connection ended: its copies were abandoned


class Scratch(NamedTuple):
    """A sampled hit's recomputed entry: the item naming it, its group, the pool room holding the copy."""

    item: Item
    group: GroupSpec
    alloc: Allocation


class RequestLog(TypedDict, total=False):
    """``extra=`` fields of a per-request log line (``request_log``)."""

    peer_pid: Required[int]
    req_id: Required[int]
    engine: int  # the registered engine's id, or
    conn: int  # the connection's, before Register


def request_log(conn: Conn, req_id: int) -> RequestLog:
    """``extra=`` fields for a per-request log line: ``engine`` (or ``conn``), ``peer_pid``, ``req_id``."""
    fields: RequestLog = {"peer_pid": conn.pid, "req_id": req_id}
    if conn.engine is not None:
        fields["engine"] = conn.engine.engine_id
    else:
        fields["conn"] = conn.conn_id
    return fields


# An enqueued copy is settled by its engine's own budget (copy_timeout_s); the daemon's wait is a backstop
# this long past it.
ENQUEUED_GRACE_S = 5.0


def _settle_future(fut: asyncio.Future[CopyResult], ticket: EnqueuedCopy) -> None:
    """Pass an enqueued copy's outcome (``EnqueuedCopy``) to its future on the loop."""
    if fut.done():
        return
    exc = ticket.exception()
    if exc is None:
        fut.set_result(ticket.result)
    else:
        fut.set_exception(exc)


def _gather(buffer: memoryview, extents: tuple[Extent, ...]) -> bytes:
    """An allocation's bytes, in entry order."""
    return b"".join(buffer[x.pool_offset:x.pool_offset + x.length] for x in extents)


def _settled_copy(fut: asyncio.Future[CopyResult]) -> None:
    """Retrieve a copy thread's outcome; one nobody awaits any more (timed out, cancelled) is logged at debug."""
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.debug("a copy thread ended with %r", exc)


class KVService:
    """Built whole by ``daemon/app.py``, its collaborators given at construction and never swapped:

    - ``config``: the running config, read at each use (``cfg``); SIGHUP swaps it (``ConfigCell``);
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
        self.copy_engine = copy_engine
        self.executor = executor
        self.step_executor = step_executor or executor
        self.metrics = metrics
        self.disk = disk  # the cold-restart tier (--l2-path), or None
        self.cluster = cluster  # the cluster tier (--cluster), or None
        self.tiers: list[Tier[object]] = [t for t in (disk, cluster) if t is not None]  # local before remote
        self.promoter = Promoter(index, metrics, self.tiers)
        self.shutting_down = False
        self.peers = peers
        self.heap = heap
        self.announcer = announcer
        self.publisher = publisher
        self.scrubber = scrubber  # entry checksums and the scrubber (daemon/integrity/), for their stats
        self.copy_timeout_s = config.current.copy_timeout_s  # not reloadable
        self.descriptors = DescriptorBudget.current()  # the control socket's share (daemon/server.py)
        self.traffic = EngineTraffic()  # per (model, rank): lookups, stores, retrieves
        self.latencies = Latencies()  # lookup, store, retrieve: request to reply
        self.quarantine = Quarantine()  # sampled hits' comparisons; its pairs are withheld from every plan
        index.withheld = self.quarantine
        self._checks: set[asyncio.Task[VerifyResult]] = set()  # comparisons of confirmed boundary states
        # Where every engine's turn-end states end (Store.turn_end), by layout and the whole chunk before them,
        # named in lookup replies (LookupReply.ends).
        self.turn_ends = TurnEnds(limit=TURN_END_CHUNKS, per_key=TURN_ENDS_PER_CHUNK)

    @property
    def cfg(self) -> DaemonConfig:
        """The running config: read it at each use (a reload replaces it), never keep it."""
        return self.config.current

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
        if self.shutting_down and not isinstance(msg, (kv.Release, control.Bye, kv.Abort, control.Status, kv.Pin)):
            raise ShuttingDown("hkvd is shutting down; the engine will recompute and reconnect later")
        match msg:
            case kv.Lookup():
                return self._lookup(conn, msg)
            case kv.Store():
                conn.jobs.add(msg.req_id)
                return self._store(conn, msg)
            case kv.Retrieve():
                conn.jobs.add(msg.req_id)
                return self._retrieve(conn, msg)
            case events.StepEvent():
                conn.jobs.add(msg.req_id)
                return self._step_event(conn, msg)
            case kv.Verify():
                conn.jobs.add(msg.req_id)
                return self._verify(conn, msg)
            case events.KVEventsPoll():
                self._poll_events(conn, msg)
            case control.Ping():
                conn.send(control.Pong(msg.req_id))
            case kv.Release():
                self.index.release(msg.lease_id)
            case kv.WatchLease():
                self._watch_lease(conn, msg)
            case kv.Pin():
                self._pin(conn, msg)
            case control.Unpin():
                n = self.index.unpin_session(msg.session)
                log.info("unpinned session %r: %d pins ended", msg.session[:40], n)
                conn.send(Unpinned(0, n).to_done(msg.req_id))
            case kv.Uncacheable():
                self._engine(conn, copy=False)
                self.metrics.inc("uncacheable_requests", reason=msg.reason)
            case peer.Pull():
                self._pull(conn, msg)
            case kv.Abort():
                self._abort(conn, msg.req_id)
                conn.send(kv.AbortAck(msg.req_id))
            case control.Register():
                self._register(conn, msg)
            case control.Unregister():
                self.disconnect(conn)
                conn.send(Acknowledged().to_done(msg.req_id))
            case control.Status():
                conn.send(control.StatusReply(msg.req_id, self.status()))
            case control.LiftQuarantine():
                lifted = (self.quarantine.lift_all("hkvd quarantine --clear all") if msg.fingerprint == "all"
                          else self.quarantine.lift(msg.fingerprint))
                conn.send(QuarantineLifted(0, ",".join(f"{fp.hex()}/{g}" for fp, g in lifted)).to_done(msg.req_id))
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
        self.index.pin_session(conn.engine.rank_fingerprints, msg.session, msg.tenant, msg.keys, msg.ttl_s,
                               msg.partial_keys)

    # ---- registration --------------------------------------------------------------------------
    def _register(self, conn: Conn, msg: control.Register) -> None:
        if conn.register_refusal is not None:
            raise conn.register_refusal
        if conn.engine is not None:
            raise RegistrationError("this connection already registered an engine; open one connection "
                                    "per engine rank")
        spec = msg.engine_spec()
        if spec.regions and conn.role == "scheduler":
            raise RegistrationError("a scheduler connection registers without regions (lookup only)")
        state = self.registry.register(spec, conn.process or conn.pid, conn.conn_id)
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
                                      self.kv_events_mode(), lease_watch=True, verify=True, pins=True,
                                      pin_partials=True, step_tenants=True, lookup_tails=True,
                                      partial_notes=True, turn_ends=True))

    def kv_events_mode(self) -> int:
        """What this daemon does with KV-event notes (``RegisterAck.kv_events``)."""
        if self.announcer is None:
            return control.KV_EVENTS_UNSUPPORTED
        return control.KV_EVENTS_PUBLISHED if self.publisher is not None else control.KV_EVENTS_ACCEPTED

    def _engine(self, conn: Conn, *, copy: bool) -> EngineState:
        if conn.engine is None:
            raise NotRegistered("register the engine (Register) before this request")
        if copy and conn.engine.attachment is None:
            raise NotRegistered("this connection registered no regions (lookup only); stores and "
                                "retrieves go through the worker connection")
        return conn.engine

    # ---- lookup --------------------------------------------------------------------------------
    def _lookup(self, conn: Conn, msg: kv.Lookup) -> Coroutine[Any, Any, None] | None:
        """Answer from the pool now, or return the coroutine that first reads from the lower tiers (disk,
        cluster) what the hit needs."""
        engine = self._engine(conn, copy=False)
        plan, missing = self._plan_lookup(engine, msg.keys)
        keys, tail = msg.keys, 0
        if msg.tails:
            plan, keys, tail = self._with_tail(engine, msg, plan)
        n = plan.hit_chunks - (tail > 0)  # the whole chunks of the hit
        if self.promoter.usable() and (n < len(msg.keys) or (not tail and self._tails_from(msg, n))):
            return self._lookup_via_tiers(conn, engine, msg)
        self._answer_lookup(conn, engine, msg, plan, missing, keys, tail)
        return None

    async def _lookup_via_tiers(self, conn: Conn, engine: EngineState, msg: kv.Lookup) -> None:
        log_extra = request_log(conn, msg.req_id)
        await self.promoter.promote(engine, msg.keys, log_extra)
        plan, missing = self._plan_lookup(engine, msg.keys)  # again: the pool may have changed meanwhile
        keys, tail = msg.keys, 0
        if msg.tails:
            plan, keys, tail = self._with_tail(engine, msg, plan)
            for _, j, key in [] if tail else self._tails_from(msg, plan.hit_chunks):  # longest first
                if await self.promoter.promote(engine, [*msg.keys[:j], key], log_extra):  # read one, try again
                    plan, keys, tail = self._with_tail(engine, msg, plan)
                    if tail:
                        break
        self._answer_lookup(conn, engine, msg, plan, missing, keys, tail)

    @staticmethod
    def _tails_from(msg: kv.Lookup, n: int) -> list[tuple[int, int, bytes]]:
        """``msg``'s tails (index, chunk, key) that may end a hit longer than ``n`` whole chunks, in the order
        sent. A tail at chunk j > n may: the whole chunks may stop at n for want of a Mamba state, which a
        partial chunk carries itself."""
        return [(i, t[0], t[1]) for i, t in enumerate(msg.tails) if t[0] >= n]

    def _with_tail(self, engine: EngineState, msg: kv.Lookup, plan: HitPlan) -> tuple[HitPlan, list[bytes], int]:
        """``plan`` (a hit of n whole chunks) extended by the first of ``msg.tails`` (at a chunk j >= n) that the
        pool serves after the chunks before it: (its plan, of j + 1 chunks; the keys it covers; 1 + the tail's
        index); ``plan`` and ``msg.keys`` with 0 when none does."""
        fps, ready = engine.rank_fingerprints, self.index.is_ready
        for i, j, key in self._tails_from(msg, plan.hit_chunks):
            if not all(ready((fp, gid, key)) for fp in fps for gid in engine.groups):
                continue  # the usual case, decided without planning the chunks before it again
            keys = [*msg.keys[:j], key]
            extended, _ = self._plan_lookup(engine, keys)
            if extended.hit_chunks == j + 1:
                return extended, keys, i + 1
        return plan, msg.keys, 0

    def _plan_lookup(self, engine: EngineState, keys: list[bytes]) -> tuple[HitPlan, dict[str, int]]:
        """The best hit the pool can serve to every rank, and the entries it lacks by kind."""
        missing: dict[str, int] = {}  # the pool only: what a retrieve can be served from
        return self.index.plan(engine, keys, engine.rank_fingerprints, missing=missing), missing

    def _answer_lookup(self, conn: Conn, engine: EngineState, msg: kv.Lookup, plan: HitPlan,
                       missing: dict[str, int], keys: list[bytes], tail: int) -> None:
        """Reply with ``plan``, a hit over ``keys`` (``msg.keys``, or their first chunks and the tail ``tail``
        names), leased when asked."""
        kinds = engine.kinds
        lease_id = 0
        if msg.lease and plan.hit_chunks > 0:  # every rank's entries, one retrieve per rank
            lease_id = self.index.lease(plan, keys, engine.rank_fingerprints, conn.conn_id, self.cfg.lease_ttl_s)
        self.metrics.inc("lookups")
        self.metrics.inc("lookup_hit_chunks", plan.hit_chunks)
        self.metrics.inc("lookup_miss_chunks", max(0, len(msg.keys) - plan.hit_chunks))
        self.traffic.lookup(engine.spec.model, engine.spec.rank, plan.hit_chunks * engine.chunk_size,
                            max(0, len(msg.keys) - plan.hit_chunks) * engine.chunk_size)
        hit_by_kind: dict[str, int] = {}
        for gid, chunks in plan.needed.items():
            hit_by_kind[kinds[gid]] = hit_by_kind.get(kinds[gid], 0) + len(chunks)
        for kind, n in hit_by_kind.items():
            self.metrics.inc("lookup_hit_entries", n, kind=kind)
        for kind, n in missing.items():
            self.metrics.inc("lookup_miss_entries", n, kind=kind)
        ends = self._ends(engine, msg, plan.hit_chunks) if msg.ends and not tail else []
        if ends:
            self.metrics.inc("lookup_turn_ends_named", len(ends))
        conn.send(kv.LookupReply(msg.req_id, plan.hit_chunks, lease_id, self.cfg.lease_ttl_s, tail, ends))

    def _ends(self, engine: EngineState, msg: kv.Lookup, n: int) -> list[list[int]]:
        """``[chunk_index, offset]`` of the turn ends engines of this layout stored inside chunks
        n .. len(msg.keys) (after the whole chunk before each), the last chunk's first: where a hit of n whole
        chunks may still end (a turn end at a chunk past n carries its own Mamba state, which the whole chunks
        may lack)."""
        out: list[list[int]] = []
        layout = engine.world_fingerprints[0]  # engines of one layout share entries, and turn ends
        for j in range(len(msg.keys), n - 1, -1):
            out.extend([j, off] for off in self.turn_ends.offsets(layout + (msg.keys[j - 1] if j else ROOT_KEY)))
            if len(out) >= kv.MAX_ENDS:
                break
        return out[:kv.MAX_ENDS]

    def _turn_end_parent(self, engine: EngineState, msg: kv.Store) -> bytes:
        """The key of the whole chunk before the turn end ``msg`` stores (``ROOT_KEY`` for chunk 0); raise
        ``OutOfRange`` when its items are not one partial chunk ending ``msg.turn_end`` into a chunk."""
        items = msg.items
        j = items[0].chunk_index if items else 0
        if (not items or any((it.key, it.chunk_index, it.parent) != (items[0].key, j, items[0].parent) for it in items)
                or not msg.turn_end < engine.chunk_size or (j and not items[0].parent)):
            raise OutOfRange(f"Store.turn_end {msg.turn_end}: the items of a turn end must be one partial chunk (one "
                             f"key and chunk index, the parent key named past chunk 0) ending inside a chunk of "
                             f"{engine.chunk_size} tokens")
        return items[0].parent if j else ROOT_KEY

    # ---- lower tiers: write-behind on READY (reads: daemon/tiers/promotion.py) ------------------------
    def _write_behind(self, entries: list[Entry]) -> None:
        """Offer READY entries to each lower tier; an entry stays pinned until each tier that took it is done."""
        for tier in self.tiers:
            for e in entries:
                if e.state is EntryState.READY and tier.offer(
                        e.key, e.kind, e.nbytes, e.parent, e.alloc.extents,
                        functools.partial(self.index.unpin, e)):
                    self.index.pin(e)

    def _by_kind(self, name: str) -> dict[str, float]:
        return self._by_label(name, "kind")

    def _by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(labels).get(label, ""): v for labels, v in self.metrics.counters.get(name, {}).items()}

    # ---- store ---------------------------------------------------------------------------------
    async def _store(self, conn: Conn, msg: kv.Store) -> None:
        engine = self._engine(conn, copy=True)
        items = msg.items
        notes = self._check_notes(engine, msg.parsed_notes(), items)
        parent = self._turn_end_parent(engine, msg) if msg.turn_end else None
        stored, _ = await self._write_items(conn, engine, items, job_id=msg.req_id, pending=False,
                                            wait_event=msg.wait_event, notes=notes, tenant=msg.tenant)
        if parent is not None:
            self.turn_ends.add(engine.world_fingerprints[0] + parent, msg.turn_end)
        conn.send(stored.to_done(msg.req_id))

    async def _write_items(self, conn: Conn, engine: EngineState, items: list[Item], *, job_id: int,
                           pending: bool, wait_event: bytes = b"", notes: list[BlockNote] | None = None,
                           tenant: str | Sequence[str] = "") -> tuple[StoreResult, list[Entry]]:
        """Copy ``items`` into new pool entries of ``tenant`` (one for all, or one per item); their counts for the
        reply, and the entries written.

        ``pending``: a step event's states, unconfirmed, whose copy has a deadline (``step_executor``)."""
        groups = [engine.check_item(it) for it in items]  # all or nothing: check before any write
        announcer = self.announcer if notes else None
        skipped = dropped = thinned = 0
        tenants = [tenant] * len(items) if isinstance(tenant, str) else list(tenant)
        keep: list[tuple[Item, GroupSpec]] = []
        kept_tenants: list[str] = []
        for it, g, t in zip(items, groups, tenants, strict=True):
            if g.kind == "mamba" and not mamba_checkpoint_keep(it.chunk_index, self.cfg.mamba_checkpoint_interval):
                thinned += 1
                self.metrics.inc("mamba_states_thinned")
                self.metrics.inc("mamba_bytes_saved", engine.entry_bytes[g.group_id])
                continue
            keep.append((it, g))
            kept_tenants.append(t)
        fp, sizes = engine.fingerprint, engine.entry_bytes
        begun = self.index.begin_store([((fp, g.group_id, it.key), sizes[g.group_id], g.kind, it.parent)
                                         for it, g in keep], job_id, kept_tenants)
        entries: list[Entry] = []
        placed: list[tuple[GroupSpec, list[int], tuple[Extent, ...]]] = []
        for (it, g), got in zip(keep, begun, strict=True):
            if got is None:
                skipped += 1
            elif isinstance(got, PoolFull):
                dropped += 1
                self.index.note_store_dropped()
                self.metrics.inc("stores_dropped", kind=g.kind)
            else:
                entries.append(got)
                placed.append((g, it.block_ids, got.alloc.extents))
        nbytes = 0
        try:  # from here on, any failure gives back every entry begun above
            segments = layout.segments_for_entries(placed)
            if segments:
                nbytes = (await self._run_copy(conn, engine.attachment, segments, Direction.TO_POOL,
                                               wait_event, urgent=pending))[0].nbytes
        except BaseException as exc:
            self._release_after_copy(exc, functools.partial(self._abandon_writes, entries))
            raise
        if job_id in conn.aborted:
            self._abandon_writes(entries)
            conn.aborted.discard(job_id)
            raise Aborted(f"job {job_id} was aborted by the client; nothing was stored")
        # Notes first: the entries are announced as they turn READY (stored; Mamba states on confirmation).
        noted = announcer.accept(engine, notes or []) if announcer is not None else []
        self.index.complete_store(entries, pending=pending)
        if announcer is not None:
            announcer.settle(engine, noted)
        if not pending:
            self._write_behind(entries)
        self.traffic.stored(engine.spec.model, engine.spec.rank, self._count_bytes("stored_bytes", entries))
        return StoreResult(nbytes, len(entries), skipped, dropped, thinned), entries

    def _abandon_writes(self, entries: list[Entry]) -> None:
        for e in entries:
            self.index.abandon_write(e)

    def _count_bytes(self, name: str, entries: list[Entry]) -> int:
        """Count ``entries``' bytes under ``name`` by group kind; their total."""
        by_kind: dict[str, int] = {}
        for e in entries:
            by_kind[e.kind] = by_kind.get(e.kind, 0) + e.nbytes
        for kind, n in by_kind.items():
            self.metrics.inc(name, n, kind=kind)
        return sum(by_kind.values())

    # ---- retrieve ------------------------------------------------------------------------------
    async def _retrieve(self, conn: Conn, msg: kv.Retrieve) -> None:
        t0 = time.perf_counter()
        engine = self._engine(conn, copy=True)
        items = msg.items
        groups = [engine.check_item(it) for it in items]
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
        segments = layout.segments_for_entries(
            [(g, it.block_ids, e.alloc.extents) for it, g, e in zip(items, groups, entries, strict=True)])
        unpin = self.index.pin_for_read(entries)
        try:
            # A device copy answers once it is enqueued (the engine's stream waits on its done event):
            # the pages stay pinned until the device has read them (``settled``).
            result, settled = await self._run_copy(conn, engine.attachment, segments, Direction.FROM_POOL,
                                                   answer_enqueued=True)
        except BaseException as exc:
            if msg.lease_id:
                self.index.use_lease(msg.lease_id, written=False)
            self._release_after_copy(exc, unpin)
            raise
        if settled is None:
            unpin()
        else:
            settled.add_done_callback(functools.partial(self._retrieve_settled, unpin))
        self.traffic.retrieved(engine.spec.model, engine.spec.rank, self._count_bytes("retrieved_bytes", entries))
        conn.send(RetrieveResult(result.nbytes, len(entries), result.done_event,
                                 time.perf_counter() - t0).to_done(msg.req_id))
        if msg.lease_id:
            # Every byte is in the engine's blocks, unless the engine's stream must still wait for
            # the copy (a GPU done event): only the worker can report that load.
            self.index.use_lease(msg.lease_id, written=not result.done_event)

    def _watch_lease(self, conn: Conn, msg: kv.WatchLease) -> None:
        """Answer once every retrieve under the lease wrote its bytes (Done) or the lease ended
        otherwise (Error): the scheduler side reports a load a step before a worker could."""
        self._engine(conn, copy=False)

        def notify(written: bool) -> None:
            if written:
                conn.send(Acknowledged().to_done(msg.req_id))
            else:
                conn.send(kv.Error(msg.req_id, int(ErrorCode.LEASE_EXPIRED),
                                   f"lease {msg.lease_id} ended before every rank's retrieve wrote its blocks"))

        self.index.watch_lease(msg.lease_id, conn.conn_id, notify)

    # ---- step events (Mamba boundary states) ---------------------------------------------------
    async def _step_event(self, conn: Conn, msg: events.StepEvent) -> None:
        engine = self._engine(conn, copy=True)
        assert conn.snapshots is not None
        offers, verifies = msg.offers, msg.verifies
        for field_name, items in (("offers", offers), ("verifies", verifies)):
            for it in items:
                if engine.check_item(it).kind != "mamba":
                    raise ProtocolViolation(f"StepEvent {field_name} carry Mamba states only; group {it.group_id} "
                                            f"is {engine.groups[it.group_id].kind}")
        notes = self._check_notes(engine, msg.parsed_notes(), offers)
        # Offers and verifies of one event are one job: copied, invalidated and confirmed together.
        decision = conn.snapshots.on_step_event(msg.seq, msg.step, msg.req_id, [*offers, *verifies],
                                                list(msg.confirms))
        for job in decision.visible:
            for e in conn.pending.pop(job, []):
                if self.index.confirm(e):  # not if it was dropped meanwhile: its pages may hold another entry
                    self._write_behind([e])
            if job in conn.verifying:
                self._start_check(conn, engine, conn.verifying.pop(job))
        self._drop_jobs(conn, list(decision.invalidated))
        self.metrics.inc("step_events", outcome=decision.outcome.value)
        if decision.outcome is StepOutcome.GAP:
            self.metrics.inc("step_event_gaps")
        if not decision.start_copies:
            conn.send(StepResult(0, decision.outcome.value).to_done(msg.req_id))
            return
        try:
            copied, written = await self._write_items(conn, engine, offers, job_id=msg.req_id,
                                                      pending=True, wait_event=msg.wait_event, notes=notes,
                                                      tenant=msg.tenants or "")
        except BaseException:
            conn.snapshots.on_copy_failed(msg.req_id)
            raise
        try:
            scratch = await self._copy_scratch(conn, engine, verifies, msg.wait_event, urgent=True)
        except BaseException:
            conn.snapshots.on_copy_failed(msg.req_id)
            for e in written:
                self.index.drop(e)
            raise
        if conn.snapshots.on_copy_done(msg.req_id):
            conn.pending[msg.req_id] = written
            if scratch:
                conn.verifying[msg.req_id] = scratch
        else:  # invalidated while copying: the block may have been reused under us
            for e in written:
                self.index.drop(e)
            self._free_scratch(scratch)
        conn.send(StepResult.after_copy(decision.outcome.value, copied).to_done(msg.req_id))

    def _check_notes(self, engine: EngineState, notes: list[BlockNote], items: list[Item]) -> list[BlockNote]:
        """The message's KV-event notes, checked against the engine and its items (``OutOfRange``); none
        when this daemon keeps no KV events."""
        if not notes or self.announcer is None:
            return []
        self.announcer.check(engine, notes, items)
        return notes

    def _poll_events(self, conn: Conn, msg: events.KVEventsPoll) -> None:
        engine = self._engine(conn, copy=False)
        if self.announcer is None:
            raise NotFound("this hkvd keeps no KV events (its RegisterAck said so); do not poll it")
        conn.send(self.announcer.poll(engine, msg.req_id, msg.since))

    def _drop_jobs(self, conn: Conn, job_ids: list[int]) -> None:
        for job in job_ids:
            for e in conn.pending.pop(job, []):
                self.index.drop(e)
            self._free_scratch(conn.verifying.pop(job, []))  # never compared: it may hold a later state
            self.metrics.inc("snapshots_invalidated")

    def _abort(self, conn: Conn, req_id: int) -> None:
        log.info("abort requested", extra=request_log(conn, req_id))
        if req_id in conn.jobs:  # an abort of a finished (or unknown) job changes nothing and is not kept
            conn.aborted.add(req_id)
        if conn.snapshots is not None:
            conn.snapshots.on_abort([req_id])
        self._drop_jobs(conn, [req_id] if req_id in conn.pending or req_id in conn.verifying else [])

    # ---- sampled hits, recomputed: compare, never store (daemon/integrity; docs/verification.md) ----
    async def _verify(self, conn: Conn, msg: kv.Verify) -> None:
        """Copy the engine's blocks of ``msg.items`` into scratch room, compare each with the entry held
        under its key, count and maybe quarantine; answer a ``VerifyResult``. Entries no longer held are
        missing (neither copied nor compared)."""
        engine = self._engine(conn, copy=True)
        fp = engine.fingerprint
        checked = [(it, engine.check_item(it)) for it in msg.items]  # all or nothing: check before any copy
        held: list[tuple[Item, GroupSpec]] = []
        absent: list[tuple[Item, GroupSpec]] = []
        for it, g in checked:
            (held if self.index.is_ready((fp, g.group_id, it.key)) else absent).append((it, g))
        keep = [e for it, g in held if (e := self.index.get((fp, g.group_id, it.key))) is not None]
        unpin = self.index.pin_for_read(keep)  # the scratch room below must not evict what it is compared with
        try:
            scratch = await self._copy_scratch(conn, engine, [it for it, _ in held], msg.wait_event, urgent=False)
            if msg.req_id in conn.aborted:
                self._free_scratch(scratch)
                conn.aborted.discard(msg.req_id)
                raise Aborted(f"job {msg.req_id} was aborted by the client; nothing was compared")
            result = await self._check(engine, scratch, absent)
        finally:
            unpin()
        conn.send(result.to_done(msg.req_id))

    async def _copy_scratch(self, conn: Conn, engine: EngineState, items: list[Item], wait_event: bytes, *,
                            urgent: bool) -> list[Scratch]:
        """The engine's blocks of ``items``, copied into scratch pool room (freed by ``_check``)."""
        if not items:
            return []
        scratch: list[Scratch] = []
        try:
            for it in items:
                g = engine.check_item(it)
                scratch.append(Scratch(it, g, self.index.scratch(engine.entry_bytes[g.group_id])))
            segments = layout.segments_for_entries([(s.group, s.item.block_ids, s.alloc.extents) for s in scratch])
            await self._run_copy(conn, engine.attachment, segments, Direction.TO_POOL, wait_event, urgent=urgent)
        except BaseException as exc:
            self._release_after_copy(exc, functools.partial(self._free_scratch, scratch))
            raise
        return scratch

    def _free_scratch(self, scratch: list[Scratch]) -> None:
        for s in scratch:
            self.index.pool.free(s.alloc)

    def _start_check(self, conn: Conn, engine: EngineState, scratch: list[Scratch]) -> None:
        """Compare confirmed boundary states in the background: the step event's own copies go first."""
        task = asyncio.create_task(self._check(engine, scratch, []))
        self._checks.add(task)
        task.add_done_callback(self._check_done)

    def _check_done(self, task: asyncio.Task[VerifyResult]) -> None:
        self._checks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("comparing a sampled hit's boundary states failed: %r", exc)

    async def _check(self, engine: EngineState, scratch: list[Scratch],
                     absent: list[tuple[Item, GroupSpec]]) -> VerifyResult:
        """Compare each scratch copy with the entry under its key (absent now: missing); free the scratch;
        count per (fingerprint, group) and quarantine past the threshold."""
        fp, cfg, pool = engine.fingerprint, self.cfg, self.index.pool
        try:
            pairs: list[tuple[Scratch, Entry]] = []
            for s in scratch:
                e = self.index.get((fp, s.group.group_id, s.item.key))
                if e is None or e.state is not EntryState.READY:
                    absent.append((s.item, s.group))
                else:
                    pairs.append((s, e))
            unpin = self.index.pin_for_read([e for _, e in pairs])
            try:
                def compare() -> list[float]:
                    return [entry_error(_gather(pool.buffer, s.alloc.extents), _gather(pool.buffer, e.alloc.extents),
                                        s.group) for s, e in pairs]
                errors = await asyncio.get_running_loop().run_in_executor(self.executor, compare) if pairs else []
            finally:
                unpin()
        finally:
            self._free_scratch(scratch)
        by_group: dict[int, tuple[GroupSpec, list[tuple[Item, float]], int]] = {}
        for (s, _), err in zip(pairs, errors, strict=True):
            by_group.setdefault(s.group.group_id, (s.group, [], 0))[1].append((s.item, err))
        for _it, g in absent:
            g_, seen, n = by_group.get(g.group_id, (g, [], 0))
            by_group[g.group_id] = (g_, seen, n + 1)
        diverged_total, quarantined, worst = 0, False, 0.0
        for gid, (g, seen, n_missing) in sorted(by_group.items()):
            tol = tolerance(g.kind, cfg.verify_tolerance, cfg.verify_mamba_tolerance)
            bad = [(it, err) for it, err in seen if err > tol]
            worst_g = max((err for _, err in seen), default=0.0)
            worst = max(worst, worst_g)
            diverged_total += len(bad)
            evidence = "; ".join(f"chunk {it.chunk_index} key {it.key.hex()[:16]} error {err:.4g}"
                                 for it, err in bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
            if bad:
                log.warning("sampled hit diverged: fingerprint %s group %d (%s), %d of %d entries past tolerance "
                            "%g: %s", fp.hex(), gid, g.kind, len(bad), len(seen), tol, evidence)
            quarantined |= self.quarantine.record(
                fp, gid, g.kind, checked=len(seen), diverged=len(bad), missing=n_missing, max_error=worst_g,
                evidence=f"{evidence} (tolerance {tol:g})", threshold=cfg.quarantine_after,
                window_s=cfg.quarantine_window_s)
        nbytes = sum(s.alloc.nbytes for s in scratch)
        return VerifyResult(nbytes, len(pairs), diverged_total, len(absent), worst, quarantined)

    # ---- copies --------------------------------------------------------------------------------
    async def _run_copy(self, conn: Conn, attachment: Attachment | None, segments: list[Segment],
                        direction: Direction, wait_event: bytes = b"", urgent: bool = False,
                        answer_enqueued: bool = False) -> tuple[CopyResult, asyncio.Future[CopyResult] | None]:
        """Move ``segments``: on a copy thread with a timeout (``urgent``: the step events' own), or on
        the loop when the engine says a copy this small costs less than the hand-off (``inline_max_bytes``).

        An engine that ``enqueues`` (CUDA) holds the copy thread only while it enqueues. Its copy is
        awaited until the device finished it, unless ``answer_enqueued`` (a retrieve, whose reply carries
        the done event the engine's stream waits on): then this returns once the copy is enqueued, with
        the future that settles when the device finished it (or failed); else that future is None."""
        assert attachment is not None
        engine = self.copy_engine
        conn.inflight += 1
        t0 = time.perf_counter()
        try:
            settled = None
            if (engine.inline_max_bytes and not wait_event
                    and sum(s.nbytes for s in segments) <= engine.inline_max_bytes):
                result = engine.copy_ordered(attachment, segments, direction)
            elif engine.enqueues:
                result, settled = await self._enqueued_copy(self.step_executor if urgent else self.executor, engine,
                                                            attachment, segments, direction, wait_event,
                                                            answer_enqueued)
            else:
                result = await self._threaded_copy(self.step_executor if urgent else self.executor, engine,
                                                   attachment, segments, direction, wait_event)
            if settled is None:
                # GB/s of the last copies per direction, submit to completion (thread hand-off included)
                self.metrics.observe_rate("copy", result.nbytes, time.perf_counter() - t0,
                                          direction=direction.value)
            else:
                settled.add_done_callback(functools.partial(self._count_settled, direction, t0))
            return result, settled
        except KVTimeout:
            raise  # counted as copy_timeouts
        except KVError:
            self.metrics.inc("copy_errors")
            raise
        except OSError as e:
            self.metrics.inc("copy_errors")
            raise CopyFailedError(f"{direction.value} copy failed: {e}") from None
        finally:
            conn.inflight -= 1

    async def _enqueued_copy(self, executor: Executor, engine: CopyEngine, attachment: Attachment,
                             segments: list[Segment], direction: Direction, wait_event: bytes,
                             answer_enqueued: bool) -> tuple[CopyResult, asyncio.Future[CopyResult] | None]:
        """``CopyEngine.submit`` on a copy thread (it returns once the copy is enqueued or gated), then the
        device's completion, bridged to the loop. See ``_run_copy``."""
        loop = asyncio.get_running_loop()
        ticket = await loop.run_in_executor(executor, functools.partial(
            engine.submit, attachment, segments, direction, wait_event=wait_event or None))
        settled: asyncio.Future[CopyResult] = loop.create_future()

        def bridge(t: EnqueuedCopy) -> None:  # on the engine's completion thread
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                loop.call_soon_threadsafe(_settle_future, settled, t)

        ticket.add_done_callback(bridge)
        if answer_enqueued and not wait_event:  # enqueued already: its done event is in the result
            return ticket.result, settled
        # The engine's own budget settles the ticket (KVTimeout, PagesInUse); this bound is a backstop.
        try:
            async with asyncio.timeout(self.copy_timeout_s + ENQUEUED_GRACE_S):
                return await asyncio.shield(settled), None
        except TimeoutError:
            self.metrics.inc("copy_timeouts")
            settled.add_done_callback(_settled_copy)
            err = KVTimeout(f"{direction.value} copy: no completion from the device after "
                            f"{self.copy_timeout_s + ENQUEUED_GRACE_S:g} s")
            err.pages_in_use = PagesInUse.until_finished(ticket)  # type: ignore[attr-defined]
            raise err from None

    def _count_settled(self, direction: Direction, t0: float, settled: asyncio.Future[CopyResult]) -> None:
        """A copy answered once enqueued has settled: count its rate, or its failure."""
        if settled.cancelled():
            return
        exc = settled.exception()
        if exc is None:
            self.metrics.observe_rate("copy", settled.result().nbytes, time.perf_counter() - t0,
                                      direction=direction.value)
        elif isinstance(exc, KVTimeout):
            self.metrics.inc("copy_timeouts")
        else:
            self.metrics.inc("copy_errors")

    def _retrieve_settled(self, unpin: Callable[[], None], settled: asyncio.Future[CopyResult]) -> None:
        """A retrieve answered once enqueued has settled on the device: unpin its pages (once the device
        is done with them, after a failure). The engine was told of the copy already; its stream waits on
        the done event, which a failed copy that still runs completes late, and a faulted one never."""
        exc = None if settled.cancelled() else settled.exception()
        if exc is None:
            unpin()
            return
        log.warning("a retrieve answered once enqueued failed on the device: %s", exc)
        self._release_after_copy(exc, unpin)

    async def _threaded_copy(self, executor: Executor, engine: CopyEngine, attachment: Attachment,
                             segments: list[Segment], direction: Direction, wait_event: bytes) -> CopyResult:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(executor, functools.partial(
            engine.copy_ordered, attachment, segments, direction, wait_event=wait_event or None))
        # The shield below stops passing the thread's outcome on once this job times out or is
        # cancelled: its exception (the engine's own timeout, say) is retrieved here instead of
        # being reported by asyncio as "never retrieved" when the future is collected.
        fut.add_done_callback(_settled_copy)
        try:
            async with asyncio.timeout(self.copy_timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            self.metrics.inc("copy_timeouts")
            # The thread still uses the pages: wait for it (bounded by the kernel call) before unpinning.
            await asyncio.wait([fut])
            raise KVTimeout(f"{direction.value} copy took longer than {self.copy_timeout_s:g} s") from None

    def _release_after_copy(self, exc: BaseException, release: Callable[[], None]) -> None:
        """Give a failed copy's pool pages back (``release``): now, or, when the copy engine says the GPU
        may still run that copy (``PagesInUse`` on its error), once it has finished. Until then the
        entries stay pinned (WRITING ones are never served): a late write lands in pages nobody reuses."""
        held = PagesInUse.of(exc)
        if held is None or held.is_free():
            release()
            return
        loop = asyncio.get_running_loop()
        log.info("a failed copy may still run on the GPU: its pool pages stay held until it has finished")

        def free_on_loop() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: the pool goes with it
                loop.call_soon_threadsafe(release)

        held.call_when_free(free_on_loop)

    # ---- lifecycle -----------------------------------------------------------------------------
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
            self._drop_jobs(conn, conn.snapshots.on_disconnect())
            conn.snapshots = None  # a later Abort or re-registration must not reach the closed ordering
        for job in {*conn.pending, *conn.verifying}:
            self._drop_jobs(conn, [job])
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

    def statistics(self) -> ServiceStats:
        """Every component's ``statistics()``; ``status()`` and /metrics are derived from it."""
        kv_events = None
        if self.announcer is not None:
            kv_events = KVEventsStats(self.announcer.statistics(),
                                      self.publisher.statistics() if self.publisher is not None else None)
        return ServiceStats(
            registry=self.registry.statistics(),
            pool=self.index.pool.statistics(),
            index=self.index.statistics(),
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
            pins=self.index.pin_statistics(),
            tenants=self.index.tenants.statistics(),
        )

    def status(self) -> dict[str, Any]:
        """The status JSON (``hkvd status``, the control socket's ``StatusReply``): ``statistics()`` as dicts."""
        return status_dict(self.statistics())
