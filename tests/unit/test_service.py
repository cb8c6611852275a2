"""KVService in-process: what each message means, with a fake connection and no socket or subprocess.

The engine is this test process: its KV memory is a numpy buffer, registered as a host region, and
the host copy engine copies it with process_vm_readv/writev like any other engine's. Every reply
the service sends is captured from the connection. The subprocess suites (tests/e2e, tests/fault)
cover the same paths through a real socket; these run in milliseconds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.connection import Conn
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.in_process import in_process_service, own_conn
from hkvd.daemon.engines.service import KVService
from hkvd.daemon.tiers.contract import Source
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import CopyFailedError, ErrorCode, KVError, PagesInUse, ProtocolViolation
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire import Message, MsgType, control, events, kv
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.message import message_from_wire

PAGE = 4096
BLOCKS = 32
CHUNK = 32  # tokens: two blocks of 16
KEYS = chunk_keys(list(range(4 * CHUNK)), CHUNK)


class Engine:
    """A full-attention group and (optionally registered) a Mamba group in one host buffer of this process."""

    def __init__(self) -> None:
        self.mem = np.zeros(2 * BLOCKS * PAGE, dtype=np.uint8)
        self.groups = [GroupSpec(0, "full", 16, 0, BLOCKS, "bfloat16", (View(0, 0, 1, PAGE, PAGE, PAGE),)),
                       GroupSpec(1, "mamba", 16, 0, BLOCKS, "bfloat16",
                                 (View(0, BLOCKS * PAGE, 1, PAGE, PAGE, PAGE),))]

    def spec(self, mamba: bool) -> EngineSpec:
        return EngineSpec("m", 1, 0, "t", CHUNK, 16, 8192, "align",
                          [Region(0, "host", self.mem.nbytes, addr=self.mem.ctypes.data)],
                          self.groups if mamba else self.groups[:1])

    def block(self, group: int, b: int) -> np.ndarray:
        return self.mem[(group * BLOCKS + b) * PAGE:(group * BLOCKS + b + 1) * PAGE]


class Harness:
    def __init__(self, service: KVService, conn: Conn, sent: list[Message]) -> None:
        self.service, self.conn, self.sent = service, conn, sent
        self.engine = Engine()

    async def call(self, msg: Message) -> Message:
        """Serve ``msg`` as the server would and return the one reply it produced."""
        before = len(self.sent)
        try:
            job = self.service.handle(self.conn, msg)
            if job is not None:
                await job
        except KVError as e:
            self.conn.send(kv.Error(getattr(msg, "req_id", 0), int(e.code), e.message))
        replies = self.sent[before:]
        assert len(replies) == 1, replies
        return replies[0]

    async def register(self, mamba: bool = False) -> control.RegisterAck:
        ack = await self.call(control.Register(1, self.engine.spec(mamba).to_wire()))
        assert isinstance(ack, control.RegisterAck), ack
        return ack


@contextlib.contextmanager
def _harness(make_engine: Callable[[HugePagePool], HostCopyEngine] = HostCopyEngine,
             threads: int = 2, tier: Any = None) -> Iterator[Harness]:
    """A service over a 64 MiB pool, the copy engine ``make_engine`` builds, and this process as its engine;
    ``tier``: a lower tier, in the cluster tier's place."""
    cfg = DaemonConfig(chunk_size=CHUNK, l1_size_bytes=64 << 20, hugepages="off")
    with in_process_service(cfg, make_engine, threads, cluster=tier) as parts:
        if tier is not None:
            tier.pool = parts.pool
        sent: list[Message] = []
        conn = own_conn(sent)
        try:
            yield Harness(parts.service, conn, sent)
        finally:
            parts.service.disconnect(conn)


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    with _harness() as harness:
        yield harness


def _full(chunks: range, first_block: int) -> list[kv.Item]:
    return [kv.Item(0, c, KEYS[c], [first_block + 2 * i, first_block + 2 * i + 1]) for i, c in enumerate(chunks)]


