"""A request's load and store tiers (vLLM's ``kv_load_tiers`` / ``kv_store_tiers``): parsed, carried, decided.

The parsing (``hkvd.transport.tier_matchers``) and the wire fields are pure. The daemon's decisions run on its own
service, cache and disk tier (in a temporary directory) with this process as a full-attention engine: a lookup
that leaves the disk tier out misses what only the disk holds, one that leaves the pool out loads nothing, a
store that leaves the disk out is not written there, one that leaves the pool out is not stored at all; each
counted, with what the pool's hits are worth (``hkvd status``'s ``keeping``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkvd.daemon.cli import format_status
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.in_process import disk_tier, in_process_service, own_conn
from hkvd.daemon.tiers.disk import DiskTier
from hkvd.transport import tier_matchers as tm
from hkvd.transport.codec import decode_body, encode
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire import Message, control, events, kv
from hkvd.transport.wire.control import EngineSpec

POOL, DISK, CLUSTER = tm.POOL, tm.DISK, tm.CLUSTER


# ---- parsing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("matchers", "skip"), [
    ([{"medium": "cpu", "locality": "local"}], DISK | CLUSTER),  # the pool alone
    ([{"medium": "cpu"}], DISK),  # the pool and the cluster's DRAM
    ([{"medium": "storage"}], POOL | CLUSTER),
    ([{"locality": "local"}], CLUSTER),
    ([{"locality": "global"}], POOL | DISK),
    ([{"medium": "cpu", "locality": "global"}], POOL | DISK),
    ([{"medium": "storage", "locality": "global"}], POOL | DISK | CLUSTER),  # no tier of hkvd's is both
    ([{"medium": "storage"}, {"locality": "global"}], POOL),  # OR of matchers
    ([{}], 0),  # a matcher with no field matches every tier
    ([], POOL | DISK | CLUSTER),  # no tier at all
    ([{"medium": "CPU", "locality": "LOCAL"}], DISK | CLUSTER),  # vLLM's enum values, in capitals
    ([{"locality": "remote"}], POOL | DISK),  # vLLM 0.32's name for global
])
def test_matchers_select_the_tiers_they_match(matchers: list[Any], skip: int) -> None:
    for key in (tm.LOAD_KEY, tm.STORE_KEY):
        assert tm.parse({key: matchers}, key) == (skip, "")


def test_absent_or_null_means_every_tier_and_each_key_is_read_alone() -> None:
    assert tm.parse(None, tm.LOAD_KEY) == (0, "")
    assert tm.parse({}, tm.LOAD_KEY) == (0, "")
    assert tm.parse({tm.LOAD_KEY: None}, tm.LOAD_KEY) == (0, "")
    params = {tm.LOAD_KEY: [{"medium": "storage"}], tm.STORE_KEY: [{"locality": "local"}]}
    assert tm.parse(params, tm.LOAD_KEY) == (POOL | CLUSTER, "")
    assert tm.parse(params, tm.STORE_KEY) == (CLUSTER, "")


@pytest.mark.parametrize(("raw", "named", "fix"), [
    ({"medium": "cpu"}, "is a dict", "send a list"),
    ("cpu", "is a str", "send a list"),
    ([{"medium": "cpu"}] * 17, "is 17 matchers", "at most 16"),
    (["cpu"], "[0] is a str", "a matcher is a map"),
    ([{"medium": "cpu"}, {"tier": "disk"}], "[1] has unknown fields ['tier']", "takes only ['medium', 'locality']"),
    ([{"medium": "disk"}], "[0]['medium']='disk' is not one of ['cpu', 'storage']", "leave medium out"),
    ([{"locality": 1}], "[0]['locality']=1 is not one of ['local', 'global']", "leave locality out"),
    ([{"medium": None, "locality": "moon"}], "[0]['locality']='moon'", "leave locality out"),
])
def test_bad_input_is_one_warning_naming_the_field_and_the_fix_and_every_tier(raw: object, named: str,
                                                                               fix: str) -> None:
    skip, warning = tm.parse({tm.STORE_KEY: raw}, tm.STORE_KEY)
    assert skip == 0  # the engine's default: every tier
    assert f"kv_transfer_params['kv_store_tiers']{'' if named.startswith('[') else ' '}{named}" in warning
    assert fix in warning and "every tier" in warning and "\n" not in warning


def test_the_mapping_table() -> None:
    assert tm.TIER_FIELDS == {POOL: ("cpu", "local"), DISK: ("storage", "local"), CLUSTER: ("cpu", "global")}
    assert tm.names(DISK | CLUSTER) == "disk,cluster" and tm.names(0) == ""


# ---- the wire ---------------------------------------------------------------------------------------------------

def _round_trip(msg: Message) -> Message:
    return decode_body(encode(msg)[4:])


def test_skip_tiers_travel_and_an_older_clients_message_means_every_tier() -> None:
    key = bytes(16)
    for msg in (kv.Lookup(1, [key], True, skip_tiers=DISK | CLUSTER),
                kv.Store(2, [kv.Item(0, 0, key, [1])], skip_tiers=POOL)):
        assert _round_trip(msg) == msg
    older = kv.Lookup(3, [key], True)  # no skip_tiers: what a client before the field sends
    assert older.to_wire() == [kv.Lookup.TYPE, 3, [key], True]
    assert _round_trip(older).skip_tiers == 0  # type: ignore[attr-defined]
    ack = control.RegisterAck(1, 1, bytes(16), 32)
    assert _round_trip(ack).request_tiers is False  # type: ignore[attr-defined]  # an older daemon: none sent


def test_step_events_carry_one_skip_per_offer_or_none() -> None:
    key = bytes(16)
    offers = [kv.Item(1, 0, key, [1]), kv.Item(1, 1, key, [2])]
    msg = events.StepEvent(1, 1, 1, offers, [], skip_tiers=[POOL, 0])
    assert _round_trip(msg) == msg
    assert _round_trip(events.StepEvent(2, 2, 2, offers, [])).skip_tiers == []  # type: ignore[attr-defined]
    with pytest.raises(ProtocolViolation, match="one per offer"):
        events.StepEvent(3, 3, 3, offers, [], skip_tiers=[0]).validate()
    with pytest.raises(ProtocolViolation, match="skip_tiers"):
        events.StepEvent(4, 4, 4, offers, [], skip_tiers=[0, 9]).validate()


@pytest.mark.parametrize("bad", [-1, 8, 1 << 40, True, 1.0])
def test_skip_tiers_are_bounded(bad: object) -> None:
    key = bytes(16)
    with pytest.raises(ProtocolViolation, match="skip_tiers"):
        kv.Lookup(1, [key], True, skip_tiers=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ProtocolViolation, match="skip_tiers"):
        kv.Store(1, [kv.Item(0, 0, key, [1])], skip_tiers=bad).validate()  # type: ignore[arg-type]


# ---- the daemon's decisions -------------------------------------------------------------------------------------

PAGE = 4096
BLOCKS = 32
CHUNK = 32  # tokens: two blocks of 16
KEYS = chunk_keys(list(range(5000, 5000 + 6 * CHUNK)), CHUNK)
ENTRY = 2 * PAGE


class Node:
    """The service over a 64 MiB pool and a disk tier, and this process as a full-attention engine."""

    def __init__(self, root: Path | None, pool_bytes: int = 64 << 20) -> None:
        """``root``: the disk tier's directory (None: no disk tier)."""
        cfg = DaemonConfig(chunk_size=CHUNK, l1_size_bytes=pool_bytes, hugepages="off")
        self._parts = contextlib.ExitStack()
        self.disk: DiskTier | None = None
        parts = self._parts.enter_context(in_process_service(
            cfg, threads=1, tiers=disk_tier(str(root), self._keep) if root is not None else None))
        self.cache, self.service = parts.cache, parts.service
        self.sent: list[Message] = []
        self.conn = own_conn(self.sent)
        self.mem = np.zeros(BLOCKS * PAGE, dtype=np.uint8)

    def _keep(self, disk: DiskTier) -> None:
        self.disk = disk

    def close(self) -> None:
        self.service.disconnect(self.conn)
        if self.disk is not None:
            self.disk.close(5.0)
        self._parts.close()

    def on_disk_now(self, chunk: int, group: int = 0) -> bool:
        assert self.disk is not None
        return self.disk.get(self.key(chunk, group)) is not None

    async def call(self, msg: Message) -> Message:
        before = len(self.sent)
        job = self.service.handle(self.conn, msg)
        if job is not None:
            await job
        [reply] = self.sent[before:]
        return reply

    async def register(self, kinds: tuple[str, ...] = ("full",)) -> None:
        """Register as an engine of ``kinds`` groups (group g's blocks after group g - 1's)."""
        self.mem = np.zeros(len(kinds) * BLOCKS * PAGE, dtype=np.uint8)
        groups = [GroupSpec(g, kind, 16, 0, BLOCKS, "bfloat16", (View(0, g * BLOCKS * PAGE, 1, PAGE, PAGE, PAGE),))
                  for g, kind in enumerate(kinds)]
        spec = EngineSpec("m", 1, 0, "t", CHUNK, 16, 8192, "align" if "mamba" in kinds else "none",
                          [Region(0, "host", self.mem.nbytes, addr=self.mem.ctypes.data)], groups)
        ack = await self.call(control.Register(1, spec.to_wire()))
        assert isinstance(ack, control.RegisterAck) and ack.request_tiers

    def key(self, chunk: int, group: int = 0) -> tuple[bytes, int, bytes]:
        return (self.conn.engine.fingerprint, group, KEYS[chunk])  # type: ignore[union-attr]

    async def store(self, req_id: int, chunks: range, skip: int = 0) -> kv.StoreResult:
        items = [kv.Item(0, c, KEYS[c], [2 * c + 1, 2 * c + 2], KEYS[c - 1] if c else b"") for c in chunks]
        reply = await self.call(kv.Store(req_id, items, skip_tiers=skip))
        assert isinstance(reply, kv.StoreResult), reply
        return reply

    async def lookup(self, req_id: int, chunks: int, skip: int = 0, lease: bool = False) -> kv.LookupReply:
        reply = await self.call(kv.Lookup(req_id, KEYS[:chunks], lease, skip_tiers=skip))
        assert isinstance(reply, kv.LookupReply), reply
        return reply

    async def on_disk(self, chunks: range, group: int = 0) -> None:
        for _ in range(2000):  # the write-behind's thread: 20 s at most
            if all(self.on_disk_now(c, group) for c in chunks):
                return
            await asyncio.sleep(0.01)
        pytest.fail("the disk tier did not write the entries within 20 s")

    def counter(self, name: str, **labels: str) -> float:
        return self.service.metrics.get(name, **labels)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(tmp_path / "l2")
    try:
        await n.register()
        yield n
    finally:
        n.close()


