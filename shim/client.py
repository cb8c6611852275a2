"""A small synchronous client for the daemon, for use inside vLLM. It never imports asyncio.

Threading model
    One client per connection; calls are serialised by an internal lock, so a background
    thread may poll while the engine thread submits. Submits never wait for the daemon: they
    write one frame and return its ``req_id``. Completions are collected by ``poll`` (non-blocking
    by default) or ``wait`` (bounded by ``timeout_s``). Every wait has a timeout.

Cost per round trip
    The socket is non-blocking after connect and timeouts are kept here, with one ``poll`` object
    per connection: a request and its reply take three system calls (send, poll, recv). A socket
    timeout would make CPython poll before every send and recv, and each call costs a few
    microseconds, more on a VM: at ~100 us round trips the client's share is what shows.

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
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from hkvd.shim.daemon_port import DaemonPort
from hkvd.shim.results import Completion, Result
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import (
    DaemonUnavailable,
    KVError,
    KVTimeout,
    ProtocolViolation,
    UnsupportedVersion,
    error_from_wire,
)
from hkvd.transport.wire import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, Message, control, events, kv
from hkvd.transport.wire import peer as peer_wire
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.kv import Item
from hkvd.transport.wire.replies import REPLIES

READ_BYTES = 1 << 16
_REPLY_TYPES = frozenset(REPLIES.values())
M = TypeVar("M", bound=Message)


class DaemonClient(DaemonPort):
    """The daemon over its Unix socket: ``DaemonPort``, plus connecting, registering and status."""

    def __init__(self, socket_path: str, *, client_name: str, role: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.client_name = client_name
        self.role = role
        self.timeout_s = timeout_s
        self.daemon_pid = 0
        self.server_id = ""
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME_BYTES)
        self._ids = itertools.count(1)
        self._outstanding: dict[int, type] = {}  # req_id -> the request's message type
        self._done: dict[int, Completion] = {}
        self._lock = threading.RLock()
        self._poller = select.poll()

    # ---- connection ----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        with self._lock:
            self.close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.socket_path)
            except OSError as e:
                sock.close()
                raise DaemonUnavailable(f"cannot reach hkvd at {self.socket_path}: {e.strerror or e}; is "
                                        "`hkvd serve` running with the same --socket?") from None
            sock.setblocking(False)  # timeouts are ours from here on (see the module docstring)
            self._sock = sock
            self._poller = select.poll()
            self._poller.register(sock, select.POLLIN)
            self._decoder = FrameDecoder(DEFAULT_MAX_FRAME_BYTES)
            # If the daemon refused us and closed already, its reason is still in the socket.
            with contextlib.suppress(OSError):
                self._send_bytes(encode(control.Hello(PROTOCOL_VERSION, self.client_name, self.role)))
            ack = self._wait_message(control.HelloAck, self.timeout_s)
            if ack.version != PROTOCOL_VERSION:  # a daemon refuses a client of another version before its ack
                self._lost("protocol version mismatch")
                raise UnsupportedVersion(f"hkvd at {self.socket_path} speaks protocol {ack.version}, this shim "
                                         f"{PROTOCOL_VERSION}; run the shim and hkvd serve from the same hkvd "
                                         "version")
            self.daemon_pid = ack.daemon_pid
            self.server_id = ack.server_id

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None
            self._fail_outstanding("connection closed")

    def __enter__(self) -> DaemonClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- blocking control calls (registration time, tools) -------------------------------------
    def register(self, spec: EngineSpec) -> control.RegisterAck:
        req = self._submit(lambda r: control.Register(r, spec.to_wire()))
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
                      tails: Sequence[tuple[int, bytes]] = (), ends: bool = False) -> int:
        """``tails``: (chunk index, key) of partial chunks that may end the hit, longest first; only to a
        daemon whose RegisterAck says ``lookup_tails``. ``ends``: ask for the turn ends the daemon knows
        (``LookupReply.ends``); only to a daemon whose RegisterAck says ``turn_ends``."""
        return self._submit(lambda r: kv.Lookup(r, list(keys), lease, [[j, k] for j, k in tails], ends))

    def submit_store(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"",
                     notes: Sequence[BlockNote] | None = None, tenant: str = "", turn_end: int = 0) -> int:
        """``wait_event``: IPC handle of the step-end CUDA event to order the copy after (GPU KV only).
        ``notes``: vLLM's names of the chunks, for KV events; only to a daemon whose RegisterAck takes them.
        ``tenant``: the storing request's tenant (``hkvd.shim.tenants``); only to a daemon whose RegisterAck
        says ``pins``. ``turn_end``: the items are a turn-end state ending this far into its chunk; only to a
        daemon whose RegisterAck says ``turn_ends``."""
        return self._submit(lambda r: kv.Store(r, _items(items), wait_event, _notes(notes), tenant, turn_end))

    def submit_retrieve(self, items: Sequence[Item | Sequence[Any]], lease_id: int = 0) -> int:
        return self._submit(lambda r: kv.Retrieve(r, lease_id, _items(items)))

    def submit_step_event(self, seq: int, step: int, offers: Sequence[Item | Sequence[Any]],
                          confirms: Iterable[int] = (), wait_event: bytes = b"",
                          notes: Sequence[BlockNote] | None = None,
                          verifies: Sequence[Item | Sequence[Any]] = (), tenants: Sequence[str] = ()) -> int:
        """``verifies``: boundary states a sampled hit recomputed, compared once confirmed (never stored).
        ``tenants``: each offer's tenant, or none (only to a daemon whose RegisterAck says ``step_tenants``)."""
        return self._submit(lambda r: events.StepEvent(r, seq, step, _items(offers), list(confirms), wait_event,
                                                       _notes(notes), _items(verifies), list(tenants)))

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
            self._require()
            self._send(kv.Release(lease_id))

    def pin(self, session: str, tenant: str, ttl_s: float, keys: Sequence[bytes],
            partial_keys: Sequence[bytes] = ()) -> None:
        """Hold ``keys``' entries (and ``partial_keys``': partial chunks, outside the prefix rule) for ``ttl_s``
        seconds as pin ``session`` of ``tenant`` (``kv.Pin``; no reply). Only to a daemon whose RegisterAck says
        ``pins``, and ``pin_partials`` for partial keys."""
        msg = kv.Pin(session, tenant, float(ttl_s), list(keys), list(partial_keys))
        msg.validate()  # a bad pin is the caller's bug: raised here, never a connection the daemon drops
        with self._lock:
            self._require()
            self._send(msg)

    def uncacheable(self, reason: str) -> None:
        """Tell the daemon a request was not cached because it could not be keyed (counted by reason)."""
        with self._lock:
            self._require()
            self._send(kv.Uncacheable(reason))

    def abort(self, req_id: int) -> None:
        """Ask the daemon to drop job ``req_id``; its completion (its reply or Error) still arrives."""
        with self._lock:
            self._require()
            self._send(kv.Abort(req_id))

    # ---- completions ---------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Return the completions that arrived (waiting up to ``timeout_s`` for the first)."""
        with self._lock:
            if not self._done and self._sock is not None:
                self._read(timeout_s)
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
                if self._sock is None:
                    for rid in want:  # already failed by _fail_outstanding, or never sent
                        got[rid] = Completion(rid, False, None, DaemonUnavailable("not connected to hkvd"))
                    return got
                self._read(left)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    # ---- internals -----------------------------------------------------------------------------
    def _require(self) -> None:
        if self._sock is None:
            raise DaemonUnavailable(f"not connected to hkvd at {self.socket_path}")

    def _submit(self, make: Callable[[int], Message]) -> int:
        with self._lock:
            self._require()
            req_id = next(self._ids)
            msg = make(req_id)
            self._outstanding[req_id] = type(msg)
            self._send(msg)
            return req_id

    def _send(self, msg: Message) -> None:
        try:
            self._send_bytes(encode(msg))
        except OSError as e:
            self._lost(f"send failed: {e}")
            raise DaemonUnavailable(f"lost the connection to hkvd: {e}") from None

    def _send_bytes(self, data: bytes) -> None:
        """Write all of ``data`` on the non-blocking socket; fail once the daemon has taken none of it for
        ``timeout_s`` (a daemon that keeps reading a large frame, however slowly, is not cut off)."""
        sock = self._sock
        assert sock is not None
        view = memoryview(data)
        deadline = 0.0  # set when the socket is full, cleared by any progress
        while view:
            try:
                view = view[sock.send(view):]
                deadline = 0.0
                continue
            except BlockingIOError:
                pass
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            writable = select.poll()  # never select(): vLLM's descriptors may number past 1023
            writable.register(sock, select.POLLOUT)
            if now >= deadline or not writable.poll((deadline - now) * 1000.0):
                raise TimeoutError(f"hkvd read none of our bytes for {self.timeout_s:.1f} s")

    def _read(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for bytes, then take every byte there is and dispatch its frames."""
        sock = self._sock
        assert sock is not None
        try:
            if not self._poller.poll(max(timeout_s, 0.0) * 1000.0):
                return
            while True:
                try:
                    data = sock.recv(READ_BYTES)
                except BlockingIOError:
                    return
                if not data:
                    self._lost("the daemon closed the connection")
                    return
                for body in self._decoder.feed(data):
                    self._on_message(decode_body(body))
                if self._sock is None:  # a connection-level Error made _on_message drop the link
                    return
                if len(data) < READ_BYTES:
                    return  # the socket had no more: the next recv would only fail
        except (OSError, KVError) as e:
            self._lost(f"read failed: {e}")

    def _wait_message(self, cls: type[M], timeout_s: float) -> M:
        assert self._sock is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._lost("handshake timed out")
                raise DaemonUnavailable(f"hkvd at {self.socket_path} did not answer Hello within {timeout_s} s")
            if not self._poller.poll(left * 1000.0):
                continue
            try:
                data = self._sock.recv(READ_BYTES)
            except OSError as e:
                self._lost(str(e))
                raise DaemonUnavailable(f"hkvd closed the connection during the handshake: {e}") from None
            if not data:
                self._lost("closed during handshake")
                raise DaemonUnavailable("hkvd closed the connection during the handshake")
            for body in self._decoder.feed(data):
                msg = decode_body(body)
                if isinstance(msg, kv.Error):
                    err = error_from_wire(msg.code, msg.message)
                    self._lost(err.message)
                    raise err
                if isinstance(msg, cls):
                    return msg
                raise ProtocolViolation(f"expected {cls.__name__}, got {type(msg).__name__}")

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
                self._lost(f"hkvd reported: {error_from_wire(msg.code, msg.message)}")
            case kv.AbortAck():
                pass
            case _:
                pass

    def _lost(self, why: str) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
        self._fail_outstanding(why)

    def _fail_outstanding(self, why: str) -> None:
        for rid in list(self._outstanding):
            self._complete(rid, None, DaemonUnavailable(f"hkvd connection lost ({why})"))


def _items(items: Sequence[Item | Sequence[Any]]) -> list[Item]:
    return [it if isinstance(it, Item) else Item(*it) for it in items]


def _notes(notes: Sequence[BlockNote] | None) -> list[list[object]] | None:
    return [n.to_wire() for n in notes] if notes else None


