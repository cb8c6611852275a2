"""Replicated groups (MLA): a world whose every group holds the same bytes on every tensor-parallel rank is keyed
by one TP-free fingerprint, so each chunk is one entry on the node, stored by whichever rank comes first and read
by every rank, and by an engine of the same model at another TP size (docs/design.md, "Replicated groups (MLA)").
Worlds that are not replicated keep their per-rank fingerprints, as before.

In-process: the daemon's service with fake connections; each rank is a numpy buffer of this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from hkvd.daemon.cache import Formats, GroupRule
from hkvd.daemon.cache.lookup_plan import LookupPlan, distinct
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.in_process import in_process_service, own_conn
from hkvd.daemon.engines.registry import rank_fingerprints, replica_fingerprint, replicated_world
from hkvd.daemon.engines.service import KVService
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import KVError, ProtocolViolation
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire import Message, control, kv
from hkvd.transport.wire.control import EngineSpec

PAGE = 4096
BLOCKS = 32
CHUNK = 32  # tokens: two blocks of 16
KEYS = chunk_keys(list(range(4 * CHUNK)), CHUNK)


def mla_group(num_blocks: int = BLOCKS) -> GroupSpec:
    """One MLA group: one latent head per page, the same page on every rank."""
    return GroupSpec(0, "full", 16, 0, num_blocks, "bfloat16", (View(0, 0, 1, PAGE, PAGE, PAGE),))


def spec(tp: int, rank: int, *, replicated: bool = True, model_identity: str = "mid", mem: np.ndarray | None = None,
         groups: list[GroupSpec] | None = None) -> EngineSpec:
    regions = [Region(0, "host", mem.nbytes, addr=mem.ctypes.data)] if mem is not None else []
    gs = groups or [mla_group()]
    return EngineSpec("deepseek", tp, rank, "cpu/HNC", CHUNK, 16, 8192, "none", regions, gs,
                      identity=f"id-tp{tp}", model_identity=model_identity,
                      replicated=[g.group_id for g in gs] if replicated else [])


# ---- wire ---------------------------------------------------------------------------------------------------


def test_replicated_travels_and_an_older_shims_registration_reads_as_none() -> None:
    s = spec(2, 1)
    assert EngineSpec.from_wire(s.to_wire()).replicated == [0]
    old = s.to_wire()
    old.pop("replicated")
    assert EngineSpec.from_wire(old).replicated == []
    assert "replicated" not in spec(2, 1, replicated=False).to_wire()


@pytest.mark.parametrize("bad", [[0, 0], [7], ["0"], [-1], 0, [True]])
def test_replicated_must_name_registered_groups_once(bad: object) -> None:
    wire = spec(2, 0).to_wire()
    wire["replicated"] = bad
    with pytest.raises(ProtocolViolation):
        EngineSpec.from_wire(wire)


# ---- keying -------------------------------------------------------------------------------------------------


def test_a_replicated_world_has_one_tp_free_fingerprint() -> None:
    tp2 = rank_fingerprints(spec(2, 0), CHUNK, range(2))
    tp1 = rank_fingerprints(spec(1, 0), CHUNK, range(1))
    tp4 = rank_fingerprints(spec(4, 3), CHUNK, range(4))
    assert tp2 == (tp2[0], tp2[0]) and tp1 == (tp2[0],) and tp4 == (tp2[0],) * 4
    assert tp2[0] == replica_fingerprint(spec(2, 1), CHUNK)
    # The format still decides: another chunk size, page order, model identity or group format is another key.
    assert rank_fingerprints(spec(2, 0), 2 * CHUNK, range(2))[0] != tp2[0]
    assert rank_fingerprints(replace(spec(2, 0), layout_tag="cpu/NHC"), CHUNK, range(2))[0] != tp2[0]
    assert rank_fingerprints(spec(2, 0, model_identity="other"), CHUNK, range(2))[0] != tp2[0]
    f8 = replace(mla_group(), dtype="float8_e4m3fn")
    assert rank_fingerprints(spec(2, 0, groups=[f8]), CHUNK, range(2))[0] != tp2[0]


def test_worlds_that_are_not_all_replicated_keep_per_rank_fingerprints() -> None:
    plain = spec(2, 0, replicated=False)
    fps = rank_fingerprints(plain, CHUNK, range(2))
    assert len(set(fps)) == 2 and not replicated_world(plain)
    # Marking replicated groups changes nothing unless every group is one, and the model identity is given.
    swa = GroupSpec(1, "swa", 16, 64, BLOCKS, "bfloat16", (View(0, 0, 1, PAGE, PAGE, PAGE),))
    mixed = replace(spec(2, 0, replicated=False, groups=[mla_group(), swa]), replicated=[0])
    no_identity = spec(2, 0, model_identity="")
    for s in (mixed, no_identity):
        assert not replicated_world(s)
        assert rank_fingerprints(s, CHUNK, range(2)) == rank_fingerprints(replace(s, replicated=[]), CHUNK, range(2))
    assert rank_fingerprints(plain, CHUNK, range(2)) == rank_fingerprints(replace(plain, replicated=[]), CHUNK,
                                                                          range(2))


def test_a_plan_of_a_replicated_world_names_each_entry_once_and_serves_every_rank() -> None:
    f, a, b = b"f" * 16, b"a" * 16, b"b" * 16
    assert distinct((a, b)) == (a, b) and distinct((f, f, f)) == (f,)
    p = LookupPlan(2, {0: [0, 1]}, KEYS[:2], (f, f))
    assert p.entries() == [(f, 0, KEYS[0]), (f, 0, KEYS[1])]
    assert LookupPlan(2, {0: [0, 1]}, KEYS[:2], (a, b)).entries() == [
        (a, 0, KEYS[0]), (a, 0, KEYS[1]), (b, 0, KEYS[0]), (b, 0, KEYS[1])]


def test_formats_keep_naming_a_shared_fingerprints_world_when_one_is_forgotten() -> None:
    f = b"f" * 16
    formats = Formats(max_worlds=2)
    rules = [GroupRule(0, "full", 0)]
    kw = {"model": "m", "chunk_size": CHUNK, "rules": rules, "kinds": {0: "full"}, "entry_bytes": {0: 1}}
    formats.add((f, f), 0, **kw)  # type: ignore[arg-type]
    formats.add((f,), 0, **kw)  # type: ignore[arg-type]
    w = formats.world(f)
    assert w is not None and w.fingerprints == (f,)
    formats.add((b"x" * 16,), 0, **kw)  # type: ignore[arg-type]  # the TP=2 world is forgotten first
    w = formats.world(f)
    assert w is not None and w.fingerprints == (f,)
    formats.add((b"y" * 16,), 0, **kw)  # type: ignore[arg-type]
    assert formats.world(f) is None


# ---- through the service ------------------------------------------------------------------------------------


class Node:
    """The daemon's service in this process; each rank (and each engine) a buffer and a connection of its own."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self.sent: list[Message] = []
        self.conns: list[object] = []

    async def call(self, conn: object, msg: Message) -> Message:
        before = len(self.sent)
        try:
            job = self.service.handle(conn, msg)  # type: ignore[arg-type]
            if job is not None:
                await job
        except KVError as e:
            self.sent.append(kv.Error(getattr(msg, "req_id", 0), int(e.code), e.message))
        replies = self.sent[before:]
        assert len(replies) == 1, replies
        return replies[0]

    async def register(self, s: EngineSpec) -> tuple[object, control.RegisterAck]:
        conn = own_conn(self.sent, conn_id=len(self.conns) + 1)
        self.conns.append(conn)
        ack = await self.call(conn, control.Register(1, s.to_wire()))
        assert isinstance(ack, control.RegisterAck), ack
        return conn, ack

    def entries(self) -> list[tuple[bytes, int, bytes]]:
        return self.service.index.keys()


