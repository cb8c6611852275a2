"""Peer links in-process (``hkvd.daemon.peers``): a serving ``PeerServer`` and a pulling ``PeerService``,
two pools in this process, the real control protocol over loopback TCP, and a fake at the transport
boundary.

``MemcpyTransport`` stands in for NIXL: both pools live in this process, so a READ of
``Desc(remote_addr, local_addr, nbytes)`` is a ``memmove``; it can be told to fail every READ. The
pull's reply reaches a ``RecordingSink`` (the ``ReplySink`` the service's ``Conn`` satisfies), so no
engine connection or ``KVService`` is involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from hkvd.daemon.cache import Cache
from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.registry import EngineState, Registry
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.peers import links
from hkvd.daemon.peers import pulling as pulling_mod
from hkvd.daemon.peers.auth import parse_allow
from hkvd.daemon.peers.layout_book import LayoutBook
from hkvd.daemon.peers.links import PeerService, ReplySink
from hkvd.daemon.peers.serving import PeerServer
from hkvd.transport.base import DataTransport, Desc, ReadCounters, Transfer, TransportStats
from hkvd.transport.errors import CopyFailedError, ErrorCode, NotRegistered, ShuttingDown
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire import Message, kv
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.peer import PEER_VERSION, Pull, PullResult

PAGE = 4096
CHUNK = 32  # tokens: two blocks of 16, one entry = 2 pages
ENTRY = 2 * PAGE
TOKEN = "peer-links-test-token-0123456789abcdef"
KEYS = chunk_keys(list(range(4 * CHUNK)), CHUNK)
REPLY_S = 10.0  # a reply takes milliseconds; this only bounds a hang


class MemcpyTransport(DataTransport):
    """NIXL's part, in one process: READs are memmoves; ``fail_reads`` fails each READ instead."""

    name = "memcpy"

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.fail_reads = False
        self.peers: set[str] = set()
        self.registered: list[tuple[int, int]] = []
        self._ids = 0
        self._counters = ReadCounters()

    async def start(self, timeout_s: float) -> None:
        pass

    async def register(self, addr: int, nbytes: int) -> None:
        self.registered.append((addr, nbytes))

    async def metadata(self) -> bytes:
        return self.agent_name.encode()

    async def add_peer(self, metadata: bytes) -> str:
        self.peers.add(metadata.decode())
        return metadata.decode()

    async def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)

    def read(self, peer: str, descs: Sequence[Desc]) -> Transfer:
        self._ids += 1
        settled: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        t = Transfer(self._ids, peer, sum(d.nbytes for d in descs), len(descs), settled, time.monotonic())
        self._counters.started()
        if self.fail_reads:
            settled.set_exception(CopyFailedError(f"scripted READ failure from {peer}"))
        else:
            for d in descs:
                ctypes.memmove(d.local_addr, d.remote_addr, d.nbytes)
            settled.set_result(t.nbytes)
        t.finished_at = time.monotonic()
        self._counters.settled(t)
        return t

    def statistics(self) -> TransportStats:
        return self._counters.statistics(len(self.peers))

    async def aclose(self) -> None:
        pass


@dataclass
class RecordingSink:
    """The engine connection a pull answers: records replies; ``inflight`` as the service's ``Conn``."""

    conn_id: int = 1
    inflight: int = 0
    replies: list[Message] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def send(self, msg: Message) -> None:
        self.replies.append(msg)
        self.arrived.set()

    async def reply(self) -> Message:
        async with asyncio.timeout(REPLY_S):
            await self.arrived.wait()
        return self.replies[-1]


async def until(cond: Callable[[], bool]) -> bool:
    """Let the loop run (the other end's socket included) until ``cond`` holds; False after REPLY_S."""
    async with asyncio.timeout(REPLY_S):
        while not cond():  # noqa: ASYNC110 - the condition lives in the other end's index: no event to wait on
            await asyncio.sleep(0.001)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Side:
    """One daemon's pool, index and registry, with an engine of the test's layout registered."""

    def __init__(self) -> None:
        self.pool = HugePagePool(8 << 20, "off")
        self.index = Cache(self.pool, make_policy("lru"))
        self.copy_engine = HostCopyEngine(self.pool)
        self.registry = Registry(CHUNK, self.copy_engine, pool=self.pool)
        group = GroupSpec(0, "full", 16, 0, 64, "bfloat16", (View(0, 0, 1, 64 * PAGE, PAGE, PAGE),))
        # Lookup-only: the pull lands in the pool; the engine's memory is not part of it.
        self.engine: EngineState = self.registry.register(
            EngineSpec("m", 1, 0, "t", CHUNK, 16, 8192, "none", [], [group]), 1, 1)

    def key(self, chunk: int) -> tuple[bytes, int, bytes]:
        return (self.engine.fingerprint, 0, KEYS[chunk])

    def store(self, chunk: int) -> None:
        e = self.index._index.begin_write(self.key(chunk), ENTRY, "full", 0)
        assert e is not None
        (off, n), = e.alloc.extents
        self.pool.buffer[off:off + n] = bytes([chunk + 1]) * n
        self.index._index.finish_write(e, pending=False)

    def entry_bytes(self, chunk: int) -> bytes:
        e = self.index.get(self.key(chunk))
        assert e is not None
        return b"".join(bytes(self.pool.buffer[off:off + n]) for off, n in e.alloc.extents)

    def close(self) -> None:
        self.copy_engine.close()
        self.pool.close()