async def test_store_lookup_retrieve_round_trip(h: Harness) -> None:
    await h.register()
    src = [b for it in _full(range(3), 1) for b in it[3]]
    for b in src:
        h.engine.block(0, b)[:] = np.random.default_rng(b).integers(0, 256, PAGE, dtype=np.uint8)
    done = await h.call(kv.Store(2, _full(range(3), 1)))
    assert done == kv.StoreResult(2, 6 * PAGE, 3, 0, 0, 0)
    reply = await h.call(kv.Lookup(3, KEYS, True))
    assert isinstance(reply, kv.LookupReply) and reply.hit_chunks == 3 and reply.lease_id
    dst = _full(range(3), 11)
    done = await h.call(kv.Retrieve(4, reply.lease_id, dst))
    # No CUDA event from a host engine; the daemon's own time for the retrieve paces the worker's waits.
    assert isinstance(done, kv.RetrieveResult) and (done.req_id, done.entries, done.event) == (4, 3, b"")
    assert 0 < done.seconds < 60
    assert len(done.to_wire()) == 1 + 5  # the type, then req_id, nbytes, entries, event (empty) and seconds
    for s, d in zip(src, [b for it in dst for b in it[3]], strict=True):
        assert bytes(h.engine.block(0, d)) == bytes(h.engine.block(0, s))


async def test_a_lease_watch_hears_every_retrieve_written_or_the_lease_end(h: Harness) -> None:
    assert (await h.register()).lease_watch
    await h.call(kv.Store(2, _full(range(3), 1)))
    reply = await h.call(kv.Lookup(3, KEYS, True))
    assert isinstance(reply, kv.LookupReply)
    assert h.service.handle(h.conn, kv.WatchLease(5, reply.lease_id)) is None
    before = len(h.sent)
    job = h.service.handle(h.conn, kv.Retrieve(4, reply.lease_id, _full(range(3), 11)))
    assert job is not None and len(h.sent) == before  # nothing is answered before the copy is over
    await job
    # The retrieve's own reply first, then the watch's: every byte is in the engine's blocks.
    assert [(type(m).__name__, m.req_id) for m in h.sent[before:]] == [("RetrieveResult", 4), ("LeaseWritten", 5)]
    again = await h.call(kv.Lookup(6, KEYS, True))
    assert isinstance(again, kv.LookupReply)
    other = own_conn(h.sent, conn_id=2)
    other.engine = h.conn.engine
    with pytest.raises(KVError) as e:
        h.service.handle(other, kv.WatchLease(7, again.lease_id))
    assert e.value.code is ErrorCode.PERMISSION
    h.service.handle(h.conn, kv.WatchLease(8, again.lease_id))
    before = len(h.sent)
    assert await h.call(kv.Release(again.lease_id)) == kv.Error(8, int(ErrorCode.LEASE_EXPIRED), (
        f"lease {again.lease_id} ended before every rank's retrieve wrote its blocks"))
    assert len(h.sent) == before + 1


async def test_a_mamba_state_counts_only_once_its_engine_confirms_it(h: Harness) -> None:
    await h.register(mamba=True)
    await h.call(kv.Store(2, _full(range(2), 1)))
    offer = [kv.Item(1, 1, KEYS[1], [5])]  # the state after chunk 1
    done = await h.call(events.StepEvent(3, 0, 1, offer, []))
    assert done == events.StepResult(3, PAGE, "accept", 1, 0, 0, 0)
    miss = await h.call(kv.Lookup(4, KEYS[:2], False))
    assert isinstance(miss, kv.LookupReply) and miss.hit_chunks == 0  # unconfirmed: not servable
    confirm = await h.call(events.StepEvent(5, 1, 2, [], [3]))  # the next step confirms job 3
    assert confirm == events.StepResult(5, 0, "accept")
    assert confirm.to_wire() == [int(MsgType.STEP_RESULT), 5, 0, "accept"]  # no offers: no counts
    hit = await h.call(kv.Lookup(6, KEYS[:2], False))
    assert isinstance(hit, kv.LookupReply) and hit.hit_chunks == 2