async def test_a_pool_only_lookup_misses_what_only_the_disk_holds(node: Node) -> None:
    await node.store(2, range(3))
    await node.on_disk(range(3))
    for c in (1, 2):  # chunks 1 and 2 leave the pool; the disk keeps them
        entry = node.cache.get(node.key(c))
        assert entry is not None
        node.cache.drop(entry)

    pool_only = await node.lookup(3, 3, skip=DISK | CLUSTER)
    assert pool_only.hit_chunks == 1  # chunk 0 alone: the disk's chunks are a miss for it
    assert not node.cache.is_ready(node.key(1))  # and were not read into the pool
    assert node.counter("lookup_tiers_left_out", tier="disk") == 1
    assert node.counter("l2_hits", kind="full") == 0

    default = await node.lookup(4, 3)
    assert default.hit_chunks == 3  # the same prefix, every tier: read back from the disk
    assert node.counter("l2_hits", kind="full") == 2


async def test_a_lookup_that_leaves_the_pool_out_loads_nothing(node: Node) -> None:
    await node.store(2, range(2))
    reply = await node.lookup(3, 2, skip=POOL, lease=True)
    assert (reply.hit_chunks, reply.lease_id) == (0, 0)
    assert node.counter("lookup_tiers_left_out", tier="pool") == 1
    assert (await node.lookup(4, 2)).hit_chunks == 2  # the entries are there for a default request


