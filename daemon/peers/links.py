"""Peer links: the daemon's side of disaggregated prefill/decode pairs.

Role
    Composes the pieces and is the one thing ``daemon/app.py`` and ``daemon/engines/service.py`` know:
    - a ``DataTransport`` (NIXL/UCX) with the whole pool registered, so peers READ entries straight
      out of it and pulls land straight in it. By default ``hkvd.transport.nixl.hosted``: the NIXL agent
      runs in a supervised child process that maps the pool's memfd, because UCX crashed the daemon
      with SIGSEGV when a peer's UCX address was unreachable from here (tests/peer/test_netns.py).
      A crash there fails the READs in flight (engines recompute), is logged with the peers linked
      at the time and counted (``peer_transport_crashes``), and the host restarts with a new agent
      whose metadata the server hands to peers from then on. ``HKVD_TRANSPORT_HOST=0`` runs
      ``hkvd.transport.nixl.agent`` in the daemon instead (comparisons only);
    - ``PeerServer`` (``--peer-listen``): hands leased entries of this pool to authenticated peers;
    - ``PeerClient``: pulls entries from a peer into this pool when an engine sends ``Pull``;
    - ``LayoutBook`` (``daemon/peers/layout_book.py``): the layouts of engines seen here, by fingerprint.
    Peers are on when ``--peer-listen`` or a peer token is configured (``peers_wanted``).
    A pull answers the engine connection that asked through ``ReplySink`` (one method and two
    counters), so this package never imports ``daemon/engines/service.py``: the service holds the
    ``PeerService`` it is given at construction, and nothing points back.

Threading
    Event loop only; the transport runs its own thread or process. Pulls and the transport's
    supervisor run as tasks of this service's TaskGroup (``run``), so a pull never holds up the
    engine connection that asked for it.

Lifecycle
    ``start`` (transport up, pool registered, listener bound) -> ``run`` (in the daemon's root
    TaskGroup) -> ``aclose`` before the pool is unmapped: the transport may write into the pool
    until it has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Protocol

from hkvd.daemon.cache import Cache, HugePagePool
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.registry import EngineState, Registry
from hkvd.daemon.integrity.checksums import Checksums
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.peers.auth import TOKEN_ENV, PeerConfigError, parse_allow, read_token
from hkvd.daemon.peers.layout_book import LayoutBook
from hkvd.daemon.peers.pulling import PeerClient, PullStats
from hkvd.daemon.peers.serving import PeerServer, ServingStats
from hkvd.transport.base import DataTransport, TransportStats
from hkvd.transport.errors import InternalError, KVError, NotRegistered, ShuttingDown
from hkvd.transport.nixl.agent import NixlTransport, load_nixl
from hkvd.transport.nixl.hosted import HostCrash, HostedTransport, HostMemory, host_enabled
from hkvd.transport.stat_fields import part, status_only
from hkvd.transport.wire import Message, kv
from hkvd.transport.wire.peer import Pull

log = logging.getLogger("hkvd.peers")

TRANSPORT_START_S = 60.0


class ReplySink(Protocol):
    """The engine connection a pull answers (the service's ``Conn`` is one). Event loop only.

    ``send`` queues one reply and never blocks; ``inflight`` counts the connection's running copies
    and pulls (shutdown drains it to 0: the pull adds 1 while it runs); ``conn_id`` owns the leases
    taken for the pull.
    """

    conn_id: int
    inflight: int

    def send(self, msg: Message) -> None: ...


def peers_wanted(cfg: DaemonConfig) -> bool:

    return bool(cfg.peer_listen or cfg.peer_token or cfg.peer_token_file or os.environ.get(TOKEN_ENV))


def check_peer_config(cfg: DaemonConfig) -> bytes:
    """Start-up checks with the fix in the message (``PeerConfigError``); returns the token."""
    token = read_token(cfg.peer_token, cfg.peer_token_file)
    if not token:
        raise PeerConfigError("--peer-listen needs a shared peer token: write one with `openssl rand -hex 32 > "
                              "/etc/hkvd/peer.token; chmod 600 /etc/hkvd/peer.token` and pass --peer-token-file "
                              "(the same file on every daemon of the pair)")
    parse_allow(cfg.peer_allow)

    try:
        load_nixl()
    except KVError as e:
        raise PeerConfigError(e.message) from None
    return token


@dataclass(frozen=True, slots=True)
class PeerStats:
    """Peer links (``hkvd status``: ``peer``): where this daemon serves, what it pulls, its transport. Pulls,
    lookups and bytes are ``peer_*`` counters."""

    listen: str = status_only()  # --peer-listen ("": pulling only)
    advertise: str = status_only()
    agent: str = status_only()  # the transport's agent name
    allow: tuple[str, ...] = status_only()  # --peer-allow networks
    transport: TransportStats | None = part()
    transport_kind: str | None = status_only()
    read_gbps: float = status_only()
    pulling: PullStats = part(flatten=True)  # quarantined_entries, links
    serving: ServingStats | None = part()


class PeerService:
    def __init__(self, cfg: DaemonConfig, pool: HugePagePool, index: Cache, registry: Registry,
                 metrics: Metrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.token = check_peer_config(cfg)
        self.allow = parse_allow(cfg.peer_allow)
        self.layouts = LayoutBook(registry)
        self.node = socket.gethostname()
        self.base_agent = f"hkvd-{self.node}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.transport: DataTransport | None = None
        self.server: PeerServer | None = None  # with --peer-listen, once started
        self.client: PeerClient | None = None  # once started
        # The pool's checksums (set by the owner before ``start``): pulled entries are checked against
        # the serving daemon's. None: not checked.
        self.checks: Checksums | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._stop = asyncio.Event()
        self._closed = False

    @property
    def agent_name(self) -> str:
        """The transport's agent now (a restarted transport host has a new one)."""
        return self.transport.agent_name if self.transport is not None else self.base_agent

    @property
    def advertise(self) -> str:
        return self.cfg.peer_advertise or self.cfg.peer_listen

    async def start(self) -> None:

        transport: DataTransport
        if host_enabled():
            transport = HostedTransport(self.base_agent, HostMemory(self.pool.fd, self.pool.base_addr, self.pool.size),
                                        on_restart=self._on_transport_restart, on_crash=self._on_transport_crash)
        else:
            log.warning("HKVD_TRANSPORT_HOST=0: NIXL runs inside the daemon; a UCX crash with one peer ends it")
            transport = NixlTransport(self.base_agent)
        self.transport = transport
        await transport.start(TRANSPORT_START_S)
        await transport.register(self.pool.base_addr, self.pool.size)
        metadata = await transport.metadata()
        log.info("peer transport: NIXL agent %s (%s), %d MiB pool registered", self.agent_name, transport.name,
                 self.pool.size >> 20)
        self.client = PeerClient(self.cfg, self.token, self.node, self.index, self.pool, transport, self.metrics)
        self.client.checks = self.checks
        if self.cfg.peer_listen:
            self.server = PeerServer(self.cfg, self.token, self.allow, self.node, self.index, self.pool,
                                     self.layouts, self.agent_name, metadata, self.metrics)
            await self.server.start()
            log.info("serving peers on %s (allowed: %s)", self.cfg.peer_listen,
                     ", ".join(str(n) for n in self.allow))

    async def _on_transport_restart(self, metadata: bytes) -> None:
        """A new transport host is up: peers that connect from now on get its agent and metadata."""
        if self.server is not None:
            self.server.agent = self.agent_name
            self.server.agent_metadata = metadata

    def _on_transport_crash(self, crash: HostCrash) -> None:
        """Name the peers involved: the crash is most likely due to one of them (its UCX address)."""
        self.metrics.inc("peer_transport_crashes")
        links = {link.peer_name: link.address for link in self.client._links.values()} if self.client else {}
        reading = [f"{links.get(p, p)}" for p in crash.peers_in_flight]
        serving = self.server.statistics().sessions if self.server is not None else ()
        log.error("peer transport crash (%s): READs in flight from %s; peer daemons linked to this one: %s. A peer "
                  "whose UCX address this node cannot reach is the usual cause: check UCX_NET_DEVICES on both "
                  "nodes (the interface that routes to the other) and the UCX error above",
                  crash.how, ", ".join(reading) or "none",
                  ", ".join(f"{s.address} ({s.node}, {s.lookups} lookups)" for s in serving) or "none")

    async def run(self) -> None:
        """Owns the pull tasks and the transport's supervisor; returns when ``aclose`` is called (or
        is cancelled with the daemon)."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            if self.transport is not None:
                tg.create_task(self.transport.supervise())
            try:
                await self._stop.wait()
            finally:
                self._tg = None

    def submit_pull(self, engine: EngineState | None, msg: Pull, conn: ReplySink) -> None:
        """Start a pull for ``engine`` (``conn``'s); the reply (PullResult or Error) goes to ``conn`` when it ends."""
        if engine is None:
            raise NotRegistered("register the engine (Register) before a Pull: the pull needs its layout")
        if self._tg is None or self.client is None:

            raise ShuttingDown("peer links are stopping; the engine recomputes")
        conn.inflight += 1
        try:
            self._tg.create_task(self._pull(conn, self.client, engine, msg))
        except RuntimeError:  # the TaskGroup is closing: the daemon is shutting down
            conn.inflight -= 1

            raise ShuttingDown("peer links are stopping; the engine recomputes") from None

    async def _pull(self, conn: ReplySink, client: PeerClient, engine: EngineState, msg: Pull) -> None:

        try:
            result = await client.pull(engine, msg, owner=conn.conn_id)
        except KVError as e:
            self.metrics.inc("peer_pulls", outcome="error")
            self.metrics.inc("errors", code=e.code.name)
            log.info("pull %d from %s failed: %s", msg.req_id, msg.peer, e.message)
            conn.send(kv.Error(msg.req_id, int(e.code), e.message))
        except Exception as e:  # a bug: answer the engine, keep the daemon up
            log.exception("internal error in pull %d from %s", msg.req_id, msg.peer)
            self.metrics.inc("internal_errors")
            conn.send(kv.Error(msg.req_id, int(InternalError.code), f"internal error: {e!r}"))
        else:
            self.metrics.inc("peer_pulls", outcome="ok")
            conn.send(result)
        finally:
            conn.inflight -= 1

    def statistics(self) -> PeerStats:
        return PeerStats(
            listen=self.cfg.peer_listen, advertise=self.advertise, agent=self.agent_name,
            allow=tuple(str(n) for n in self.allow),
            transport=self.transport.statistics() if self.transport is not None else None,
            transport_kind=self.transport.name if self.transport is not None else None,
            read_gbps=self.metrics.rate("peer_read"),
            pulling=self.client.statistics() if self.client is not None else PullStats(0, ()),
            serving=self.server.statistics() if self.server is not None else None,
        )

    async def aclose(self) -> None:
        """Stop serving and pulling, then stop the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.aclose()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        if self.transport is not None:
            await self.transport.aclose()