@dataclass
class Pair:
    serving: Side
    pulling: Side
    server: PeerServer
    peers: PeerService
    transport: MemcpyTransport
    address: str


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    a, b = Side(), Side()
    yield a, b
    a.close()
    b.close()


@contextlib.asynccontextmanager
async def running(sides: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Pair]:
    """Both ends up, in the test's own task (``PeerService.run`` in a TaskGroup of it)."""
    serving, pulling = sides
    address = f"127.0.0.1:{free_port()}"
    server = PeerServer(DaemonConfig(hugepages="off", peer_listen=address), TOKEN.encode(), parse_allow(()),
                        "node-a", serving.index, serving.pool, LayoutBook(serving.registry), "agent-a", b"agent-a",
                        Metrics())
    await server.start()
    # The transport boundary: no NIXL here; PeerService builds the in-daemon transport, which is ours.
    transports: list[MemcpyTransport] = []

    def make_transport(agent: str) -> MemcpyTransport:
        transports.append(MemcpyTransport(agent))
        return transports[-1]

    monkeypatch.setattr(links, "load_nixl", lambda: None)
    monkeypatch.setattr(links, "host_enabled", lambda: False)
    monkeypatch.setattr(links, "NixlTransport", make_transport)
    peers = PeerService(DaemonConfig(hugepages="off", peer_token=TOKEN), pulling.pool, pulling.index,
                        pulling.registry, Metrics())
    await peers.start()
    assert transports[0].registered == [(pulling.pool.base_addr, pulling.pool.size)]  # the whole pool, once
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peers.run())
            await asyncio.sleep(0)  # run() owns the pull tasks from here on
            yield Pair(serving, pulling, server, peers, transports[0], address)
            await peers.aclose()  # run() returns
    finally:
        await peers.aclose()
        await server.aclose()


@pytest.fixture
async def pair(sides: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Pair]:
    async with running(sides, monkeypatch) as p:
        yield p


def sink() -> RecordingSink:
    return RecordingSink()


async def test_a_pull_reads_the_peers_entries_into_this_pool_and_answers_done(pair: Pair) -> None:
    for c in range(3):
        pair.serving.store(c)
    conn = sink()
    pair.peers.submit_pull(pair.pulling.engine, Pull(5, pair.address, KEYS[:3], 0, 0), conn)
    assert conn.inflight == 1  # shutdown drains it

    done = await conn.reply()
    assert isinstance(done, PullResult) and done.req_id == 5, done
    assert (done.hit_chunks, done.pulled, done.local, done.nbytes) == (3, 3, 0, 3 * ENTRY), done
    assert conn.inflight == 0
    for c in range(3):
        assert pair.pulling.index.is_ready(pair.pulling.key(c))
        assert pair.pulling.entry_bytes(c) == bytes([c + 1]) * ENTRY
    # The serving daemon's lease on what was read is given back once the READ completed (one-way message).
    assert await until(lambda: pair.serving.index.statistics().leases == 0)
    assert pair.transport.statistics().bytes_read == 3 * ENTRY


async def test_a_failed_read_answers_an_error_and_publishes_nothing(pair: Pair) -> None:
    for c in range(2):
        pair.serving.store(c)
    pair.transport.fail_reads = True
    conn = sink()
    pair.peers.submit_pull(pair.pulling.engine, Pull(6, pair.address, KEYS[:2], 0, 0), conn)

    err = await conn.reply()
    assert isinstance(err, kv.Error) and err.req_id == 6 and err.code == ErrorCode.COPY_FAILED, err
    assert conn.inflight == 0
    assert len(pair.pulling.index) == 0  # every entry begun for the READ was given back


async def test_a_peer_without_the_entries_answers_a_miss(pair: Pair) -> None:
    conn = sink()
    pair.peers.submit_pull(pair.pulling.engine, Pull(7, pair.address, KEYS[:2], 0, 0), conn)
    done = await conn.reply()
    assert isinstance(done, PullResult) and done.req_id == 7 and done.hit_chunks == 0, done
    assert len(pair.pulling.index) == 0 and pair.transport.statistics().reads == 0


async def test_a_peer_of_another_peer_protocol_is_refused_naming_both_versions_and_the_fix(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    older = PEER_VERSION - 1
    monkeypatch.setattr(pulling_mod, "PEER_VERSION", older)  # the pulling daemon is of an older hkvd
    conn = sink()
    pair.peers.submit_pull(pair.pulling.engine, Pull(8, pair.address, KEYS[:1], 0, 0), conn)
    err = await conn.reply()
    assert isinstance(err, kv.Error) and err.req_id == 8 and err.code == ErrorCode.UNSUPPORTED_VERSION, err
    assert (f"the peer speaks peer protocol {older}, this daemon {PEER_VERSION}; run the same hkvd version on both "
            "nodes") in err.message, err.message


async def test_a_pull_needs_a_registered_engine_and_a_running_service(pair: Pair) -> None:
    conn: ReplySink = sink()
    with pytest.raises(NotRegistered):
        pair.peers.submit_pull(None, Pull(8, pair.address, KEYS[:1], 0, 0), conn)
    await pair.peers.aclose()
    await asyncio.sleep(0)  # run() leaves its TaskGroup
    with pytest.raises(ShuttingDown):
        pair.peers.submit_pull(pair.pulling.engine, Pull(9, pair.address, KEYS[:1], 0, 0), conn)
    assert conn.inflight == 0