async def test_a_store_whose_tiers_leave_the_disk_out_is_not_written_there(node: Node) -> None:
    kept = await node.store(2, range(2), skip=DISK | CLUSTER)  # pool only
    assert (kept.stored, kept.dropped) == (2, 0)
    await node.store(3, range(2, 4))  # a default store after it, through the same write-behind queue
    await node.on_disk(range(2, 4))
    assert not node.on_disk_now(0) and not node.on_disk_now(1)
    assert node.cache.is_ready(node.key(0)) and node.cache.is_ready(node.key(1))  # in the pool, as asked
    assert node.counter("tier_writes_left_out", tier="l2") == 2
    assert node.counter("tier_bytes_left_out", tier="l2") == 2 * ENTRY
    keeping = node.service.status()["keeping"]
    assert keeping["tiers_left_out"] == {"l2": 2}


async def test_a_store_whose_tiers_leave_the_pool_out_is_not_stored(node: Node) -> None:
    refused = await node.store(2, range(2), skip=POOL)
    assert (refused.nbytes, refused.stored, refused.dropped) == (0, 0, 2)
    assert not node.cache.is_ready(node.key(0))
    await node.store(3, range(2, 3))
    await node.on_disk(range(2, 3))
    assert not node.on_disk_now(0)  # nor on disk: every lower tier is written from the pool
    assert node.counter("store_entries", outcome="store_tiers") == 2
    assert node.counter("store_bytes", outcome="store_tiers") == 2 * ENTRY