@contextlib.contextmanager
def node(pool_mib: int = 64) -> Iterator[Node]:
    cfg = DaemonConfig(chunk_size=CHUNK, l1_size_bytes=pool_mib << 20, hugepages="off")
    with in_process_service(cfg, HostCopyEngine, 2) as parts:
        n = Node(parts.service)
        try:
            yield n
        finally:
            for c in n.conns:
                parts.service.disconnect(c)  # type: ignore[arg-type]


def items(chunks: range, first_block: int) -> list[kv.Item]:
    return [kv.Item(0, c, KEYS[c], [first_block + 2 * i, first_block + 2 * i + 1]) for i, c in enumerate(chunks)]


def block(mem: np.ndarray, b: int) -> np.ndarray:
    return mem[b * PAGE:(b + 1) * PAGE]


async def _tp2_stores(n: Node, replicated: bool) -> tuple[list[np.ndarray], list[object], list[Message]]:
    """Both ranks of a TP=2 engine store chunks 0-2 from blocks 1-6 (the same bytes, as MLA ranks hold)."""
    mems = [np.zeros(BLOCKS * PAGE, dtype=np.uint8) for _ in range(2)]
    for b in range(1, 7):
        data = np.random.default_rng(b).integers(0, 256, PAGE, dtype=np.uint8)
        for m in mems:
            block(m, b)[:] = data
    conns = []
    for rank, m in enumerate(mems):
        conn, _ = await n.register(spec(2, rank, replicated=replicated, mem=m))
        conns.append(conn)
    results = [await n.call(c, kv.Store(10 + r, items(range(3), 1))) for r, c in enumerate(conns)]
    return mems, conns, results