async def test_a_lookups_tails_extend_its_whole_chunk_hit_by_the_first_partial_chunk_held(h: Harness) -> None:
    """Lookup.tails: the daemon tries each [chunk_index, key] at the chunk where the whole-chunk hit ends, in
    the order sent, and extends the hit by the first whose every group's entry it serves; the reply names it
    and the lease covers it. A tail at another chunk, or one only partly held, is passed over."""
    ack = await h.register(mamba=True)
    assert ack.lookup_tails and ack.partial_notes
    tail, loose, other = (bytes([i]) * 16 for i in (7, 8, 9))
    h.engine.block(0, 5)[:] = 5  # the tail's attention page and state, as stored
    h.engine.block(1, 10)[:] = 10
    await h.call(kv.Store(2, [*_full(range(2), 1), kv.Item(0, 2, tail, [5, 6], KEYS[1]),
                              kv.Item(0, 2, loose, [7, 8], KEYS[1])]))
    await h.call(events.StepEvent(3, 0, 1, [kv.Item(1, 1, KEYS[1], [9]), kv.Item(1, 2, tail, [10], KEYS[1])], []))
    await h.call(events.StepEvent(4, 1, 2, [], [3]))  # confirmed: chunk 1's state and the tail's
    for msg_id, tails, want in [(5, [[2, loose], [2, tail]], (3, 2)),  # loose: attention only, no state
                                (6, [[1, tail], [2, other]], (2, 0)),  # at chunk 1: the hit ends at 2
                                (7, [], (2, 0))]:
        reply = await h.call(kv.Lookup(msg_id, KEYS[:2], True, tails))
        assert isinstance(reply, kv.LookupReply) and (reply.hit_chunks, reply.tail) == want, (tails, reply)
        assert message_from_wire(reply.to_wire()) == reply
        if reply.tail:  # the lease serves the tail's entries under its own key
            dst = [*_full(range(2), 21), kv.Item(0, 2, tail, [25, 26], KEYS[1]), kv.Item(1, 2, tail, [27])]
            done = await h.call(kv.Retrieve(8, reply.lease_id, dst))
            assert isinstance(done, kv.RetrieveResult), done
            assert bytes(h.engine.block(0, 25)) == bytes(h.engine.block(0, 5))
            assert bytes(h.engine.block(1, 27)) == bytes(h.engine.block(1, 10))
        elif reply.lease_id:
            assert h.service.handle(h.conn, kv.Release(reply.lease_id)) is None


async def test_a_tail_past_the_whole_chunk_hit_serves_where_only_a_mamba_state_was_missing(h: Harness) -> None:
    """The whole chunks stop at 1 (no state after chunk 1, as with vLLM's default retention); a turn end inside
    chunk 2 carries its own state, so with chunks 0 and 1's attention it serves 3 chunks."""
    await h.register(mamba=True)
    tail = b"\x07" * 16
    await h.call(kv.Store(2, [*_full(range(2), 1), kv.Item(0, 2, tail, [5, 6], KEYS[1])]))
    await h.call(events.StepEvent(3, 0, 1, [kv.Item(1, 0, KEYS[0], [9]), kv.Item(1, 2, tail, [10], KEYS[1])], []))
    await h.call(events.StepEvent(4, 1, 2, [], [3]))
    assert (await h.call(kv.Lookup(5, KEYS[:2], False))).hit_chunks == 1
    reply = await h.call(kv.Lookup(6, KEYS[:2], False, [[2, tail]]))
    assert isinstance(reply, kv.LookupReply) and (reply.hit_chunks, reply.tail) == (3, 1), reply