async def test_status_counts_stores_by_outcome_and_hits_per_pool_byte(node: Node) -> None:
    await node.store(2, range(2))
    await node.store(3, range(3))  # chunks 0 and 1 are there already
    await node.store(4, range(3, 4), skip=POOL)
    hit = await node.lookup(5, 3, lease=True)
    assert hit.hit_chunks == 3
    items = [kv.Item(0, c, KEYS[c], [2 * c + 11, 2 * c + 12]) for c in range(3)]
    assert isinstance(await node.call(kv.Retrieve(6, hit.lease_id, items)), kv.RetrieveResult)

    k = node.service.status()["keeping"]
    assert k["stores"] == {"stored": 3, "present": 2, "store_tiers": 1}
    assert k["store_bytes"] == {"stored": 3 * ENTRY, "present": 2 * ENTRY, "store_tiers": ENTRY}
    assert (k["hit_bytes"], k["pool_bytes"]) == (3 * ENTRY, 3 * ENTRY)
    assert k["hits_per_pool_byte"] == pytest.approx(1.0)
    text = format_status(node.service.status())
    assert "stores    stored 3 (24.0 KiB), present 2 (16.0 KiB), store_tiers 1 (8.0 KiB)" in text
    assert "hits/byte 1.00 (24.0 KiB served from the pool, 24.0 KiB held)" in text


async def test_mamba_states_follow_each_offers_store_tiers(tmp_path: Path) -> None:
    node = Node(tmp_path / "l2")
    try:
        await node.register(("full", "mamba"))
        states = [kv.Item(1, c, KEYS[c], [c + 1], KEYS[c - 1] if c else b"") for c in range(3)]
        # Chunk 0's state: the pool only; chunk 1's: no pool, so not stored; chunk 2's: every tier.
        offered = await node.call(events.StepEvent(2, 0, 1, states, [], skip_tiers=[DISK | CLUSTER, POOL, 0]))
        assert isinstance(offered, events.StepResult), offered
        assert isinstance(await node.call(events.StepEvent(3, 1, 2, [], [2])), events.StepResult)  # confirmed
        await node.on_disk(range(2, 3), group=1)
        assert node.cache.is_ready(node.key(0, 1)) and not node.on_disk_now(0, 1)
        assert not node.cache.is_ready(node.key(1, 1))
        assert node.counter("store_entries", outcome="store_tiers") == 1
        assert node.counter("tier_writes_left_out", tier="l2") == 1
    finally:
        node.close()


async def test_stores_the_pool_has_no_room_for_and_evictions_by_reason() -> None:
    node = Node(None, pool_bytes=2 << 20)  # one 2 MiB superblock: 256 entries of 8 KiB
    try:
        await node.register()
        n = (2 << 20) // ENTRY
        keys = chunk_keys(list(range(9000, 9000 + (n + 2) * CHUNK)), CHUNK)

        def item(c: int) -> kv.Item:  # blocks reused: the bytes do not matter here
            return kv.Item(0, c, keys[c], [2 * (c % 15) + 1, 2 * (c % 15) + 2], keys[c - 1] if c else b"")

        full = await node.call(kv.Store(2, [item(c) for c in range(n)]))
        assert isinstance(full, kv.StoreResult) and full.stored == n
        held = await node.call(kv.Lookup(3, keys[:n], True))  # a lease on every entry: none may be evicted
        assert isinstance(held, kv.LookupReply) and held.hit_chunks == n
        refused = await node.call(kv.Store(4, [item(n)]))
        assert isinstance(refused, kv.StoreResult) and (refused.stored, refused.dropped) == (0, 1)
        assert node.counter("store_entries", outcome="no_room") == 1
        assert node.counter("store_bytes", outcome="no_room") == ENTRY
        assert node.service.handle(node.conn, kv.Release(held.lease_id)) is None
        again = await node.call(kv.Store(5, [item(n), item(n + 1)]))
        assert isinstance(again, kv.StoreResult) and again.stored == 2
        status = node.service.status()
        assert status["index"]["evictions_by_reason"] == {"policy": 2}
        assert status["keeping"]["stores"] == {"stored": n + 2, "no_room": 1}
        assert status["keeping"]["hits_per_pool_byte"] == 0.0  # looked up, never retrieved
    finally:
        node.close()
