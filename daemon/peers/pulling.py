"""The pulling end of peer links: an engine's ``Pull`` -> entries READ from a peer into our pool.

Role
    For ``Pull(req_id, peer, keys, max_chunks, release_lease)`` from an engine registered here:
    connect (or reuse a link) to the serving daemon, prove the token, agree on the engine's layout,
    ``PeerLookup`` + lease, allocate local entries (``Cache.begin_store``), READ the leased pages
    straight into them with the transport (in two batches: the first quarter's READ starts as soon
    as its entries are allocated, so allocating the rest overlaps the copy), check sizes,
    publish them all once every READ completed (``complete_store``: READY),
    release the remote lease, and answer with the hit the engine can now ``Retrieve`` locally (and
    a local lease on it).

Correctness rules
    - Nothing pulled is visible before all its READs completed whole; a failed, timed-out or partial
      pull abandons every entry it allocated and answers ``Error``: the engine recomputes.
    - The serving daemon's lease protects the pages being read. It lasts ``lease_ttl_s`` from the
      moment it was granted, which is after our request was sent, so a READ must complete within
      ``LEASE_USE_FRACTION`` of the TTL counted from the send; bytes that arrive later are discarded.
    - The transport cannot cancel a READ in flight (``hkvd.transport.nixl.agent``). When we stop
      waiting (timeout, cancellation) the destination entries stay allocated, WRITING and invisible
      ("quarantined") until the transport reports the READ over; only then are they freed.
    - The peer's reply is checked against the engine's own layout: exactly the entries the hybrid
      hit rule needs for the reported hit, each of the engine's entry size.
    - A READ the transport failed (not a timeout) closes every link to that agent and unloads it:
      the peer's transport host may have restarted with new metadata, or ours may have. A pull on a
      link that had served before tries once more on a fresh link (``peer_pull_retries``).
    - A READ still running ``ABANDONED_READ_RESET_TIMEOUTS`` pull timeouts after it was abandoned
      (a peer UCX cannot route to stalls it until the serving agent goes away) resets the
      transport, which settles it, so its quarantined pages come back (``peer_transport_resets``).

Threading
    Event loop only. One control request at a time per link (a lock); READs of many pulls overlap.

Timeouts
    Connect, handshake and each control request: ``peer_timeout_s``; the whole pull:
    ``peer_pull_timeout_s`` (and the lease bound above).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import NamedTuple, TypeVar, overload

from hkvd.daemon.cache import Cache, Entry, HugePagePool, LookupPlan
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.registry import EngineState
from hkvd.daemon.integrity.checksums import Checksums, checksum
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.peers.auth import PeerConfigError, check_proof, client_proof, server_proof, split_address
from hkvd.daemon.peers.layout_book import Layout
from hkvd.daemon.peers.tp_pulls import Source, TpPulls
from hkvd.transport.aio import FrameStream
from hkvd.transport.base import DataTransport, Desc, Transfer
from hkvd.transport.errors import (
    CopyFailedError,
    DaemonUnavailable,
    FrameTooLarge,
    InternalError,
    KVError,
    KVTimeout,
    OutOfRange,
    PermissionDenied,
    PoolFull,
    ProtocolViolation,
    UnsupportedVersion,
    error_from_wire,
)
from hkvd.transport.stat_fields import status_only
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
    Pull,
    PullResult,
    RemoteEntry,
)

M = TypeVar("M", bound=Message)

log = logging.getLogger("hkvd.peer_client")

LEASE_USE_FRACTION = 0.8
# How long the serving daemon may wait for its hit to reach what we ask (Mamba states turn visible
# when their engine confirms them, one or two steps after the copy).
LOOKUP_WAIT_S = 1.0
SETTLE_POLL_S = 0.02
# An abandoned READ still running this many pull timeouts after it was abandoned resets the transport.
ABANDONED_READ_RESET_TIMEOUTS = 2
# A pull READs its entries in two batches: the first quarter of the bytes (at least 2 MiB) starts as
# soon as it is allocated, and the rest is allocated while it runs. Allocating an entry costs 10-30 us
# and READing 512 KiB over shared memory 100+ us, so the rest is ready before the first READ ends.
# More, smaller batches were slower: while the event loop allocates, the transport's thread waits up
# to the GIL switch interval (5 ms) to post each next READ.
FIRST_BATCH_SHARE = 4
FIRST_BATCH_MIN_BYTES = 2 << 20
# A pull across TP sizes looks its source ranks up again while their hits differ (each round can only shorten
# the hit); past this many rounds the answer is what every needed rank holds here.
ACROSS_ROUNDS = 3


class ReadResult(NamedTuple):
    nbytes: int
    pulled: int  # entries written
    seconds: float  # the READ alone
    descs: int


class PeerLink:
    """One authenticated control connection to a serving daemon, for one layout."""

    def __init__(self, address: str, fingerprint: bytes, stream: FrameStream, welcome: PeerWelcome,
                 peer_name: str, generation: int = 0) -> None:
        self.address = address
        self.fingerprint = fingerprint
        self.stream = stream
        self.welcome = welcome
        self.peer_name = peer_name  # the transport's name for the serving daemon
        self.generation = generation  # of our transport when peer_name was loaded (DataTransport.generation)
        self.lock = asyncio.Lock()
        self.broken = False
        self.requests = 0
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    @overload
    async def call(self, msg: Message, reply_type: type[M], timeout_s: float) -> M: ...

    @overload
    async def call(self, msg: Message, reply_type: None, timeout_s: float) -> None: ...

    async def call(self, msg: Message, reply_type: type[M] | None, timeout_s: float) -> M | None:
        """Send ``msg``; return its reply (``None`` for one-way messages). A link that timed out,
        broke, or answered out of order is closed: its replies can no longer be matched."""
        async with self.lock:
            if self.broken:
                raise DaemonUnavailable(f"the peer link to {self.address} is closed")
            self.requests += 1
            try:
                await self.stream.send(msg, timeout_s)
                if reply_type is None:
                    return None
                reply = await self.stream.recv(timeout_s)
            except (ConnectionError, OSError) as e:
                await self._break()
                raise DaemonUnavailable(f"lost the peer link to {self.address}: {e}") from None
            except (KVTimeout, FrameTooLarge, ProtocolViolation):
                await self._break()
                raise
            req_id = getattr(msg, "req_id", 0)
            if isinstance(reply, kv.Error):
                if reply.req_id != req_id:
                    await self._break()
                raise error_from_wire(reply.code, reply.message)
            if not isinstance(reply, reply_type) or getattr(reply, "req_id", None) != req_id:
                await self._break()
                raise ProtocolViolation(f"peer {self.address} answered {type(reply).__name__} to "
                                        f"{type(msg).__name__} {req_id}")
            return reply

    async def _break(self) -> None:
        self.broken = True
        await self.stream.aclose()


def pair_extents(remote: list[tuple[int, int]], local: list[tuple[int, int]]) -> list[Desc]:
    """Map an entry's bytes, laid out over ``remote`` extents, onto ``local`` extents (both in entry
    order, same total), merging pieces contiguous on both sides."""
    out: list[Desc] = []
    ri = li = 0
    r_addr, r_left = remote[0]
    l_addr, l_left = local[0]
    while True:
        n = min(r_left, l_left)
        if out and out[-1].remote_addr + out[-1].nbytes == r_addr and out[-1].local_addr + out[-1].nbytes == l_addr:
            last = out[-1]
            out[-1] = Desc(last.remote_addr, last.local_addr, last.nbytes + n)
        else:
            out.append(Desc(r_addr, l_addr, n))
        r_addr += n
        l_addr += n
        r_left -= n
        l_left -= n
        if r_left == 0:
            ri += 1
            if ri == len(remote):
                break
            r_addr, r_left = remote[ri]
        if l_left == 0:
            li += 1
            l_addr, l_left = local[li]
    if li != len(local) - 1 or l_left:
        raise ValueError("remote and local extents hold different byte counts")
    return out


def merge(descs: list[Desc]) -> list[Desc]:
    out: list[Desc] = []
    for d in descs:
        if out and out[-1].remote_addr + out[-1].nbytes == d.remote_addr and \
                out[-1].local_addr + out[-1].nbytes == d.local_addr:
            last = out[-1]
            out[-1] = Desc(last.remote_addr, last.local_addr, last.nbytes + d.nbytes)
        else:
            out.append(d)
    return out


def begin_entries(index: Cache, base: int, fp: bytes, kinds: dict[int, str], keys: list[bytes],
                  part: list[RemoteEntry], job_id: int) -> tuple[list[Entry], list[Desc]]:
    """Begin local entries for ``part`` (an engine's, of layout ``fp``, group kinds ``kinds``, chunk
    keys ``keys``) in one ``Cache.begin_store`` and pair their extents (at pool address ``base``)
    with the peer's (the caller merges pieces contiguous on both sides: ``merge``).

    Entries present here already (READY, or written by another job: ``_settle`` waits for those)
    are skipped. No room for one of them: every entry begun here is given back and the
    ``PoolFull`` raised.
    """
    got = index.begin_store(
        [((fp, e.group_id, keys[e.chunk_index]), e.nbytes, kinds[e.group_id],
          keys[e.chunk_index - 1] if e.chunk_index else b"") for e in part], job_id)
    begun = [le for le in got if isinstance(le, Entry)]
    descs: list[Desc] = []
    try:
        for e, le in zip(part, got, strict=True):
            if isinstance(le, PoolFull):
                raise le
            if le is None:
                continue
            local, remote = le.alloc.extents, e.extents
            if len(local) == 1 and len(remote) == 1 and local[0][1] == remote[0][1]:
                descs.append(Desc(remote[0][0], base + local[0][0], local[0][1]))  # one extent each side
            else:
                descs.extend(pair_extents(remote, [(base + off, n) for off, n in local]))
    except BaseException:
        index.abandon_store(begun)
        raise
    return begun, descs


@dataclasses.dataclass(frozen=True, slots=True)
class LinkStats:
    """One link to a serving daemon (``hkvd status``: an item of ``peer.links``)."""

    address: str = status_only()
    layout: str = status_only()  # the first 12 hex digits of the layout fingerprint
    up: bool = status_only()
    requests: int = status_only()


@dataclasses.dataclass(frozen=True, slots=True)
class PullStats:
    """The pulling side (``hkvd status``: ``peer.quarantined_entries`` and ``peer.links``)."""

    quarantined_entries: int = status_only()  # entries waiting for an abandoned READ to settle
    links: tuple[LinkStats, ...] = status_only()


class PeerClient:
    def __init__(self, cfg: DaemonConfig, token: bytes, node: str, index: Cache, pool: HugePagePool,
                 transport: DataTransport, metrics: Metrics) -> None:
        self.cfg = cfg
        self.token = token
        self.node = node
        self.index = index
        self.pool = pool
        self.transport = transport
        self.metrics = metrics
        self._links: dict[tuple[str, bytes], PeerLink] = {}
        self._connecting: dict[tuple[str, bytes], asyncio.Lock] = {}
        self._agents: dict[str, str] = {}  # serving daemon's agent name -> transport peer name
        self._generation = transport.generation  # of the transport the names in _agents were loaded into
        self.quarantined = 0  # entries waiting for an abandoned READ to settle
        self.checks: Checksums | None = None  # pulled entries checked against the peer's checksums (PeerService)
        self.tp = TpPulls(index.formats, cfg.tp_reshard)  # pulls from worlds of other TP sizes

    # ---- links ---------------------------------------------------------------------------------
    async def _link(self, address: str, fingerprint: bytes, model_key: bytes = b"") -> PeerLink:
        key = (address, fingerprint)
        if self._generation != self.transport.generation:
            # Our transport restarted: the peers loaded into the old one are gone with it.
            self._generation = self.transport.generation
            self._agents.clear()
        link = self._links.get(key)
        if link is not None and not link.broken and link.generation == self._generation:
            return link
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            link = self._links.get(key)
            if link is not None and not link.broken and link.generation != self._generation:
                await link._break()
            if link is None or link.broken:
                link = await self._connect(address, fingerprint, model_key)
                self._links[key] = link
            return link

    async def _connect(self, address: str, fingerprint: bytes, model_key: bytes = b"") -> PeerLink:

        try:
            host, port = split_address(address)
        except PeerConfigError as e:
            raise ProtocolViolation(str(e)) from None
        timeout = self.cfg.peer_timeout_s
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as e:
            self.metrics.inc("peer_connect_errors")
            raise DaemonUnavailable(f"cannot reach the peer hkvd at {address} ({e or 'timed out'}); is it running "
                                    f"with --peer-listen {address}?") from None
        stream = FrameStream(reader, writer, self.cfg.max_frame_bytes)
        try:
            nonce = os.urandom(NONCE_BYTES)
            await stream.send(PeerHello(PEER_VERSION, self.node, nonce), timeout)
            challenge = await self._expect(stream, PeerChallenge, timeout)
            if challenge.version != PEER_VERSION:
                raise UnsupportedVersion(f"the peer at {address} speaks peer protocol {challenge.version}, this "
                                         f"daemon {PEER_VERSION}; run the same hkvd version on both nodes")
            if not check_proof(server_proof(self.token, nonce, challenge.nonce), challenge.proof):
                self.metrics.inc("peer_refused", why="server_token")
                raise PermissionDenied(f"the peer at {address} does not know our peer token (different "
                                       "--peer-token-file?); not pulling from it")
            await stream.send(PeerAuth(client_proof(self.token, nonce, challenge.nonce), [fingerprint],
                                       [model_key] if model_key else []), timeout)
            welcome = await self._expect(stream, PeerWelcome, timeout)
            if fingerprint not in welcome.fingerprints and not welcome.worlds:
                raise ProtocolViolation(f"the peer at {address} welcomed us without our layout")
            if welcome.agent == self.transport.agent_name:
                # NIXL cannot load its own agent as a peer (NIXL_ERR_INVALID_PARAM, once an INTERNAL error).
                raise OutOfRange(f"the peer at {address} is this hkvd itself: a daemon does not pull from itself "
                                 "(what it holds, Lookup and Retrieve serve); point the pull at the prefill node's "
                                 "daemon (its --peer-advertise address)")
            peer_name = self._agents.get(welcome.agent)
            if peer_name is None:
                peer_name = await self.transport.add_peer(welcome.agent_metadata)
                self._agents[welcome.agent] = peer_name
        except (ConnectionError, OSError) as e:
            await stream.aclose()
            raise DaemonUnavailable(f"the peer at {address} closed the link during the handshake: {e}") from None
        except BaseException:
            await stream.aclose()
            raise
        log.info("peer link to %s (%s) up; layout %s", address, challenge.node, fingerprint.hex()[:12])
        return PeerLink(address, fingerprint, stream, welcome, peer_name, self.transport.generation)

    async def _forget(self, link: PeerLink, why: str) -> None:
        """A READ over ``link`` failed in the transport: the serving daemon's agent may have restarted
        (new metadata) or ours may have. Close every link to that agent and unload it, so the next
        pull handshakes again and loads whatever metadata the peer has now."""
        agent = link.welcome.agent
        for other in list(self._links.values()):
            if other.welcome.agent == agent and not other.broken:
                await other._break()
        if self._agents.get(agent) == link.peer_name:
            del self._agents[agent]
            with contextlib.suppress(KVError):
                await self.transport.remove_peer(link.peer_name)
        log.info("READ from %s failed (%s); the link reconnects on the next pull", link.address, why)

    @staticmethod
    async def _expect(stream: FrameStream, cls: type[M], budget_s: float) -> M:
        msg = await stream.recv(budget_s)
        if isinstance(msg, kv.Error):
            raise error_from_wire(msg.code, msg.message)
        if not isinstance(msg, cls):
            raise ProtocolViolation(f"expected {cls.__name__} from the peer, got {type(msg).__name__}")
        return msg

    def statistics(self) -> PullStats:
        return PullStats(quarantined_entries=self.quarantined, links=tuple(
            LinkStats(address=link.address, layout=link.fingerprint.hex()[:12], up=not link.broken,
                      requests=link.requests) for link in self._links.values()))

    async def aclose(self) -> None:
        for link in list(self._links.values()):
            link.broken = True
            await link.stream.aclose()
        self._links.clear()

    # ---- pull ----------------------------------------------------------------------------------
    async def pull(self, engine: EngineState, msg: Pull, owner: int) -> PullResult:
        started = time.monotonic()
        deadline = started + self.cfg.peer_pull_timeout_s
        keys = msg.keys
        want = min(msg.max_chunks or len(keys), len(keys))
        fp = engine.fingerprint
        local = self._plan_local(engine, keys, want)
        if local.hit_chunks >= want:  # nothing to move
            return self._answer(msg, engine, local, owner, nbytes=0, pulled=0, started=started)
        model_key = engine.model_key if self.tp.wanted(engine) else b""
        if model_key:
            across = self.tp.local(self.index, engine, keys, want)  # another TP size's entries, pulled before
            if across is not None and across.hit_chunks >= want:
                return self._answer(msg, engine, across, owner, nbytes=0, pulled=0, started=started)
            link = await self._link(msg.peer, fp, model_key)
            if fp not in link.welcome.fingerprints:  # the peer holds this model at other TP sizes only
                return await self._pull_across(engine, msg, link, want, owner, started, deadline)
        own = self._own_layout(engine)
        for attempt in (0, 1):
            reply, link, sent_at = await self._lookup(msg, fp, keys[:want], want, deadline, model_key)
            reused = link.requests > 1
            looked_up = time.monotonic()
            try:
                read = await self._read_leased(own, keys, want, reply, link, msg.req_id, sent_at, deadline)
            except (CopyFailedError, InternalError) as e:  # the transport failed, not the control link
                await self._forget(link, e.message)
                # A link that served before: the peer's transport may have restarted since (new agent,
                # new metadata). One fresh handshake and lookup, as for a link the peer closed.
                if attempt == 0 and reused and time.monotonic() < deadline:
                    self.metrics.inc("peer_pull_retries")
                    continue
                raise
            break
        plan = await self._settle(engine, keys, (fp,), reply.hit_chunks, deadline)
        out = self._answer(msg, engine, plan, owner, nbytes=read.nbytes, pulled=read.pulled, started=started)
        return dataclasses.replace(out, lookup_s=round(looked_up - started, 6), read_s=round(read.seconds, 6),
                                   descs=read.descs)

    async def _pull_across(self, engine: EngineState, msg: Pull, link: PeerLink, want: int, owner: int,
                           started: float, deadline: float) -> PullResult:
        """Pull, from a peer that holds ``engine``'s model at other TP sizes only, the entries of the source ranks
        that hold this rank's KV heads (daemon/peers/tp_pulls.py), under the source world's fingerprints; the
        answer's lease covers them for this rank's one retrieve, which re-shards them
        (daemon/engines/reshards.py). A world this engine cannot read is a miss (hit 0).

        Each source rank is looked up and READ in turn. The hit is what every needed rank holds: when one
        rank's hit is shorter, the ranks READ for a longer hit are looked up again for the shorter one (a
        window's entries end at the hit), at most ``ACROSS_ROUNDS`` rounds; what is here then is the answer."""
        keys = msg.keys
        src = self.tp.choose(engine, link.welcome.specs(), link.address)
        if src is None or not set(src.fingerprints) <= set(link.welcome.fingerprints):
            self.metrics.inc("tp_reshards", op="pull_refused")
            if src is not None:
                log.info("pull %d from %s: the peer no longer serves every rank of the TP=%d world this rank needs "
                         "(a miss)", msg.req_id, link.address, len(src.world.fingerprints))
            return self._answer(msg, engine, self._plan_local(engine, keys, 0), owner, nbytes=0, pulled=0,
                                started=started)
        hit, got = want, dict[int, int]()
        nbytes = pulled = descs = 0
        read_s = 0.0
        release = msg.release_lease
        for _ in range(ACROSS_ROUNDS):
            for rank, lay in zip(src.ranks, src.layouts, strict=True):
                if hit == 0:
                    break
                if got.get(rank) == hit:
                    continue
                reply, sent_at = await self._lookup_on(link, lay.fingerprint, keys[:hit], hit, deadline, release)
                release = 0  # the producer's hold lease goes with the first lookup
                try:
                    read = await self._read_leased(lay, keys, hit, reply, link, msg.req_id, sent_at, deadline)
                except (CopyFailedError, InternalError) as e:  # the transport failed: the next pull links afresh
                    await self._forget(link, e.message)
                    raise
                got[rank] = reply.hit_chunks
                hit = min(hit, reply.hit_chunks)
                nbytes, pulled, descs, read_s = (nbytes + read.nbytes, pulled + read.pulled, descs + read.descs,
                                                 read_s + read.seconds)
            if hit == 0 or all(got.get(r) == hit for r in src.ranks):
                break
        plan = await self._settle_across(engine, keys, src, hit, deadline)
        self.metrics.inc("tp_reshards", op="pull")
        out = self._answer(msg, engine, plan, owner, nbytes=nbytes, pulled=pulled, started=started)
        return dataclasses.replace(out, read_s=round(read_s, 6), descs=descs)

    async def _lookup_on(self, link: PeerLink, fp: bytes, keys: list[bytes], want: int, deadline: float,
                         release: int) -> tuple[PeerLookupReply, float]:
        """One PeerLookup of layout ``fp`` on ``link`` (no retry on another link: see ``_lookup``)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KVTimeout(f"pull from {link.address}: no time left for the lookup "
                            f"(--peer-pull-timeout-s {self.cfg.peer_pull_timeout_s:g})")
        wait_s = min(LOOKUP_WAIT_S, remaining / 4)
        sent_at = time.monotonic()
        reply: PeerLookupReply = await link.call(
            PeerLookup(link.next_id(), fp, keys, want, wait_s, release, checksums=True), PeerLookupReply,
            min(remaining, self.cfg.peer_timeout_s + wait_s))
        return reply, sent_at

    async def _settle_across(self, engine: EngineState, keys: list[bytes], src: Source, hit: int,
                             deadline: float) -> LookupPlan:
        """``_settle`` for the source ranks' entries (another rank of this world may be pulling some of them)."""
        await self._settle(engine, keys, src.fingerprints, hit, deadline)
        return self.tp.plan(self.index, engine, keys, src, hit)

    async def _read_leased(self, lay: Layout, keys: list[bytes], want: int, reply: PeerLookupReply,
                           link: PeerLink, job_id: int, sent_at: float, deadline: float) -> ReadResult:
        """``_read`` within the serving lease, which is released (when there is one) afterwards."""
        # The serving lease started after our request left: bound every use of it from the send.
        lease_deadline = sent_at + reply.lease_ttl_s * LEASE_USE_FRACTION
        try:
            return await self._read(lay, keys, want, reply, link, job_id, min(deadline, lease_deadline),
                                    lease_deadline)
        finally:
            if reply.lease_id and not link.broken:
                with contextlib.suppress(KVError):
                    await link.call(PeerRelease(link.next_id(), reply.lease_id), None, self.cfg.peer_timeout_s)

    async def _lookup(self, msg: Pull, fp: bytes, keys: list[bytes], want: int,
                      deadline: float, model_key: bytes = b"") -> tuple[PeerLookupReply, PeerLink, float]:
        """One PeerLookup of layout ``fp`` at ``msg.peer``; an idle link the peer closed (a restart?) gets one
        fresh try."""
        for attempt in (0, 1):
            link = await self._link(msg.peer, fp, model_key)
            reused = link.requests > 0
            try:
                reply, sent_at = await self._lookup_on(link, fp, keys, want, deadline, msg.release_lease)
            except DaemonUnavailable:
                if attempt == 0 and reused:
                    continue
                raise
            return reply, link, sent_at
        raise AssertionError("unreachable")

    async def _read(self, lay: Layout, keys: list[bytes], want: int, reply: PeerLookupReply,
                    link: PeerLink, job_id: int, deadline: float, lease_deadline: float) -> ReadResult:
        """Allocate the entries (of layout ``lay``) the peer leased to us and READ them in two batches (see
        FIRST_BATCH_SHARE): allocating the second overlaps the first's copy. Entries are published
        only when every READ completed whole."""
        hit = reply.hit_chunks
        if hit > want:
            raise ProtocolViolation(f"peer {link.address} reported a hit of {hit} chunks for {want} asked")
        entries = reply.entries()  # checked when the frame was decoded (PeerLookupReply.validate)
        self._check_entries(lay, hit, entries, link.address)
        if time.monotonic() >= deadline:
            raise KVTimeout("no time left for the READ (the pull or the serving lease ran out)")
        reads: list[tuple[Transfer, list[Entry]]] = []
        limit = max(sum(e.nbytes for e in entries) // FIRST_BATCH_SHARE, FIRST_BATCH_MIN_BYTES)
        cut, acc = len(entries), 0
        for i, e in enumerate(entries):
            acc += e.nbytes
            if acc >= limit:
                cut = i + 1
                break
        try:
            for part in (entries[:cut], entries[cut:]):  # the rest is allocated while the first is READ
                begun, descs = begin_entries(self.index, self.pool.base_addr, lay.fingerprint, lay.kinds, keys,
                                             part, job_id)
                if begun:
                    reads.append((self.transport.read(link.peer_name, merge(descs)), begun))
        except BaseException as e:
            self._discard(reads, repr(e))
            raise
        if not reads:
            return ReadResult(0, 0, 0.0, 0)
        try:
            for transfer, begun in reads:
                budget = deadline - time.monotonic()
                if budget <= 0:
                    raise KVTimeout("no time left for the READ (the pull or the serving lease ran out)")
                moved = await transfer.wait(budget)
                if transfer.finished_at > lease_deadline:
                    raise KVTimeout(f"the READ from {link.address} finished after the serving daemon's lease "
                                    "could have expired; its bytes are discarded (raise --lease-ttl-s on the "
                                    "serving daemon)")
                expected = sum(le.nbytes for le in begun)
                if moved != expected:
                    raise CopyFailedError(f"READ from {link.address} moved {moved} bytes, expected {expected}")
        except BaseException as e:
            self._discard(reads, repr(e))
            raise
        await self._verify(lay.fingerprint, keys, entries, reply, reads)
        pulled = 0
        for _, begun in reads:
            self.index.complete_store(begun, pending=False)
            pulled += len(begun)
        nbytes = sum(t.nbytes for t, _ in reads)
        seconds = max(max(t.finished_at for t, _ in reads) - reads[0][0].started_at, 1e-9)
        self.metrics.inc("peer_pulled_bytes", nbytes)
        self.metrics.observe_rate("peer_read", nbytes, seconds)
        self.metrics.inc("peer_pulled_entries", pulled)
        return ReadResult(nbytes, pulled, seconds, sum(t.descs for t, _ in reads))

    async def _verify(self, fp: bytes, keys: list[bytes], entries: list[RemoteEntry], reply: PeerLookupReply,
                      reads: list[tuple[Transfer, list[Entry]]]) -> None:
        """Hash what the READs wrote (off the loop) against the serving daemon's checksums; an entry
        that differs is given back (never published: a miss) and counted, the others stay."""
        checks = self.checks
        if checks is None or not reply.entry_checksums:
            return
        want = {(fp, e.group_id, keys[e.chunk_index]): s for e, s in zip(entries, reply.checksums(), strict=True) if s}
        jobs = [(le, want[le.key]) for _, begun in reads for le in begun if le.key in want]
        if not jobs:
            return
        buffer = self.pool.buffer
        found = await asyncio.get_running_loop().run_in_executor(
            None, lambda: [checksum(buffer, le.alloc.extents) for le, _ in jobs])
        bad = {id(le) for (le, w), f in zip(jobs, found, strict=True) if f != w}
        for (le, w), f in zip(jobs, found, strict=True):
            if id(le) in bad:
                checks.note(le.key, "peer_pull", f, w)
                self.index.abandon_store([le])
            else:
                le.checksum = w  # verified: taken here, not hashed again once READY
        if not bad:
            return
        for i, (t, begun) in enumerate(reads):
            reads[i] = (t, [le for le in begun if id(le) not in bad])

    def _check_entries(self, lay: Layout, hit: int, entries: list[RemoteEntry], address: str) -> None:
        need = self.index.needs(lay, hit)
        got = [(e.group_id, e.chunk_index) for e in entries]
        if set(got) != need or len(got) != len(need):
            raise ProtocolViolation(f"peer {address} sent entries {sorted(got)[:8]}..., but a hit of {hit} chunks "
                                    f"needs {sorted(need)[:8]}... for this layout")
        for e in entries:
            if e.nbytes != lay.entry_bytes[e.group_id]:
                raise ProtocolViolation(f"peer {address}: group {e.group_id} entry of {e.nbytes} bytes, this layout's "
                                        f"entries are {lay.entry_bytes[e.group_id]} bytes")

    def _discard(self, reads: list[tuple[Transfer, list[Entry]]], why: str) -> None:
        """Free the destination entries of a pull's READs, each once the transport no longer writes
        into them: at once for the settled ones, when it settles for each still running."""
        running = []
        for t, begun in reads:
            if not t.settled.done():
                running.append((t, begun))
                continue
            self.index.abandon_store(begun)
        if not running:
            return
        entries = sum(len(begun) for _, begun in running)
        self.quarantined += entries
        self.metrics.inc("peer_reads_quarantined", len(running))
        log.warning("%d abandoned READs from %s are still running; %d entries (%d bytes) stay out of use until "
                    "they end", len(running), running[0][0].peer, entries, sum(t.nbytes for t, _ in running))

        def release(begun: list[Entry], f: asyncio.Future[int]) -> None:
            self.quarantined -= len(begun)
            self.index.abandon_store(begun)
            how = "failed" if f.cancelled() or f.exception() is not None else "completed late"
            log.info("an abandoned READ from %s %s; its %d entries are free again (contents discarded)",
                     running[0][0].peer, how, len(begun))

        for t, begun in running:
            t.abort(why)
            t.settled.add_done_callback(functools.partial(release, begun))
        # A READ over a path UCX cannot complete (a misrouted peer) stalled until the serving agent
        # went away: its pages would stay quarantined for good. Past the bound, reset the transport
        # (a hosted one kills its host process: every READ it ran then settles, failed, and nothing
        # can write into the pool any more); one that cannot reset keeps waiting.
        bound = self.cfg.peer_pull_timeout_s * ABANDONED_READ_RESET_TIMEOUTS
        asyncio.get_running_loop().call_later(bound, self._reset_if_stuck, [t for t, _ in running], bound)

    def _reset_if_stuck(self, transfers: list[Transfer], bound: float) -> None:
        stuck = [t for t in transfers if not t.settled.done()]
        if not stuck:
            return
        why = (f"{len(stuck)} abandoned READs from {stuck[0].peer} did not end within {bound:.0f} s "
               f"({ABANDONED_READ_RESET_TIMEOUTS}x --peer-pull-timeout-s)")
        if self.transport.reset(why):
            self.metrics.inc("peer_transport_resets")
            log.warning("%s: resetting the peer transport to free their pages (other READs in flight fail and "
                        "their engines recompute); check the UCX route between the nodes (UCX_NET_DEVICES)", why)

    # ---- local side ----------------------------------------------------------------------------
    def _plan_local(self, engine: EngineState, keys: list[bytes], n: int) -> LookupPlan:
        return self.index.plan_lookup(engine, keys, (engine.fingerprint,), max_chunks=n)

    async def _settle(self, engine: EngineState, keys: list[bytes], fps: tuple[bytes, ...], hit: int,
                      deadline: float) -> LookupPlan:
        """The hit now servable here from the entries of layouts ``fps`` (every one holds it). Entries another
        job is still writing are waited for (bounded)."""
        while True:
            plan = self.index.plan_lookup(engine, keys, fps, max_chunks=hit)
            if plan.hit_chunks >= hit or time.monotonic() >= deadline:
                return plan
            if not any(self.index.busy(engine, keys, fp, hit) for fp in fps):
                return plan
            await asyncio.sleep(SETTLE_POLL_S)

    @staticmethod
    def _own_layout(engine: EngineState) -> Layout:
        return Layout(engine.fingerprint, engine.chunk_size, tuple(engine.rules), engine.kinds, engine.entry_bytes)

    def _answer(self, msg: Pull, engine: EngineState, plan: LookupPlan, owner: int, *, nbytes: int,
                pulled: int, started: float) -> PullResult:
        lease_id = 0
        if plan.hit_chunks:
            lease_id = self.index.lease(plan, owner, self.cfg.lease_ttl_s)
        needed = sum(len(c) for c in plan.needed.values()) * len(plan.fingerprints)
        elapsed = time.monotonic() - started
        self.metrics.inc("peer_pull_chunks", plan.hit_chunks)
        return PullResult(msg.req_id, nbytes, plan.hit_chunks, lease_id, self.cfg.lease_ttl_s, pulled,
                          needed - pulled, round(elapsed, 6))