async def test_a_tp2_mla_world_stores_each_chunk_once_and_every_rank_reads_it() -> None:
    with node() as n:
        mems, conns, results = await _tp2_stores(n, replicated=True)
        # Rank 0 copied three entries; rank 1's store found them present and copied nothing.
        assert results[0] == kv.StoreResult(10, 6 * PAGE, 3, 0, 0, 0)
        assert isinstance(results[1], kv.StoreResult) and results[1].nbytes == 0 and results[1].stored == 0
        fps = {k[0] for k in n.entries()}
        assert len(n.entries()) == 3 and fps == {replica_fingerprint(spec(2, 0), CHUNK)}
        # The scheduler side (rank 0's spec, no regions) looks up: the hit every rank holds, one lease for both.
        sched, _ = await n.register(spec(2, 0))
        reply = await n.call(sched, kv.Lookup(20, KEYS, True))
        assert isinstance(reply, kv.LookupReply) and reply.hit_chunks == 3 and reply.lease_id
        for r, (c, m) in enumerate(zip(conns, mems, strict=True)):
            got = await n.call(c, kv.Retrieve(30 + r, reply.lease_id, items(range(3), 11)))
            assert isinstance(got, kv.RetrieveResult) and got.entries == 3, got
            for b in range(6):
                assert bytes(block(m, 11 + b)) == bytes(block(m, 1 + b))
        # Each rank's retrieve used the lease once: it is spent.
        again = await n.call(conns[0], kv.Retrieve(40, reply.lease_id, items(range(3), 21)))
        assert isinstance(again, kv.Error), again


async def test_per_rank_copies_stay_where_groups_are_not_marked_replicated() -> None:
    with node() as n:
        _, _, results = await _tp2_stores(n, replicated=False)
        assert [r.nbytes for r in results] == [6 * PAGE, 6 * PAGE]  # type: ignore[attr-defined]
        assert len(n.entries()) == 6 and len({k[0] for k in n.entries()}) == 2