async def test_a_turn_end_one_engine_stored_is_named_in_another_lookups_reply(h: Harness) -> None:
    """Store.turn_end: the daemon remembers where a turn-end state ends, by the whole chunk before it, and a
    lookup that asks (Lookup.ends) and whose tails won nothing gets it back ([chunk_index, offset]) for chunks
    from where its hit ends to its last key; then its tail at that position serves."""
    ack = await h.register(mamba=True)
    assert ack.turn_ends
    tail = b"\x07" * 16
    await h.call(kv.Store(2, _full(range(2), 1)))
    await h.call(events.StepEvent(3, 0, 1, [kv.Item(1, 1, KEYS[1], [9])], []))
    await h.call(events.StepEvent(4, 1, 2, [], [3]))
    end = [kv.Item(0, 2, tail, [5, 6], KEYS[1]), kv.Item(1, 2, tail, [10], KEYS[1])]
    assert isinstance(await h.call(kv.Store(5, end, turn_end=7)), kv.StoreResult)
    await h.call(kv.Store(6, [kv.Item(0, 0, b"\x08" * 16, [11, 12])], turn_end=3))  # one inside chunk 0
    reply = await h.call(kv.Lookup(7, KEYS[:2], False, [], True))
    assert isinstance(reply, kv.LookupReply) and (reply.hit_chunks, reply.tail, reply.ends) == (2, 0, [[2, 7]])
    assert message_from_wire(reply.to_wire()) == reply
    assert (await h.call(kv.Lookup(8, KEYS[:2], False))).ends == []  # not asked: none (an older client)
    # No state after chunk 0: no hit, and the turn end inside chunk 0 (after the root) is named too.
    assert (await h.call(kv.Lookup(9, KEYS[:1], False, [], True))).ends == [[0, 3]]
    short = await h.call(kv.Lookup(10, KEYS[:2], False, [[2, b"\x09" * 16]], True))
    assert short.ends == [[2, 7]]  # the tail sent was another position: still named
    won = await h.call(kv.Lookup(11, KEYS[:2], False, [[2, tail]], True))
    assert (won.hit_chunks, won.tail, won.ends) == (3, 1, [])  # a tail won: nothing to add
    two = [kv.Item(0, 2, tail, [5, 6], KEYS[1]), kv.Item(0, 3, tail, [7, 8], KEYS[2])]  # not one partial chunk
    for req_id, items, off in ((12, two, 7), (13, end, CHUNK)):  # and one past the chunk
        refused = await h.call(kv.Store(req_id, items, turn_end=off))
        assert isinstance(refused, kv.Error) and "turn_end" in refused.message, refused
    assert (await h.call(kv.Lookup(16, KEYS[:2], False, [], True))).ends == [[2, 7]]  # nothing else learnt
    # An engine of another layout (attention only) shares no entries, so it is named no turn end.
    h.conn = own_conn(h.sent, conn_id=2)
    await h.register(mamba=False)
    assert (await h.call(kv.Lookup(17, KEYS[:2], False, [], True))).ends == []
    with pytest.raises(ProtocolViolation, match="turn_end"):
        message_from_wire(kv.Store(14, end, turn_end=-1).to_wire())
    for bad in ([[1]], [[1, 0]], [[-1, 3]], [[1, 3]] * (kv.MAX_ENDS + 1)):
        with pytest.raises(ProtocolViolation, match="ends"):
            message_from_wire(kv.LookupReply(15, 0, 0, 1.0, 0, bad).to_wire())


class HeldTier:
    """A lower tier holding ``payloads`` by entry key, read into the pool pages it is given."""

    name, label, budget_s, read_threads = "cluster", "test tier", 5.0, 1

    def __init__(self) -> None:
        self.payloads: dict[tuple[bytes, int, bytes], bytes] = {}
        self.executor = ThreadPoolExecutor(1)
        self.pool: HugePagePool | None = None

    def usable(self) -> bool:
        return True

    async def holds(self, keys: Any) -> set[Any]:
        return {k for k in keys if k in self.payloads}

    def source(self, key: Any, nbytes: int, kind: str, parent: bytes) -> Any:
        return Source(self.payloads[key], parent)

    def offer(self, *args: Any) -> bool:
        return False

    def statistics(self) -> dict[str, int]:
        return {}

    def read_batch(self, jobs: Any) -> list[BaseException | None]:
        assert self.pool is not None
        for _, data, extents in jobs:
            at = 0
            for off, length in extents:
                self.pool.buffer[off:off + length] = data[at:at + length]
                at += length
        return [None] * len(jobs)


