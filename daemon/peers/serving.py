"""The serving end of peer links (``hkvd serve --peer-listen HOST:PORT``).

Role
    Accepts TCP connections from pulling daemons, refuses addresses outside ``--peer-allow`` and
    connections past the caps, runs the challenge handshake (``hkvd.transport.wire.peer``), then
    answers ``PeerLookup`` with the hybrid hit rule over this daemon's index, a lease on the
    entries of that hit, and their addresses in the registered pool; ``PeerRelease`` ends a lease
    early. It never moves bytes: the pulling daemon READs them with the transport.

Lifecycle of a connection
    accept -> admission -> handshake within ``peer_timeout_s`` -> requests until EOF -> close.
    Leases are not released when a connection ends: the pulling daemon may still be reading, so
    they expire on their own after ``lease_ttl_s`` (the puller never uses bytes read after that).

Resources (what a stranger can make this daemon hold)
    - Admission (``PeerGate``) runs in the protocol's ``connection_made``, before the transport
      reads a byte: an address outside ``--peer-allow``, or one past
      ``--peer-max-connections-per-address`` or ``--peer-max-connections``, is told why in one
      ``Error`` and closed unread (after ``REFUSAL_LINGER_S``, so the Error is not lost to a
      reset). Open and lingering peer sockets stay within ``1 / FD_SHARE`` of the open-file
      limit, so peers never take the descriptors engines need to reach the control socket.
    - Before authentication a frame may hold ``PREAUTH_MAX_FRAME_BYTES`` (checked on the length
      prefix, before the body is buffered) and the whole handshake gets one ``peer_timeout_s``;
      after it, ``REQUEST_MAX_FRAME_BYTES`` (the largest ``PeerLookup``), not ``--max-frame-bytes``.
      The stream reader pauses the socket past ``2 * READ_LIMIT_BYTES``. A connection thus parks at
      most ~0.3 MiB before it authenticates, ~1.5 MiB after.
    - Refusals are counted (``peer_refused{why}``) and logged once per reason, then summarised at
      most every ``REFUSAL_LOG_EVERY_S``: a flood of connections is not a flood of log lines.

Errors
    A refused address, a connection past a cap, a wrong token proof and a layout this daemon does
    not serve each get one typed ``Error`` (PERMISSION, BUSY, PERMISSION, REGISTRATION) and the
    connection is closed; nothing else is revealed. After the handshake, a bad request gets
    ``Error(req_id)`` and the link keeps serving, up to ``MAX_CONSECUTIVE_ERRORS`` in a row; a frame
    that cannot be decoded closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from hkvd.daemon.peers.auth import (
    GateStats,
    IPNetwork,
    PeerGate,
    Refusal,
    check_proof,
    client_proof,
    server_proof,
    split_address,
)
from hkvd.transport.aio import FrameStream
from hkvd.transport.codec import encode
from hkvd.transport.errors import (
    FrameTooLarge,
    InternalError,
    KVError,
    KVTimeout,
    OutOfRange,
    PermissionDenied,
    ProtocolViolation,
    RegistrationError,
    UnsupportedVersion,
)
from hkvd.transport.stat_fields import part, status_only
from hkvd.transport.wire import KEY_BYTES, MAX_KEYS, Message, kv
from hkvd.transport.wire.peer import (
    MAX_FINGERPRINTS,
    NONCE_BYTES,
    PEER_VERSION,
    PeerAuth,
    PeerChallenge,
    PeerHello,
    PeerLookup,
    PeerLookupReply,
    PeerRelease,
    PeerWelcome,
    pack_checksums,
    pack_table,
)

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache, HugePagePool
    from hkvd.daemon.config import DaemonConfig
    from hkvd.daemon.metrics import Metrics
    from hkvd.daemon.peers.layout_book import LayoutBook

log = logging.getLogger("hkvd.peer_server")

MAX_CONSECUTIVE_ERRORS = 16
# How often a lookup that waits for its hit to grow re-plans: a Mamba state becomes visible when
# its engine confirms it, one or two engine steps (tens of ms) after it was copied.
WAIT_POLL_S = 0.02
# Lease owners of peer connections live below 0, away from the engine connections' ids (>= 1).
_OWNER_BASE = -(1 << 32)
# Before authentication a frame is a PeerHello or a PeerAuth: 1.2 KiB at most encoded (a node name of
# 256 four-byte characters; 64 fingerprints). A longer announced length is refused from its prefix.
PREAUTH_MAX_FRAME_BYTES = 4 << 10
# After it, the largest request is a PeerLookup of MAX_KEYS keys, each KEY_BYTES plus a 2-byte msgpack
# header: 1.13 MiB, with 4 KiB for its other fields (PeerRelease is tiny).
REQUEST_MAX_FRAME_BYTES = MAX_KEYS * (KEY_BYTES + 2) + (4 << 10)
# asyncio's StreamReader stops reading the socket once it holds twice this (its default is 64 KiB).
READ_LIMIT_BYTES = 16 << 10
# Peer sockets may use at most 1 / FD_SHARE of the open-file limit: the rest is for engines, the
# pool, the disk tier and NIXL/UCX (an idle serving daemon holds ~32 descriptors).
FD_SHARE = 4
# A refused connection is held open this long, unread and with its write side shut, so that its peer
# reads the Error before the close resets the connection (a peer's Hello sits unread in the socket).
REFUSAL_LINGER_S = 1.0
# At most this many refused connections linger at once (and never over 1/8 of the peer descriptors);
# past it a refusal closes at once and its Error may be lost to the reset.
MAX_LINGERING = 32
REFUSAL_LOG_EVERY_S = 60.0
# The last Error before a close: the socket buffer takes it at once unless the peer stopped reading.
FAREWELL_S = 1.0


class LayoutMismatch(RegistrationError):
    """The peers serve no layout in common (model, chunk size or KV format differ)."""


class FdCaps(NamedTuple):
    connections: int  # open peer connections
    lingering: int  # refused connections held open for their Error


def fd_caps(configured: int, soft_limit: int) -> FdCaps:
    """``--peer-max-connections`` and the lingering refusals, together within ``1 / FD_SHARE`` of the
    open-file limit ``soft_limit`` (``RLIM_INFINITY``: no limit)."""
    if soft_limit == resource.RLIM_INFINITY:
        return FdCaps(configured, MAX_LINGERING)
    budget = max(2, soft_limit // FD_SHARE)
    lingering = max(1, min(MAX_LINGERING, budget // 8))
    return FdCaps(max(1, min(configured, budget - lingering)), lingering)


class _GatedProtocol(asyncio.StreamReaderProtocol):
    """A stream protocol that admits or refuses its connection in ``connection_made``.

    The event loop (asyncio or uvloop) starts reading the socket only after ``connection_made``,
    and not at all once the transport is aborted there: a refused connection's socket is taken out
    of the loop (``PeerServer._refuse``) with nothing read from it. An admitted one is released from
    the gate in ``connection_lost``, which the loop calls exactly once, whatever happens to the
    handler task.
    """

    def __init__(self, server: PeerServer) -> None:
        super().__init__(asyncio.StreamReader(limit=READ_LIMIT_BYTES), server._on_peer)
        self._peer_server = server
        self._admitted: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = _address(transport.get_extra_info("peername"))
        refusal = self._peer_server._admit(address)
        if refusal is not None:
            self._peer_server._refuse(transport, refusal)
            return
        self._admitted = address
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted is not None:
            self._peer_server.gate.release(self._admitted)
            self._admitted = None
        super().connection_lost(exc)


def _address(peer: object) -> str:
    return str(peer[0]) if isinstance(peer, tuple) else str(peer)


@dataclass(slots=True)
class _Session:
    conn_id: int
    address: str
    node: str = ""
    fingerprints: set[bytes] = field(default_factory=set)
    lookups: int = 0

    @property
    def owner(self) -> int:
        return _OWNER_BASE - self.conn_id


@dataclass(frozen=True, slots=True)
class SessionStats:
    """One peer daemon this one serves (``hkvd status``: an item of ``peer.serving.sessions``)."""

    address: str = status_only()
    node: str = status_only()
    lookups: int = status_only()


@dataclass(frozen=True, slots=True)
class ServingStats:
    """The serving side of peer links (``hkvd status``: ``peer.serving``)."""

    listen: str = status_only()  # --peer-listen
    connections: GateStats = part()
    lingering_refusals: int = status_only()  # refused sockets waiting to close (REFUSAL_LINGER_S)
    sessions: tuple[SessionStats, ...] = status_only()


class PeerServer:
    def __init__(self, cfg: DaemonConfig, token: bytes, allow: tuple[IPNetwork, ...], node: str, index: Cache,
                 pool: HugePagePool, layouts: LayoutBook, agent: str, agent_metadata: bytes,
                 metrics: Metrics) -> None:
        self.cfg = cfg
        self.token = token
        self.allow = allow
        self.node = node
        self.index = index
        self.pool = pool
        self.layouts = layouts
        self.agent = agent
        self.agent_metadata = agent_metadata
        self.metrics = metrics
        self._server: asyncio.Server | None = None
        self._ids = itertools.count(1)
        self.sessions: dict[int, _Session] = {}
        self._streams: set[FrameStream] = set()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.fd_caps = fd_caps(cfg.peer_max_connections, soft)
        self.gate = PeerGate(allow, self.fd_caps.connections, cfg.peer_max_connections_per_address)
        self._lingering: set[socket.socket] = set()
        self._refusals_logged: dict[str, float] = {}  # why -> when last logged
        self._refusals_unlogged: dict[str, int] = {}

    async def start(self) -> None:
        host, port = split_address(self.cfg.peer_listen, "--peer-listen")
        if self.fd_caps.connections < self.cfg.peer_max_connections:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning("serving at most %d peer connections, not --peer-max-connections %d: peers may use a "
                        "quarter of the open-file limit (%d); raise it (LimitNOFILE=, ulimit -n) to serve more",
                        self.fd_caps.connections, self.cfg.peer_max_connections, soft)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _GatedProtocol(self), host, port, reuse_address=True)
        except OSError as e:
            raise OSError(f"--peer-listen {self.cfg.peer_listen}: cannot listen ({e.strerror or e}); pick a free "
                          "port or an address of this host") from None

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for sock in list(self._lingering):
            self._hang_up(sock)
        for s in list(self._streams):
            await s.aclose()

    def statistics(self) -> ServingStats:
        return ServingStats(listen=self.cfg.peer_listen, connections=self.gate.statistics(),
                            lingering_refusals=len(self._lingering),
                            sessions=tuple(SessionStats(address=s.address, node=s.node, lookups=s.lookups)
                                           for s in self.sessions.values()))

    # ---- admission -----------------------------------------------------------------------------
    def _admit(self, address: str) -> Refusal | None:
        """The gate's verdict on a new connection; a refusal is counted and (rate-limited) logged."""
        refusal = self.gate.admit(address)
        if refusal is not None:
            self.metrics.inc("peer_refused", why=refusal.why)
            self._log_refusal(refusal, address)
        return refusal

    def _refuse(self, transport: asyncio.BaseTransport, refusal: Refusal) -> None:
        """Tell a refused connection why and hang up, never reading from it.

        The socket leaves the event loop before the loop reads from it: a duplicate of its
        descriptor outlives the transport's ``close()`` (nothing was written to it, so it closes at
        once and never starts reading), gets the ``Error`` and a FIN, and is closed after
        ``REFUSAL_LINGER_S`` (at once past ``fd_caps.lingering`` such sockets).
        """
        try:
            sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
        except OSError:  # out of descriptors: hang up without a word
            transport.close()
            return
        transport.close()
        try:  # non-blocking (the flag is shared with the loop's descriptor); a fresh buffer takes ~200 bytes
            sock.send(encode(kv.Error(0, int(refusal.error.code), refusal.error.message)))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        if len(self._lingering) >= self.fd_caps.lingering:
            sock.close()
            return
        self._lingering.add(sock)
        asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, self._hang_up, sock)

    def _hang_up(self, sock: socket.socket) -> None:
        self._lingering.discard(sock)
        sock.close()

    def _log_refusal(self, refusal: Refusal, address: str) -> None:
        now = time.monotonic()
        last = self._refusals_logged.get(refusal.why)
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            self._refusals_unlogged[refusal.why] = self._refusals_unlogged.get(refusal.why, 0) + 1
            return
        self._refusals_logged[refusal.why] = now
        more = self._refusals_unlogged.pop(refusal.why, 0)
        log.warning("refused a peer connection from %s: %s%s", address, refusal.error.message,
                    f" ({more} more refused for this reason since the last report)" if more else "")

    # ---- connection ----------------------------------------------------------------------------
    async def _on_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FrameStream(reader, writer, PREAUTH_MAX_FRAME_BYTES)
        address = _address(writer.get_extra_info("peername"))
        session = _Session(next(self._ids), address)
        self._streams.add(stream)
        try:
            await self._authenticate(stream, session)
            stream.set_max_frame_bytes(min(self.cfg.max_frame_bytes, REQUEST_MAX_FRAME_BYTES))
            self.sessions[session.conn_id] = session
            log.info("peer %s (%s) connected; layouts %s", address, session.node,
                     ", ".join(fp.hex()[:12] for fp in session.fingerprints))
            await self._serve(stream, session)
        except KVError as e:
            with contextlib.suppress(Exception):
                await stream.send(kv.Error(0, int(e.code), e.message), FAREWELL_S)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.debug("peer %s: connection ended: %s", address, e)
        except Exception:  # a bug: log it, close this link, keep serving others
            log.exception("internal error on the peer link from %s", address)
            self.metrics.inc("internal_errors")
        finally:
            self.sessions.pop(session.conn_id, None)
            self._streams.discard(stream)
            await stream.aclose()

    async def _authenticate(self, stream: FrameStream, session: _Session) -> None:
        """The handshake, within one ``peer_timeout_s`` in all (a peer that trickles bytes gains nothing)."""
        budget_s = self.cfg.peer_timeout_s
        try:
            async with asyncio.timeout(budget_s):
                await self._handshake(stream, session, budget_s)
        except TimeoutError:
            self.metrics.inc("peer_refused", why="timeout")
            raise KVTimeout(f"the peer handshake did not complete within {budget_s:.1f} s "
                            "(--peer-timeout-s)") from None
        except KVTimeout:
            self.metrics.inc("peer_refused", why="timeout")
            raise
        except FrameTooLarge:
            self.metrics.inc("peer_refused", why="frame")
            raise

    async def _handshake(self, stream: FrameStream, session: _Session, budget_s: float) -> None:
        hello = await stream.recv(budget_s)
        if not isinstance(hello, PeerHello):
            raise ProtocolViolation(f"a peer link starts with PeerHello, got {type(hello).__name__}")
        if hello.version != PEER_VERSION:
            raise UnsupportedVersion(f"the peer speaks peer protocol {hello.version}, this daemon "
                                     f"{PEER_VERSION}; run the same hkvd version on both nodes")
        session.node = hello.node
        nonce = os.urandom(NONCE_BYTES)
        await stream.send(PeerChallenge(PEER_VERSION, self.node, nonce, server_proof(self.token, hello.nonce, nonce)),
                          budget_s)
        try:
            auth = await stream.recv(budget_s)
        except (ConnectionError, asyncio.IncompleteReadError):
            # The client checks our proof first and hangs up when its token differs: say so here too.
            self.metrics.inc("peer_refused", why="token")
            log.warning("peer %s (%s) hung up after our challenge: most likely its peer token differs from ours; "
                        "give both daemons the same --peer-token-file", session.address, session.node)
            raise
        if not isinstance(auth, PeerAuth):
            raise ProtocolViolation(f"expected PeerAuth, got {type(auth).__name__}")
        if not check_proof(client_proof(self.token, hello.nonce, nonce), auth.proof):
            self.metrics.inc("peer_refused", why="token")
            log.warning("refused peer %s (%s): wrong peer token", session.address, session.node)
            raise PermissionDenied("peer authentication failed: the daemons have different peer tokens; give both "
                                   "the same --peer-token-file")
        mine = self.layouts.fingerprints()
        common = [fp for fp in auth.fingerprints if fp in mine]
        # Other TP sizes of the pulling engines' models: the puller decides what it can read re-sharded.
        others = self.layouts.other_worlds(auth.model_keys, auth.fingerprints) if auth.model_keys else []
        offered = [w.fingerprints[r] for w in others for r in sorted(w.ranks)]
        if not common and not offered:
            self.metrics.inc("peer_refused", why="layout")
            log.warning("refused peer %s (%s): no layout in common (theirs %s, ours %s)", session.address,
                        session.node, [fp.hex()[:12] for fp in auth.fingerprints], [fp.hex()[:12] for fp in mine])
            raise LayoutMismatch(
                "layout mismatch: the serving daemon has no engine with the layout "
                f"{', '.join(fp.hex()[:12] for fp in auth.fingerprints) or '(none)'} (it serves "
                f"{', '.join(fp.hex()[:12] for fp in mine) or 'none yet'}); prefill and decode must run the same "
                "model, chunk size, tensor-parallel size and rank, and KV format (another TP size of the model is "
                "pulled re-sharded only when both engines' shims send a model identity; docs/peers.md)")
        agreed = [*common, *offered][:MAX_FINGERPRINTS]
        session.fingerprints = set(agreed)
        worlds = [w.spec.to_wire() for w in others if w.spec is not None]
        await stream.send(PeerWelcome(self.agent, self.agent_metadata, agreed, self.cfg.lease_ttl_s, worlds),
                          budget_s)

    async def _serve(self, stream: FrameStream, session: _Session) -> None:
        errors = 0
        bad: KVError | None
        while True:
            try:
                msg = await stream.recv(3600.0)  # idle links stay open; each request is bounded below
            except KVTimeout:
                continue
            except FrameTooLarge:
                raise  # a bad length: the stream cannot be resynchronised
            except KVError as e:  # a bad body inside a good frame: answer it, keep serving
                msg, bad = None, e
            else:
                bad = None
            req_id = getattr(msg, "req_id", 0)
            try:
                if bad is not None or msg is None:
                    raise bad or ProtocolViolation("no message")
                reply = await self._handle(session, msg)
            except KVError as e:
                errors += 1
                self.metrics.inc("errors", code=e.code.name)
                await stream.send(kv.Error(req_id, int(e.code), e.message), self.cfg.peer_timeout_s)
                if errors >= MAX_CONSECUTIVE_ERRORS:
                    log.warning("closing the peer link from %s: %d bad requests in a row", session.address, errors)
                    return
                continue
            except Exception as e:
                log.exception("internal error handling %s from peer %s", type(msg).__name__, session.address)
                self.metrics.inc("internal_errors")
                await stream.send(kv.Error(req_id, int(InternalError.code), f"internal error: {e!r}"),
                                  self.cfg.peer_timeout_s)
                continue
            errors = 0
            if reply is not None:
                await stream.send(reply, self.cfg.peer_timeout_s)

    async def _handle(self, session: _Session, msg: Message) -> Message | None:
        match msg:
            case PeerLookup():
                return await self._lookup(session, msg)
            case PeerRelease():  # only a lease this link's own lookups took
                if not self.index.release(msg.lease_id, owner=session.owner):
                    self.metrics.inc("peer_release_refused")
                return None
            case _:
                raise ProtocolViolation(f"{type(msg).__name__} is not a request a peer may send")

    # ---- lookup + lease ------------------------------------------------------------------------
    async def _lookup(self, session: _Session, msg: PeerLookup) -> PeerLookupReply:
        fp = msg.fingerprint
        if fp not in session.fingerprints:
            raise OutOfRange(f"layout {fp.hex()[:12]} was not agreed in this link's handshake; open a new link")
        layout = self.layouts.get(fp)
        if layout is None:
            raise OutOfRange(f"layout {fp.hex()[:12]} is no longer known here")
        keys = msg.keys
        want = min(msg.max_chunks or len(keys), len(keys))

        deadline = time.monotonic() + min(msg.wait_s, self.cfg.peer_timeout_s / 2)
        while True:
            plan = self.index.plan_lookup(layout, keys, (fp,), max_chunks=want)
            if plan.hit_chunks >= want or time.monotonic() >= deadline:
                break
            await asyncio.sleep(WAIT_POLL_S)
        table: list[tuple[int, int, int, int]] = []
        extents: list[tuple[int, int]] = []
        sums: list[int] = []
        lease_id = served = 0
        if plan.hit_chunks:
            needed = [(gid, c) for gid, chunks in sorted(plan.needed.items()) for c in chunks]
            lease_id = self.index.lease(plan, session.owner, self.cfg.lease_ttl_s)
            base, get = self.pool.base_addr, self.index.get
            for gid, c in needed:
                e = get((fp, gid, keys[c]))
                assert e is not None  # present() saw it READY in this same loop tick
                ext = e.alloc.extents
                table.append((gid, c, e.nbytes, len(ext)))
                sums.append(e.checksum)
                extents.extend([(base + off, n) for off, n in ext])
                served += e.nbytes
        if msg.release_lease and self.index.release(msg.release_lease):
            self.metrics.inc("peer_hold_leases_released")
        session.lookups += 1
        self.metrics.inc("peer_lookups")
        self.metrics.inc("peer_served_chunks", plan.hit_chunks)
        self.metrics.inc("peer_served_bytes", served)
        checks = pack_checksums(sums) if msg.checksums and any(sums) else b""  # never to an older puller
        return PeerLookupReply(msg.req_id, plan.hit_chunks, lease_id, self.cfg.lease_ttl_s,
                               *pack_table(table, extents), checks)
