"""The serving end of peer links (``hkvd serve --peer-listen HOST:PORT``).

Role
    Accepts TCP connections from pulling daemons, refuses addresses outside ``--peer-allow``,
    runs the challenge handshake (``hkvd.transport.wire.peer``), then answers ``PeerLookup`` with
    the hybrid hit rule over this daemon's index, a lease on the entries of that hit, and their
    addresses in the registered pool; ``PeerRelease`` ends a lease early. It never moves bytes: the
    pulling daemon READs them with the transport.

Lifecycle of a connection
    accept -> allowlist -> handshake within ``peer_timeout_s`` -> requests until EOF -> close.
    Leases are not released when a connection ends: the pulling daemon may still be reading, so
    they expire on their own after ``lease_ttl_s`` (the puller never uses bytes read after that).

Errors
    A refused address, a wrong token proof and a layout this daemon does not serve each get one
    typed ``Error`` (PERMISSION, PERMISSION, REGISTRATION) and the connection is closed; nothing
    else is revealed. After the handshake, a bad request gets ``Error(req_id)`` and the link keeps
    serving, up to ``MAX_CONSECUTIVE_ERRORS`` in a row; a frame that cannot be decoded closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hkvd.daemon.errors import (
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
from hkvd.daemon.hybrid import plan_hit
from hkvd.daemon.peer_auth import IPNetwork, allowed, check_proof, client_proof, server_proof, split_address
from hkvd.transport.aio import FrameStream
from hkvd.transport.wire import Message, kv
from hkvd.transport.wire.peer import (
    NONCE_BYTES,
    PEER_VERSION,
    PeerAuth,
    PeerChallenge,
    PeerHello,
    PeerLookup,
    PeerLookupReply,
    PeerRelease,
    PeerWelcome,
    pack_table,
)

if TYPE_CHECKING:
    from hkvd.daemon.config import DaemonConfig
    from hkvd.daemon.index import Index
    from hkvd.daemon.metrics import Metrics
    from hkvd.daemon.peers import LayoutBook
    from hkvd.daemon.pool import HugePagePool

log = logging.getLogger("hkvd.peer_server")

MAX_CONSECUTIVE_ERRORS = 16
# How often a lookup that waits for its hit to grow re-plans: a Mamba state becomes visible when
# its engine confirms it, one or two engine steps (tens of ms) after it was copied.
WAIT_POLL_S = 0.02
# Lease owners of peer connections live below 0, away from the engine connections' ids (>= 1).
_OWNER_BASE = -(1 << 32)


class LayoutMismatch(RegistrationError):
    """The peers serve no layout in common (model, chunk size or KV format differ)."""


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


class PeerServer:
    def __init__(self, cfg: DaemonConfig, token: bytes, allow: tuple[IPNetwork, ...], node: str, index: Index,
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

    async def start(self) -> None:
        host, port = split_address(self.cfg.peer_listen, "--peer-listen")
        try:
            self._server = await asyncio.start_server(self._on_peer, host, port, reuse_address=True)
        except OSError as e:
            raise OSError(f"--peer-listen {self.cfg.peer_listen}: cannot listen ({e.strerror or e}); pick a free "
                          "port or an address of this host") from None

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for s in list(self._streams):
            await s.aclose()

    def describe(self) -> dict[str, Any]:
        return {"listen": self.cfg.peer_listen,
                "sessions": [{"address": s.address, "node": s.node, "lookups": s.lookups}
                             for s in self.sessions.values()]}

    # ---- connection ----------------------------------------------------------------------------
    async def _on_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = FrameStream(reader, writer, self.cfg.max_frame_bytes)
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        session = _Session(next(self._ids), address)
        self._streams.add(stream)
        timeout = self.cfg.peer_timeout_s
        try:
            if not allowed(address, self.allow):
                self.metrics.inc("peer_refused", why="address")
                log.warning("refused peer connection from %s: not in --peer-allow", address)
                # Take its first message before answering: closing on unread bytes would reset the
                # connection and lose the answer. Nothing in it is looked at.
                with contextlib.suppress(Exception):
                    await stream.recv(timeout)
                raise PermissionDenied(f"{address} may not connect to this hkvd; add it to the serving daemon's "
                                       "--peer-allow")
            await self._handshake(stream, session, timeout)
            self.sessions[session.conn_id] = session
            log.info("peer %s (%s) connected; layouts %s", address, session.node,
                     ", ".join(fp.hex()[:12] for fp in session.fingerprints))
            await self._serve(stream, session)
        except KVError as e:
            with contextlib.suppress(Exception):
                await stream.send(kv.Error(0, int(e.code), e.message), timeout)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.debug("peer %s: connection ended: %s", address, e)
        except Exception:  # a bug: log it, close this link, keep serving others
            log.exception("internal error on the peer link from %s", address)
            self.metrics.inc("internal_errors")
        finally:
            self.sessions.pop(session.conn_id, None)
            self._streams.discard(stream)
            await stream.aclose()

    async def _handshake(self, stream: FrameStream, session: _Session, budget_s: float) -> None:
        timeout = budget_s
        hello = await stream.recv(timeout)
        if not isinstance(hello, PeerHello):
            raise ProtocolViolation(f"a peer link starts with PeerHello, got {type(hello).__name__}")
        if hello.version != PEER_VERSION:
            raise UnsupportedVersion(f"the peer speaks peer protocol {hello.version}, this daemon "
                                     f"{PEER_VERSION}; run the same hkvd version on both nodes")
        session.node = hello.node
        nonce = os.urandom(NONCE_BYTES)
        await stream.send(PeerChallenge(PEER_VERSION, self.node, nonce, server_proof(self.token, hello.nonce, nonce)),
                          timeout)
        try:
            auth = await stream.recv(timeout)
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
        if not common:
            self.metrics.inc("peer_refused", why="layout")
            log.warning("refused peer %s (%s): no layout in common (theirs %s, ours %s)", session.address,
                        session.node, [fp.hex()[:12] for fp in auth.fingerprints], [fp.hex()[:12] for fp in mine])
            raise LayoutMismatch(
                "layout mismatch: the serving daemon has no engine with the layout "
                f"{', '.join(fp.hex()[:12] for fp in auth.fingerprints) or '(none)'} (it serves "
                f"{', '.join(fp.hex()[:12] for fp in mine) or 'none yet'}); prefill and decode must run the same "
                "model, chunk size, tensor-parallel size and rank, and KV format")
        session.fingerprints = set(common)
        await stream.send(PeerWelcome(self.agent, self.agent_metadata, common, self.cfg.lease_ttl_s), timeout)

    async def _serve(self, stream: FrameStream, session: _Session) -> None:
        errors = 0
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
                if bad is not None:
                    raise bad
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

        def present(group_id: int, chunk: int) -> bool:
            return self.index.is_ready((fp, group_id, keys[chunk]))

        deadline = time.monotonic() + min(msg.wait_s, self.cfg.peer_timeout_s / 2)
        while True:
            plan = plan_hit(layout.rules, len(keys), layout.chunk_size, present, max_chunks=want)
            if plan.hit_chunks >= want or time.monotonic() >= deadline:
                break
            await asyncio.sleep(WAIT_POLL_S)
        table: list[tuple[int, int, int, int]] = []
        extents: list[tuple[int, int]] = []
        lease_id = served = 0
        if plan.hit_chunks:
            needed = [(gid, c) for gid, chunks in sorted(plan.needed.items()) for c in chunks]
            lease_id = self.index.lease([(fp, gid, keys[c]) for gid, c in needed], session.owner,
                                        self.cfg.lease_ttl_s)
            base, get = self.pool.base_addr, self.index.get
            for gid, c in needed:
                e = get((fp, gid, keys[c]))
                assert e is not None  # present() saw it READY in this same loop tick
                ext = e.alloc.extents
                table.append((gid, c, e.nbytes, len(ext)))
                extents.extend([(base + off, n) for off, n in ext])
                served += e.nbytes
        if msg.release_lease and self.index.release(msg.release_lease):
            self.metrics.inc("peer_hold_leases_released")
        session.lookups += 1
        self.metrics.inc("peer_lookups")
        self.metrics.inc("peer_served_chunks", plan.hit_chunks)
        self.metrics.inc("peer_served_bytes", served)
        return PeerLookupReply(msg.req_id, plan.hit_chunks, lease_id, self.cfg.lease_ttl_s,
                               *pack_table(table, extents))