async def test_a_lookups_tail_only_a_lower_tier_holds_is_read_into_the_pool_and_served() -> None:
    tier = HeldTier()
    with _harness(tier=tier) as h:
        await h.register(mamba=True)
        await h.call(kv.Store(2, _full(range(2), 1)))
        await h.call(events.StepEvent(3, 0, 1, [kv.Item(1, 1, KEYS[1], [9])], []))
        await h.call(events.StepEvent(4, 1, 2, [], [3]))
        tail = b"\x07" * 16
        fp = h.conn.engine.rank_fingerprints[0]
        tier.payloads = {(fp, 0, tail): b"\x05" * (2 * PAGE), (fp, 1, tail): b"\x06" * PAGE}
        reply = await h.call(kv.Lookup(5, KEYS[:2], True, [[2, b"\x08" * 16], [2, tail]]))
        assert isinstance(reply, kv.LookupReply) and (reply.hit_chunks, reply.tail) == (3, 2), reply
        dst = [*_full(range(2), 21), kv.Item(0, 2, tail, [25, 26], KEYS[1]), kv.Item(1, 2, tail, [27])]
        assert isinstance(await h.call(kv.Retrieve(6, reply.lease_id, dst)), kv.RetrieveResult)
        assert bytes(h.engine.block(0, 25)) == b"\x05" * PAGE and bytes(h.engine.block(1, 27)) == b"\x06" * PAGE
        tier.executor.shutdown()


def test_a_lookups_tails_are_checked_and_an_older_lookup_still_parses() -> None:
    key = b"\1" * 16
    msg = kv.Lookup(3, KEYS[:2], True, [[2, key], [1, key]])
    assert message_from_wire(msg.to_wire()) == msg
    assert message_from_wire(kv.Lookup(3, KEYS[:2], True).to_wire()) == kv.Lookup(3, KEYS[:2], True, [])
    assert len(kv.Lookup(3, KEYS[:2], True).to_wire()) == 4  # no tails: not sent, as an older client sends
    for bad in ([[3, key]], [[-1, key]], [[1, b"x"]], [[1]], [[True, key]], [[1, key]] * (kv.MAX_TAILS + 1)):
        with pytest.raises(ProtocolViolation, match="tail"):
            message_from_wire(kv.Lookup(3, KEYS[:2], True, bad).to_wire())


async def test_a_step_events_states_count_against_each_offers_tenant(h: Harness) -> None:
    """Mamba states offered in one step by requests of two tenants: each counts against its own (StepEvent.tenants);
    a step event without tenants counts its states as the unsalted share's, as an older client's do."""
    ack = await h.register(mamba=True)
    assert ack.step_tenants
    offers = [kv.Item(1, 1, KEYS[1], [5]), kv.Item(1, 2, KEYS[2], [6])]
    done = await h.call(events.StepEvent(3, 0, 1, offers, [], tenants=["salt:ab", "salt:cd"]))
    assert isinstance(done, events.StepResult) and done.stored == 2
    assert h.service.status()["tenants"]["bytes"] == {"salt:ab": PAGE, "salt:cd": PAGE}
    done = await h.call(events.StepEvent(4, 1, 2, [kv.Item(1, 3, KEYS[3], [7])], [3]))
    assert isinstance(done, events.StepResult) and done.stored == 1
    assert h.service.status()["tenants"]["bytes"] == {"salt:ab": PAGE, "salt:cd": PAGE, "": PAGE}


def test_a_step_event_names_a_tenant_per_offer_or_none() -> None:
    offers = [kv.Item(1, 1, KEYS[1], [5]), kv.Item(1, 2, KEYS[2], [6])]
    msg = events.StepEvent(3, 0, 1, offers, [], tenants=["salt:ab", ""])
    assert message_from_wire(msg.to_wire()) == msg
    with pytest.raises(ProtocolViolation, match="one per offer"):
        events.StepEvent(3, 0, 1, offers, [], tenants=["salt:ab"]).validate()
    with pytest.raises(ProtocolViolation, match="tenant label"):
        events.StepEvent(3, 0, 1, offers, [], tenants=["a b", ""]).validate()


@pytest.mark.parametrize(("registered", "msg", "code"), [
    (False, kv.Store(2, _full(range(1), 1)), ErrorCode.NOT_REGISTERED),
    (True, kv.Store(2, [kv.Item(0, 0, KEYS[0], [BLOCKS - 1, BLOCKS])]), ErrorCode.OUT_OF_RANGE),
    (True, kv.Store(2, [kv.Item(0, 0, KEYS[0], [0, 1])]), ErrorCode.OUT_OF_RANGE),  # vLLM's null block
    (True, kv.Retrieve(2, 12345, _full(range(1), 1)), ErrorCode.LEASE_EXPIRED),
    (True, kv.Store(2, [kv.Item(7, 0, KEYS[0], [1, 2])]), ErrorCode.OUT_OF_RANGE),  # no group 7
])
async def test_bad_requests_get_typed_errors_and_change_nothing(h: Harness, registered: bool, msg: Message,
                                                                code: ErrorCode) -> None:
    if registered:
        await h.register()
    reply = await h.call(msg)
    assert isinstance(reply, kv.Error) and reply.code == code, reply
    assert h.service.index.statistics().entries == 0


