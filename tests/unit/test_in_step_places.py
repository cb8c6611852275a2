"""In-step loads, the daemon's side: the pool offered in HelloAck, ``Register.mapped_pool``, ``LookupReply.places``.

The daemon (``Server`` over a ``KVService``) runs on this test's loop behind a real Unix socket; the engine is
this process, its KV memory a numpy buffer registered as host memory. The pool offered is mapped as an engine
maps it: ``/proc/<daemon pid>/fd/<fd>``, read-only. A leased hit's places must name the bytes a Retrieve of
the same entries writes into the engine's blocks (and the bytes stored); every other lookup gets none.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.in_process import in_process_service
from hkvd.daemon.server import Server
from hkvd.transport.aio import FrameStream
from hkvd.transport.copy_engine import Region
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire import PROTOCOL_VERSION, Message, control, kv
from hkvd.transport.wire.control import EngineSpec

PAGE = 4096
BLOCKS = 16
CHUNK = 32  # tokens: two blocks of 16
KEYS = chunk_keys(list(range(3 * CHUNK)), CHUNK)
T = 5.0  # seconds per reply; a hung test fails by name instead


@contextlib.contextmanager
def daemon(in_step_loads: bool = True) -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="hkvd-place-", dir="/tmp") as d:
        cfg = DaemonConfig(socket_path=str(Path(d) / "s.sock"), chunk_size=CHUNK, l1_size_bytes=16 << 20,
                           hugepages="off", in_step_loads=in_step_loads)
        with in_process_service(cfg) as parts:
            yield Server(cfg, parts.service)


@contextlib.asynccontextmanager
async def serving(in_step_loads: bool = True) -> AsyncIterator[Server]:
    with daemon(in_step_loads) as srv:
        await srv.start()
        try:
            yield srv
        finally:
            await srv.stop_accepting()
            srv.close_connections()
            for _ in range(3):  # connection_lost runs a loop turn after the close
                await asyncio.sleep(0)


class Rank:
    """One engine connection: a worker with a host buffer (one full-attention group), or a scheduler."""

    def __init__(self, stream: FrameStream, ack: control.HelloAck, rank: int, world: int) -> None:
        self.s, self.ack, self.rank, self.world = stream, ack, rank, world
        self.mem = np.zeros(BLOCKS * PAGE, dtype=np.uint8)
        self.req = 100

    def spec(self, worker: bool) -> EngineSpec:
        regions = [Region(0, "host", self.mem.nbytes, addr=self.mem.ctypes.data)] if worker else []
        group = GroupSpec(0, "full", 16, 0, BLOCKS, "bfloat16", (View(0, 0, 1, PAGE, PAGE, PAGE),))
        return EngineSpec("m", self.world, self.rank, "t", CHUNK, 16, 8192, "none", regions, [group])

    def block(self, b: int) -> np.ndarray:
        return self.mem[b * PAGE:(b + 1) * PAGE]

    async def call(self, msg: Message) -> Message:
        await self.s.send(msg, T)
        return await self.s.recv(T)

    def next_req(self) -> int:
        self.req += 1
        return self.req


async def connect(srv: Server, role: str = "worker", mapped: str | None = None, rank: int = 0,
                  world: int = 1) -> tuple[Rank, control.RegisterAck]:
    """A registered connection; ``mapped``: its Register.mapped_pool (None: the HelloAck's server id)."""
    reader, writer = await asyncio.open_unix_connection(srv.cfg.socket_path)
    s = FrameStream(reader, writer, srv.cfg.max_frame_bytes)
    await s.send(control.Hello(PROTOCOL_VERSION, "test", role), T)
    ack = await s.recv(T)
    assert isinstance(ack, control.HelloAck), ack
    r = Rank(s, ack, rank, world)
    reg = await r.call(control.Register(1, r.spec(role == "worker").to_wire(),
                                        ack.server_id if mapped is None else mapped))
    assert isinstance(reg, control.RegisterAck), reg
    return r, reg


def items(first_block: int, chunks: range = range(2)) -> list[kv.Item]:
    return [kv.Item(0, c, KEYS[c], [first_block + 2 * i, first_block + 2 * i + 1]) for i, c in enumerate(chunks)]


async def stored(r: Rank, chunks: range = range(2)) -> bytes:
    """Store ``chunks`` from blocks 1.. filled with random bytes; the bytes, in item order."""
    src = items(1, chunks)
    for it in src:
        for b in it.block_ids:
            r.block(b)[:] = np.random.default_rng(1000 * r.rank + b).integers(0, 256, PAGE, dtype=np.uint8)
    assert isinstance(await r.call(kv.Store(r.next_req(), src)), kv.StoreResult)
    return b"".join(r.block(b).tobytes() for it in src for b in it.block_ids)


async def lookup(r: Rank, lease: bool = True, keys: list[bytes] = KEYS[:2]) -> kv.LookupReply:
    reply = await r.call(kv.Lookup(r.next_req(), keys, lease, places=True))
    assert isinstance(reply, kv.LookupReply), reply
    return reply


@contextlib.contextmanager
def mapped_pool(ack: control.HelloAck) -> Iterator[mmap.mmap]:
    """The pool as an engine maps it: read-only, through /proc/<daemon pid>/fd/<fd>."""
    fd_num, size = ack.pool
    fd = os.open(f"/proc/{ack.daemon_pid}/fd/{fd_num}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        yield mm
    finally:
        mm.close()


def read_places(mm: mmap.mmap, places: list[list[int | list[int]]]) -> bytes:
    out = []
    for _, _, extents in places:
        assert isinstance(extents, list)
        out += [mm[off:off + n] for off, n in zip(extents[::2], extents[1::2], strict=True)]
    return b"".join(out)


async def test_a_leased_hit_is_placed_where_a_retrieve_reads_it() -> None:
    async with serving() as srv:
        r, reg = await connect(srv)
        assert reg.in_step and r.ack.pool == [srv.service.index.pool.fd, srv.service.index.pool.size]
        want = await stored(r)
        reply = await lookup(r)
        assert reply.hit_chunks == 2 and reply.lease_id and len(reply.places) == 1
        assert [p[:2] for p in reply.places[0]] == [[0, 0], [0, 1]]  # (group, chunk), in the hit's order
        with mapped_pool(r.ack) as mm:
            placed = read_places(mm, reply.places[0])
        assert placed == want
        dst = items(9)
        assert isinstance(await r.call(kv.Retrieve(r.next_req(), reply.lease_id, dst)), kv.RetrieveResult)
        assert placed == b"".join(r.block(b).tobytes() for it in dst for b in it.block_ids)
        assert srv.service.metrics.get("lookup_places") == 1
        await r.s.aclose()


@pytest.mark.parametrize("mapped", ["", "another-daemon"])
async def test_an_engine_that_did_not_map_this_pool_gets_no_places(mapped: str) -> None:
    async with serving() as srv:
        r, reg = await connect(srv, mapped=mapped)
        assert reg.in_step  # the daemon offers; the engine did not take it
        await stored(r)
        reply = await lookup(r)
        assert reply.hit_chunks == 2 and reply.lease_id and reply.places == []
        await r.s.aclose()


async def test_no_places_without_a_lease_or_a_hit() -> None:
    async with serving() as srv:
        r, _ = await connect(srv)
        await stored(r)
        unleased = await lookup(r, lease=False)
        assert unleased.hit_chunks == 2 and not unleased.lease_id and unleased.places == []
        miss = await lookup(r, keys=[KEYS[2]])
        assert miss.hit_chunks == 0 and not miss.lease_id and miss.places == []
        assert srv.service.metrics.get("lookup_places") == 0
        await r.s.aclose()


async def test_with_the_option_off_no_pool_is_offered_and_no_places_are_sent() -> None:
    async with serving(in_step_loads=False) as srv:
        r, reg = await connect(srv)
        assert r.ack.pool == [] and not reg.in_step
        await stored(r)
        reply = await lookup(r)
        assert reply.lease_id and reply.places == []
        await r.s.aclose()


async def test_a_schedulers_lookup_is_placed_once_every_rank_of_the_world_mapped_the_pool() -> None:
    """The scheduler (lookup-only) asks; places come per rank, in rank order, only while every rank's worker
    mapped this pool. A tool is offered no pool."""
    async with serving() as srv:
        w0, _ = await connect(srv, rank=0, world=2)
        w1, _ = await connect(srv, mapped="", rank=1, world=2)  # rank 1 did not map the pool
        sched, _ = await connect(srv, role="scheduler", rank=0, world=2)
        assert sched.ack.pool  # offered to engines' connections
        want = [await stored(w0), await stored(w1)]
        assert (await lookup(sched)).places == []
        await w1.s.aclose()
        async with asyncio.timeout(T):  # until the daemon saw the connection end
            while len(srv.service.registry.engines()) > 2:  # noqa: ASYNC110 - the daemon's registry: no event
                await asyncio.sleep(0.005)
        w1, _ = await connect(srv, rank=1, world=2)  # it comes back, mapped
        reply = await lookup(sched)
        assert reply.hit_chunks == 2 and len(reply.places) == 2
        with mapped_pool(w0.ack) as mm:
            assert [read_places(mm, rank) for rank in reply.places] == want
        tool = await asyncio.open_unix_connection(srv.cfg.socket_path)
        s = FrameStream(*tool, srv.cfg.max_frame_bytes)
        await s.send(control.Hello(PROTOCOL_VERSION, "test", "tool"), T)
        ack = await s.recv(T)
        assert isinstance(ack, control.HelloAck) and ack.pool == []
        for c in (w0.s, w1.s, sched.s, s):
            await c.aclose()


@pytest.mark.out_of_process  # a child process stands for a worker vLLM starts as the engine core's child
def test_only_the_asking_engines_own_workers_count_for_places() -> None:
    """A worker counts for an engine's lookup when it runs in the engine's process or a child of it: another
    engine of the same format whose worker mapped the pool does not make this one's places safe (just after a
    daemon restart this engine's worker may not have registered, or mapped the new pool, yet)."""
    import os
    import subprocess
    from types import SimpleNamespace
    from typing import Any, cast

    from hkvd.daemon.engines.places import Places, of_engine, parent_pid

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert parent_pid(child.pid) == os.getpid() and parent_pid(2**22 + 12345) == -1

        def worker(pid: int, fp: bytes, mapped: str = "srv") -> Any:
            return SimpleNamespace(can_copy=True, fingerprint=fp, pid=pid, mapped_pool=mapped,
                                   spec=SimpleNamespace(rank=fps.index(fp), regions=[SimpleNamespace(kind="host")]))

        asker = cast(Any, SimpleNamespace(pid=os.getpid()))
        registered: list[Any] = []
        places = Places(cast(Any, None), cast(Any, SimpleNamespace(engines=lambda: registered)), "srv")
        fps = (b"r0", b"r1")
        registered += [worker(1, b"r0"), worker(1, b"r1")]  # another engine's workers (pid 1 is no child)
        assert not of_engine(registered[0], asker) and not places.world_mapped(fps, asker)
        registered.append(worker(os.getpid(), b"r0"))  # this engine's rank 0, in its own process
        assert not places.world_mapped(fps, asker)  # its rank 1 has not registered
        registered.append(worker(child.pid, b"r1", mapped="old"))  # rank 1, a child, mapped another pool
        assert of_engine(registered[-1], asker) and not places.world_mapped(fps, asker)
        registered[-1].mapped_pool = "srv"
        assert places.world_mapped(fps, asker)
    finally:
        child.kill()
        child.wait()
