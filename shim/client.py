"""A small synchronous client for the daemon, for use inside vLLM. It never imports asyncio.

Threading model
    One client per connection; calls are serialised by an internal lock, so a background
    thread may poll while the engine thread submits. Submits never wait for the daemon: they
    write one frame and return its ``req_id``. Completions are collected by ``poll`` (non-blocking
    by default) or ``wait`` (bounded by ``timeout_s``). Every wait has a timeout.

Transport
    Connecting, framing, the non-blocking socket and its timeouts are ``hkvd.shim.client_socket.FrameSocket``'s
    (a round trip is three system calls: send, poll, recv); this module is the requests and their completions.

Failure model
    If the daemon goes away, every outstanding request completes with ``DaemonUnavailable`` and
    later submits raise it at once; the caller decides when to ``connect`` again. A reply of
    ``Error`` becomes a completion whose ``error`` is the typed ``KVError`` registered for its code.
    A daemon of another protocol version refuses our ``Hello`` with an ``Error`` that names both
    versions (``UnsupportedVersion``, raised by ``connect``).

Replies
    Every request is answered by its own message type (``hkvd.transport.wire.replies.REPLIES``); the
    completion's result is that message as sent. Another type in reply to it is a ``ProtocolViolation``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hkvd.shim.client_socket import FrameSocket
from hkvd.shim.daemon_port import DaemonPort
from hkvd.shim.results import Completion, Result
from hkvd.transport.codec import encode
from hkvd.transport.errors import (
    DaemonUnavailable,
    KVError,
    KVTimeout,
    ProtocolViolation,
    UnsupportedVersion,
    error_from_wire,
)
from hkvd.transport.wire import PROTOCOL_VERSION, Message, control, events, kv
from hkvd.transport.wire import peer as peer_wire
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.kv import Item
from hkvd.transport.wire.replies import REPLIES

_REPLY_TYPES = frozenset(REPLIES.values())


class DaemonClient(DaemonPort):
    """The daemon over its Unix socket: ``DaemonPort``, plus connecting, registering and status."""

    def __init__(self, socket_path: str, *, client_name: str, role: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.client_name = client_name
        self.role = role
        self.timeout_s = timeout_s
        self.daemon_pid = 0
        self.server_id = ""
        self.pool: list[int] = []  # HelloAck.pool: the daemon's pool offered for in-step loads ([fd, size])
        self.mapped_pool = ""  # set before register(): the daemon whose pool this process mapped (hkvd.shim.pool_reads)
        self._conn = FrameSocket(socket_path, timeout_s, self._fail_outstanding)
        self._ids = itertools.count(1)
        self._outstanding: dict[int, type] = {}  # req_id -> the request's message type
        self._done: dict[int, Completion] = {}
        self._lock = threading.RLock()

    # ---- connection ----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._conn.is_open

    def connect(self) -> None:
        with self._lock:
            self.close()
            self._conn.open()
            # If the daemon refused us and closed already, its reason is still in the socket.
            with contextlib.suppress(OSError):
                self._conn.send_bytes(encode(control.Hello(PROTOCOL_VERSION, self.client_name, self.role)))
            ack = self._conn.wait_message(control.HelloAck, self.timeout_s)
            if ack.version != PROTOCOL_VERSION:  # a daemon refuses a client of another version before its ack
                self._conn.lost("protocol version mismatch")
                raise UnsupportedVersion(f"hkvd at {self.socket_path} speaks protocol {ack.version}, this shim "
                                         f"{PROTOCOL_VERSION}; run the shim and hkvd serve from the same hkvd "
                                         "version")
            self.daemon_pid = ack.daemon_pid
            self.server_id = ack.server_id
            self.pool = list(ack.pool)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            self._fail_outstanding("connection closed")

    def __enter__(self) -> DaemonClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- blocking control calls (registration time, tools) -------------------------------------
    def register(self, spec: EngineSpec) -> control.RegisterAck:
        req = self._submit(lambda r: control.Register(r, spec.to_wire(), self.mapped_pool))
        c = self.wait([req], self.timeout_s)[req]
        if c.error is not None:
            raise c.error
        return c.get(control.RegisterAck)

    def status(self) -> dict[str, Any]:
        req = self._submit(lambda r: control.Status(r))
        return self.wait([req], self.timeout_s)[req].get(control.StatusReply).status

    def ping(self) -> float:
        t0 = time.perf_counter()
        req = self._submit(lambda r: control.Ping(r))
        c = self.wait([req], self.timeout_s)[req]
        if c.error is not None:
            raise c.error
        return time.perf_counter() - t0

    # ---- non-blocking submits ------------------------------------------------------------------
    def submit_lookup(self, keys: Sequence[bytes], lease: bool = True,
                      tails: Sequence[tuple[int, bytes]] = (), ends: bool = False, places: bool = False,
                      skip_tiers: int = 0) -> int:
        """``tails``: (chunk index, key) of partial chunks that may end the hit, longest first; only to a
        daemon whose RegisterAck says ``lookup_tails``. ``ends``: ask for the turn ends the daemon knows
        (``LookupReply.ends``); only to a daemon whose RegisterAck says ``turn_ends``. ``places``: ask where a
        leased hit lies in the pool (``LookupReply.places``, in-step loads); only to one that says ``in_step``.
        ``skip_tiers``: the tiers the request's load tiers leave out; only to one that says ``request_tiers``."""
        return self._submit(lambda r: kv.Lookup(r, list(keys), lease, [[j, k] for j, k in tails], ends, places,
                                                skip_tiers))

    def submit_store(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"",
                     notes: Sequence[BlockNote] | None = None, tenant: str = "", turn_end: int = 0,
                     skip_tiers: int = 0) -> int:
        """``wait_event``: IPC handle of the step-end CUDA event to order the copy after (GPU KV only).
        ``notes``: vLLM's names of the chunks, for KV events; only to a daemon whose RegisterAck takes them.
        ``tenant``: the storing request's tenant (``hkvd.shim.tenants``); only to a daemon whose RegisterAck
        says ``pins``. ``turn_end``: the items are a turn-end state ending this far into its chunk; only to a
        daemon whose RegisterAck says ``turn_ends``. ``skip_tiers``: the tiers the request's store tiers leave out
        (``hkvd.transport.tier_matchers``); only to a daemon whose RegisterAck says ``request_tiers``."""
        return self._submit(lambda r: kv.Store(r, _items(items), wait_event, _notes(notes), tenant, turn_end,
                                               skip_tiers))

    def submit_retrieve(self, items: Sequence[Item | Sequence[Any]], lease_id: int = 0) -> int:
        return self._submit(lambda r: kv.Retrieve(r, lease_id, _items(items)))

    def submit_step_event(self, seq: int, step: int, offers: Sequence[Item | Sequence[Any]],
                          confirms: Iterable[int] = (), wait_event: bytes = b"",
                          notes: Sequence[BlockNote] | None = None,
                          verifies: Sequence[Item | Sequence[Any]] = (), tenants: Sequence[str] = (),
                          skip_tiers: Sequence[int] = ()) -> int:
        """``verifies``: boundary states a sampled hit recomputed, compared once confirmed (never stored).
        ``tenants``: each offer's tenant, or none (only to a daemon whose RegisterAck says ``step_tenants``).
        ``skip_tiers``: the tiers each offer's store tiers leave out, or none (only to one that says
        ``request_tiers``)."""
        return self._submit(lambda r: events.StepEvent(r, seq, step, _items(offers), list(confirms), wait_event,
                                                       _notes(notes), _items(verifies), list(tenants),
                                                       list(skip_tiers)))

    def submit_verify(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"") -> int:
        """A sampled hit's recomputed chunks, to compare with the entries under their keys; a ``VerifyResult``."""
        return self._submit(lambda r: kv.Verify(r, _items(items), wait_event))

    def submit_events_poll(self, since: int) -> int:
        """Ask for the KV event batches of this engine's layout numbered ``since`` and later."""
        return self._submit(lambda r: events.KVEventsPoll(r, since))

    def submit_pull(self, peer: str, keys: Sequence[bytes], max_chunks: int = 0, release_lease: int = 0) -> int:
        """Ask the daemon to pull ``keys``' entries from the peer daemon at ``peer`` (HOST:PORT) into its
        pool; the completion's result carries ``hit_chunks`` and a ``lease_id`` for the Retrieve."""
        return self._submit(lambda r: peer_wire.Pull(r, peer, list(keys), max_chunks, release_lease))

    def submit_watch(self, lease_id: int) -> int:
        """LeaseWritten once every rank's retrieve under ``lease_id`` wrote its blocks; Error once the lease ended
        otherwise. Only to a daemon whose RegisterAck says ``lease_watch``."""
        return self._submit(lambda r: kv.WatchLease(r, lease_id))

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._conn.require()
            self._conn.send(kv.Release(lease_id))

    def pin(self, session: str, tenant: str, ttl_s: float, keys: Sequence[bytes],
            partial_keys: Sequence[bytes] = ()) -> None:
        """Hold ``keys``' entries (and ``partial_keys``': partial chunks, outside the prefix rule) for ``ttl_s``
        seconds as pin ``session`` of ``tenant`` (``kv.Pin``; no reply). Only to a daemon whose RegisterAck says
        ``pins``, and ``pin_partials`` for partial keys."""
        msg = kv.Pin(session, tenant, float(ttl_s), list(keys), list(partial_keys))
        msg.validate()  # a bad pin is the caller's bug: raised here, never a connection the daemon drops
        with self._lock:
            self._conn.require()
            self._conn.send(msg)

    def hints(self, tenant: str, keys: Sequence[bytes], actions: Sequence[tuple[str, float, str]],
              counted: Mapping[str, int]) -> None:
        """A request's KV hints about its chunks ``keys`` (``kv.Hints``: (action, ttl_s, session) each, and the
        outcomes counted by the shim; no reply). Only to a daemon whose RegisterAck says ``hints``."""
        msg = kv.Hints(tenant, list(keys), [a for a, _, _ in actions], [float(t) for _, t, _ in actions],
                       [s for _, _, s in actions], dict(counted))
        msg.validate()  # a bad message is the caller's bug: raised here, never a connection the daemon drops
        with self._lock:
            self._conn.require()
            self._conn.send(msg)

    def uncacheable(self, reason: str) -> None:
        """Tell the daemon a request was not cached because it could not be keyed (counted by reason)."""
        with self._lock:
            self._conn.require()
            self._conn.send(kv.Uncacheable(reason))

    def abort(self, req_id: int) -> None:
        """Ask the daemon to drop job ``req_id``; its completion (its reply or Error) still arrives."""
        with self._lock:
            self._conn.require()
            self._conn.send(kv.Abort(req_id))

    # ---- completions ---------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Return the completions that arrived (waiting up to ``timeout_s`` for the first)."""
        with self._lock:
            if not self._done and self._conn.is_open:
                self._conn.read(timeout_s, self._on_message)
            out = list(self._done.values())
            self._done.clear()
            return out

    def wait(self, req_ids: Iterable[int], timeout_s: float) -> dict[int, Completion]:
        """Block until every request in ``req_ids`` completed; raise KVTimeout after ``timeout_s``."""
        want = set(req_ids)
        got: dict[int, Completion] = {}
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                for rid in list(want):
                    if rid in self._done:
                        got[rid] = self._done.pop(rid)
                        want.discard(rid)
                if not want:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    for rid, c in got.items():  # keep what arrived for a later poll
                        self._done[rid] = c
                    raise KVTimeout(f"no reply from hkvd within {timeout_s:.1f} s for requests {sorted(want)}")
                if not self._conn.is_open:
                    for rid in want:  # already failed by _fail_outstanding, or never sent
                        got[rid] = Completion(rid, False, None, DaemonUnavailable("not connected to hkvd"))
                    return got
                self._conn.read(left, self._on_message)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    # ---- internals -----------------------------------------------------------------------------
    def _submit(self, make: Callable[[int], Message]) -> int:
        with self._lock:
            self._conn.require()
            req_id = next(self._ids)
            msg = make(req_id)
            self._outstanding[req_id] = type(msg)
            self._conn.send(msg)
            return req_id

    def _complete(self, req_id: int, result: Result | None, error: KVError | None = None) -> None:
        if self._outstanding.pop(req_id, None) is not None:
            self._done[req_id] = Completion(req_id, error is None, result, error)

    def _reply(self, msg: Message) -> None:
        req_id: int = msg.req_id  # type: ignore[attr-defined]  # every reply message has one (REPLIES)
        request = self._outstanding.get(req_id)
        if request is None:  # not ours (or already failed): nothing to complete
            return
        if REPLIES.get(request) is type(msg):
            self._complete(req_id, msg)  # the reply message is the result (hkvd.shim.results)
        else:
            self._complete(req_id, None, ProtocolViolation(
                f"hkvd answered a {request.__name__} with a {type(msg).__name__}; run hkvd serve and the shim "
                "from the same hkvd version"))

    def _on_message(self, msg: Message) -> None:
        match msg:
            case _ if type(msg) in _REPLY_TYPES:
                self._reply(msg)
            case kv.Error() if msg.req_id in self._outstanding:
                self._complete(msg.req_id, None, error_from_wire(msg.code, msg.message))
            case kv.Error():
                # Not tied to a request of ours: a connection-level fault. Fail everything.
                self._conn.lost(f"hkvd reported: {error_from_wire(msg.code, msg.message)}")
            case kv.AbortAck():
                pass
            case _:
                pass

    def _fail_outstanding(self, why: str) -> None:
        for rid in list(self._outstanding):
            self._complete(rid, None, DaemonUnavailable(f"hkvd connection lost ({why})"))


def _items(items: Sequence[Item | Sequence[Any]]) -> list[Item]:
    return [it if isinstance(it, Item) else Item(*it) for it in items]


def _notes(notes: Sequence[BlockNote] | None) -> list[list[object]] | None:
    return [n.to_wire() for n in notes] if notes else None