async def test_disconnect_releases_leases_and_the_registration(h: Harness) -> None:
    await h.register()
    await h.call(kv.Store(2, _full(range(2), 1)))
    reply = await h.call(kv.Lookup(3, KEYS[:2], True))
    assert isinstance(reply, kv.LookupReply) and h.service.index.statistics().leases == 1
    h.service.disconnect(h.conn)
    assert h.service.index.statistics().leases == 0 and h.service.registry.engines() == []
    assert isinstance(await h.call(kv.Abort(9)), kv.AbortAck)  # still answered after the engine went


async def test_per_engine_counters_and_latency_histograms_reach_status_and_metrics(h: Harness) -> None:
    """Lookup tokens and bytes by (model, rank), and one latency observation per request, in the status JSON and
    in the /metrics text prometheus-client renders and parses back (histogram: _bucket{le}, _sum, _count)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hkvd.daemon.http import build_registry

    await h.register()
    await h.call(kv.Store(2, _full(range(3), 1)))
    reply = await h.call(kv.Lookup(3, KEYS, True))  # 4 chunks asked, 3 held
    assert isinstance(reply, kv.LookupReply) and reply.hit_chunks == 3
    await h.call(kv.Retrieve(4, reply.lease_id, _full(range(2), 11)))
    bad = await h.call(kv.Retrieve(5, 0, [kv.Item(0, 3, KEYS[3], [20, 21])]))  # not held: an error, timed too
    assert isinstance(bad, kv.Error)
    h.service.disconnect(h.conn)  # the engine leaves; its counters stay
    status = h.service.status()
    assert status["engine_traffic"]["engines"] == [{
        "model": "m", "rank": "0", "lookup_hit_tokens": 3 * CHUNK, "lookup_miss_tokens": CHUNK,
        "stored_bytes": 6 * PAGE, "retrieved_bytes": 4 * PAGE}]
    lat = status["latency"]
    assert (lat["lookup"]["count"], lat["store"]["count"], lat["retrieve"]["count"]) == (1, 1, 2)
    assert lat["retrieve"]["counts"][-1] == 2 and lat["retrieve"]["sum_seconds"] > 0

    registry = build_registry(lambda: h.service.statistics())
    got = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = (fam.type, s.value)
    engine = (("model", "m"), ("rank", "0"))
    assert got[("hkvd_engine_lookup_hit_tokens_total", engine)] == ("counter", 3 * CHUNK)
    assert got[("hkvd_engine_lookup_miss_tokens_total", engine)] == ("counter", CHUNK)
    assert got[("hkvd_engine_stored_bytes_total", engine)] == ("counter", 6 * PAGE)
    assert got[("hkvd_engine_retrieved_bytes_total", engine)] == ("counter", 4 * PAGE)
    assert got[("hkvd_request_duration_seconds_count", (("op", "retrieve"),))] == ("histogram", 2)
    assert got[("hkvd_request_duration_seconds_bucket", (("le", "+Inf"), ("op", "store")))] == ("histogram", 1)
    assert got[("hkvd_request_duration_seconds_bucket", (("le", "10.0"), ("op", "lookup")))] == ("histogram", 1)
    assert got[("hkvd_request_duration_seconds_sum", (("op", "lookup"),))][1] > 0


async def test_a_step_events_copy_never_waits_behind_bulk_copies() -> None:
    """Mamba states are due within two engine steps; a load or store on every copy thread must not hold
    them. The bulk thread is held here until the step event's copy has been answered."""
    import asyncio
    import threading

    cfg = DaemonConfig(chunk_size=CHUNK, l1_size_bytes=64 << 20, hugepages="off")
    with in_process_service(cfg, threads=1, step_threads=1) as parts:
        parts.copy_engine.inline_max_bytes = 0  # every copy on a thread, as large ones are
        sent: list[Message] = []
        h = Harness(parts.service, own_conn(sent), sent)
        release = threading.Event()
        busy = parts.executor.submit(release.wait, 10.0)  # a long load on the only bulk copy thread
        try:
            await h.register(mamba=True)
            done = await asyncio.wait_for(h.call(events.StepEvent(3, 0, 1, [kv.Item(1, 1, KEYS[1], [5])], [])), 5.0)
            assert isinstance(done, events.StepResult) and done.nbytes == PAGE
            assert not busy.done()  # answered while the bulk thread was still held
        finally:
            release.set()
            parts.service.disconnect(h.conn)