async def test_a_rank_whose_store_came_first_serves_the_others_and_a_lookup_needs_the_one_entry() -> None:
    with node() as n:
        mems = [np.zeros(BLOCKS * PAGE, dtype=np.uint8) for _ in range(2)]
        for m in mems:
            block(m, 1)[:] = 7
            block(m, 2)[:] = 9
        conns = [(await n.register(spec(2, r, mem=m)))[0] for r, m in enumerate(mems)]
        sched, _ = await n.register(spec(2, 0))
        assert (await n.call(sched, kv.Lookup(1, KEYS[:2], False))).hit_chunks == 0  # type: ignore[attr-defined]
        done = await n.call(conns[1], kv.Store(2, items(range(1), 1)))  # rank 1 alone stored chunk 0
        assert isinstance(done, kv.StoreResult) and done.stored == 1
        reply = await n.call(sched, kv.Lookup(3, KEYS[:2], True))
        assert isinstance(reply, kv.LookupReply) and reply.hit_chunks == 1
        got = await n.call(conns[0], kv.Retrieve(4, reply.lease_id, items(range(1), 5)))
        assert isinstance(got, kv.RetrieveResult)
        assert bytes(block(mems[0], 5)) == bytes(block(mems[0], 1)) and bytes(block(mems[0], 6)) == bytes(
            block(mems[0], 2))


async def test_an_engine_of_another_tp_size_reads_the_entries_directly() -> None:
    with node() as n:
        mems, _, _ = await _tp2_stores(n, replicated=True)
        one = np.zeros(BLOCKS * PAGE, dtype=np.uint8)
        conn, ack = await n.register(spec(1, 0, mem=one))
        assert ack.fingerprint == replica_fingerprint(spec(2, 0), CHUNK)
        reply = await n.call(conn, kv.Lookup(50, KEYS, True))
        assert isinstance(reply, kv.LookupReply) and reply.hit_chunks == 3
        got = await n.call(conn, kv.Retrieve(51, reply.lease_id, items(range(3), 11)))
        assert isinstance(got, kv.RetrieveResult) and got.entries == 3
        for b in range(6):
            assert bytes(block(one, 11 + b)) == bytes(block(mems[0], 1 + b))
        # Read as its own entries: no re-sharding counted.
        m = n.service.metrics
        assert m.get("tp_reshards", op="lookup") == 0 and m.get("tp_reshards", op="retrieve") == 0
        assert len(n.entries()) == 3


async def test_a_replicated_worlds_one_chunk_needs_one_ranks_room() -> None:
    # A 2 MiB entry per chunk: a TP=8 world of per-rank copies needs 16 MiB for one chunk, a replicated one 2 MiB.
    big = GroupSpec(0, "full", 16, 0, BLOCKS, "bfloat16", (View(0, 0, 1, 1 << 20, 1 << 20, 1 << 20),))
    with node(pool_mib=8) as n:
        mem = np.zeros(BLOCKS << 20, dtype=np.uint8)
        await n.register(spec(8, 0, mem=mem, groups=[big]))
        conn = own_conn(n.sent, conn_id=99)
        n.conns.append(conn)
        per_rank = spec(8, 0, mem=mem, groups=[big], replicated=False)
        refused = await n.call(conn, control.Register(1, per_rank.to_wire()))
        assert isinstance(refused, kv.Error) and "cannot hold one chunk" in refused.message


def test_in_step_places_wait_for_every_rank_of_a_replicated_world() -> None:
    """A replicated world's ranks share one fingerprint: places are given only once each rank's own worker (told
    apart by its rank) mapped the pool, not as soon as one rank's did."""
    import os
    from types import SimpleNamespace
    from typing import Any, cast

    from hkvd.daemon.engines.places import Places

    def worker(rank: int, mapped: str = "srv") -> Any:
        return SimpleNamespace(can_copy=True, fingerprint=b"f", pid=os.getpid(), mapped_pool=mapped,
                               spec=SimpleNamespace(rank=rank, regions=[SimpleNamespace(kind="host")]))

    asker = cast(Any, SimpleNamespace(pid=os.getpid()))
    registered: list[Any] = [worker(0)]
    places = Places(cast(Any, None), cast(Any, SimpleNamespace(engines=lambda: registered)), "srv")
    assert not places.world_mapped((b"f", b"f"), asker)  # rank 1 has not registered
    registered.append(worker(1, mapped="old"))
    assert not places.world_mapped((b"f", b"f"), asker)
    registered[-1].mapped_pool = "srv"
    assert places.world_mapped((b"f", b"f"), asker)