class _HeldCopies(HostCopyEngine):
    """The host engine, but every copy fails as a GPU copy that timed out after it was enqueued: the GPU
    may still run it until ``gpu_done`` (a stand-in for the CUDA engine's ``PagesInUse``)."""

    def __init__(self, pool: HugePagePool) -> None:
        super().__init__(pool)
        self.pool = pool
        self.inline_max_bytes = 0
        self.gpu_done = threading.Event()
        self._when_free: list[Any] = []

    def _add(self, fn: Any) -> None:
        if self.gpu_done.is_set():
            fn()
        else:
            self._when_free.append(fn)

    def finish(self) -> None:
        self.gpu_done.set()
        for fn in self._when_free:
            fn()

    def copy_ordered(self, attachment: Any, segments: Any, direction: Any, *, wait_event: Any = None) -> Any:
        err = CopyFailedError("timed out on the GPU")
        err.pages_in_use = PagesInUse(self.gpu_done, self._add)  # type: ignore[attr-defined]
        raise err


async def test_a_failed_copy_the_gpu_may_still_run_keeps_its_pages_until_it_has() -> None:
    import asyncio

    with _harness(_HeldCopies, threads=1) as h:
        copy_engine = h.service.registry.copy_engine
        assert isinstance(copy_engine, _HeldCopies)
        index, pool = h.service.index, copy_engine.pool
        await h.register()
        reply = await h.call(kv.Store(2, _full(range(2), 1)))
        assert isinstance(reply, kv.Error) and reply.code == ErrorCode.COPY_FAILED
        # The store failed, but the GPU may still write its pages: they stay allocated, never served.
        assert index.statistics().writing == 2 and pool.allocator.statistics().used_bytes > 0
        lookup = await h.call(kv.Lookup(3, KEYS, True))
        assert isinstance(lookup, kv.LookupReply) and lookup.hit_chunks == 0
        copy_engine.finish()  # the GPU ran it (on the copy engine's completion thread, here this one)
        for _ in range(3):
            await asyncio.sleep(0)
        assert index.statistics().writing == 0 and pool.allocator.statistics().used_bytes == 0


async def test_pins_unpins_and_tenants_through_the_service(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    assert h.service.handle(h.conn, kv.Pin("early", "", 60.0, KEYS[:1])) is None  # before Register: logged only
    assert "before its connection registered" in caplog.text and not h.sent
    assert (await h.register()).pins
    done = await h.call(kv.Store(2, _full(range(3), 1), tenant="salt:ab"))
    assert isinstance(done, kv.StoreResult) and done.stored == 3
    assert h.service.handle(h.conn, kv.Pin("s1", "salt:ab", 60.0, KEYS[:3])) is None
    st = h.service.status()
    assert st["pins"]["pinned_bytes"] == 3 * 2 * PAGE and st["pins"]["sessions"] == 1
    assert st["pins"]["longest"][0]["session"] == "s1" and st["pins"]["longest"][0]["tenant"] == "salt:ab"
    assert st["tenants"]["bytes"] == {"salt:ab": 3 * 2 * PAGE}
    done = await h.call(control.Unpin(3, "s1"))
    assert done == control.Unpinned(3, 1)
    assert h.service.status()["pins"]["lapsed"]["unpin"] == 1
    h.service.shutting_down = True  # a Pin while shutting down is ignored, not an error for the connection
    assert h.service.handle(h.conn, kv.Pin("late", "", 60.0, KEYS[:1])) is None
    assert h.service.status()["pins"]["sessions"] == 0
