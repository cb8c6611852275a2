"""KV events in-process: numbering, batching, the ring, the ZMQ framing and replay, the announcer's media.

Every payload is decoded with vLLM's own classes (``vllm.distributed.kv_events``), so the format is
checked against the consumers' reading of it, not against our own encoder. Notes are checked against a
real vLLM ``Request``'s block hashes.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from hkvd.daemon.cache import Cache
from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.pool import PAGE, HugePagePool
from hkvd.daemon.engines.registry import EngineState
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.announcer import Announcer
from hkvd.daemon.routing.kv_events import (
    MEDIUM_CLUSTER,
    MEDIUM_DISK,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
)
from hkvd.daemon.routing.zmq_publisher import END_SEQ, ZmqPublisher
from hkvd.shim.kv_event_feed import EventFeed
from hkvd.shim.kv_event_notes import NoteMaker
from hkvd.shim.results import Completion
from hkvd.shim.testing.fake_daemon import FakeDaemon
from hkvd.transport.errors import OutOfRange
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.events import KVEvents
from hkvd.transport.wire.kv import Item

kv_events = pytest.importorskip("vllm.distributed.kv_events")
DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

FP0, FP1 = b"a" * 16, b"b" * 16
CHUNK, BLOCK = 32, 16


def decode(payload: bytes) -> Any:
    return DECODER.decode(payload)


def stored(hashes: list[Any], parent: Any, group: int = 0, medium: str = MEDIUM_POOL, tokens: int = 0) -> BlockStored:
    return BlockStored(list(hashes), parent, list(range(tokens or BLOCK * len(hashes))), BLOCK, None, medium, None,
                       [None] * len(hashes), group, "full_attention", None)


# ---- the log: numbering, batching, merging, the ring ------------------------------------------------------
def test_batches_are_numbered_from_zero_and_decode_as_vllms_classes() -> None:
    log = EventLog(8, clock=lambda: 12.5)
    log.add(FP0, b"t", stored([1, 2], None))
    log.add(FP0, b"t", BlockRemoved([7], MEDIUM_DISK, 1))
    log.add(b"", b"t", AllBlocksCleared())
    first = log.flush()
    log.add(FP1, b"u", stored([3], 2))
    second = log.flush()
    assert [b.seq for b in first + second] == [0, 1, 2] and log.next_seq == 3
    batch = decode(first[0].payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank is None
    s, r = batch.events
    assert isinstance(s, kv_events.BlockStored) and isinstance(r, kv_events.BlockRemoved)
    assert (s.block_hashes, s.parent_block_hash, s.block_size, s.medium, s.group_idx) == ([1, 2], None, BLOCK,
                                                                                         MEDIUM_POOL, 0)
    assert s.token_ids == list(range(2 * BLOCK)) and s.extra_keys == [None, None]
    assert s.kv_cache_spec_kind == "full_attention" and s.session_id is None and s.lora_name is None
    assert (r.block_hashes, r.medium, r.group_idx) == ([7], MEDIUM_DISK, 1)
    assert isinstance(decode(first[1].payload).events[0], kv_events.AllBlocksCleared)


def test_a_chain_of_stores_merges_per_group_and_medium_keeping_their_order() -> None:
    log = EventLog(8)
    # Two chunks of two groups, interleaved as the index turns them READY; a removal in between.
    for ev in (stored([1], None, 0), stored([1], None, 1), stored([2], 1, 0), stored([2], 1, 1),
               BlockRemoved([9], MEDIUM_POOL, 0), BlockRemoved([8], MEDIUM_POOL, 0), stored([5], 4, 0)):
        log.add(FP0, b"", ev)
    (batch,) = log.flush()
    got = [(type(e).__name__, e.group_idx, e.block_hashes) for e in decode(batch.payload).events]
    assert got == [("BlockStored", 0, [1, 2]), ("BlockRemoved", 0, [9, 8]), ("BlockStored", 0, [5]),
                   ("BlockStored", 1, [1, 2])]
    merged = decode(batch.payload).events[0]
    assert merged.token_ids == list(range(BLOCK)) * 2 and merged.extra_keys == [None, None]


def test_a_poller_gets_its_layouts_batches_from_a_sequence_number_and_counts_what_the_ring_lost() -> None:
    log = EventLog(4)
    for i in range(6):
        log.add(FP0 if i % 2 == 0 else FP1, b"", stored([i], None))
        log.flush()
    # Kept: 2, 3, 4, 5. FP0's are the even ones.
    ans = log.since(FP0, 0, 100)
    assert ans.lost == 2 and ans.next == 6 and [decode(p).events[0].block_hashes for p in ans.payloads] == [[2], [4]]
    ans = log.since(FP0, 5, 100)
    assert ans.lost == 0 and ans.next == 6 and ans.payloads == []
    ans = log.since(FP1, 3, 1)  # one batch at most (3); 4 is another layout's; the next poll starts at 5
    assert ans.next == 5 and len(ans.payloads) == 1
    ans = log.since(FP1, 5, 10)
    assert ans.next == 6 and [decode(p).events[0].block_hashes for p in ans.payloads] == [[5]]
    assert log.since(FP0, 99, 10).lost == 2  # a poller of an earlier run: read from the oldest kept


# ---- the ZMQ publisher: framing, replay, drops -------------------------------------------------------------
@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvev") as d:  # ipc paths must be short
        yield Path(d)


def test_pub_frames_are_topic_seq_payload_and_a_late_subscriber_replays_to_the_end_marker(ipc_dir: Path) -> None:
    pub = ZmqPublisher(f"ipc://{ipc_dir}/ev", f"ipc://{ipc_dir}/rp", buffer_batches=3)
    log = EventLog(16, sink=pub.submit)
    ctx = zmq.Context()
    try:
        pub.start()
        sub = ctx.socket(zmq.SUB)
        sub.connect(pub.bound)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        deadline = time.monotonic() + 10
        got: list[list[bytes]] = []
        i = 0
        while not got and time.monotonic() < deadline:  # PUB drops until the subscription is through
            log.add(FP0, b"topic", stored([i], None))
            log.flush()
            i += 1
            if sub.poll(100):
                got.append(sub.recv_multipart())
        topic, seq, payload = got[0]
        assert topic == b"topic" and len(seq) == 8
        assert decode(payload).events[0].block_hashes == [int.from_bytes(seq, "big")]
        for _ in range(3):
            log.add(FP0, b"topic", stored([i], None))
            log.flush()
            i += 1
        last = log.next_seq - 1
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_bound)
        dealer.send_multipart([b"", (last - 1).to_bytes(8, "big")])
        frames = [dealer.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in frames] == [last - 1, last, -1]
        assert frames[-1] == [b"", b"", END_SEQ, b""] and frames[0][1] == b"topic"
        assert decode(frames[1][3]).events[0].block_hashes == [last]
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # older than what is kept: the 3 kept
        kept = []
        while (f := dealer.recv_multipart())[2] != END_SEQ:
            kept.append(int.from_bytes(f[2], "big"))
        assert kept == [last - 2, last - 1, last]
        assert pub.statistics().replays == 2
    finally:
        pub.close(2.0)
        ctx.destroy(linger=0)


def test_submit_never_blocks_a_full_queue_drops_and_counts(ipc_dir: Path) -> None:
    pub = ZmqPublisher(f"ipc://{ipc_dir}/ev", queue_batches=2)
    log = EventLog(16, sink=pub.submit)
    for i in range(3):  # not started: the queue fills
        log.add(FP0, b"", stored([i], None))
        log.flush()
    assert pub.dropped == 1
    pub.start()
    try:
        deadline = time.monotonic() + 5
        while pub.statistics().sent < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.statistics().sent == 2
    finally:
        pub.close(2.0)
    other = EventLog(1)
    other.add(FP0, b"", stored([99], None))
    assert not pub.submit(other.flush()[0])  # closed: dropped
    assert pub.dropped == 2


# ---- the announcer: media, ranks, notes --------------------------------------------------------------------
class World:
    """A two-group (full + mamba) engine of ``ranks`` ranks over a real index."""

    def __init__(self, ranks: int = 1, pool_bytes: int = 4 << 20) -> None:
        self.pool = HugePagePool(pool_bytes, "off", superblock_bytes=2 << 20)
        self.index = Cache(self.pool, make_policy("lru"))
        self.log = EventLog(64)
        self.seen = 0
        self.disk: set[tuple[bytes, int, bytes]] = set()
        self.announcer = Announcer(self.index, self.log, Metrics(), topic="kv@{model}",
                                   disk=self.disk.__contains__, max_cluster_units=2)
        groups = [GroupSpec(0, "full", BLOCK, 0, 64, "bfloat16", (View(0, 0, 1, PAGE, PAGE, PAGE),)),
                  GroupSpec(1, "mamba", BLOCK, 0, 64, "bfloat16", (View(0, 0, 1, PAGE, PAGE, PAGE),))]
        spec = EngineSpec("m", ranks, 0, "t", CHUNK, BLOCK, 8192, "align", [], groups,
                          event_groups=[(0, "full_attention", None), (1, "mamba", None)])
        self.fps = tuple(bytes([i]) * 16 for i in range(ranks))
        self.engine = EngineState(1, 1, 1, spec, CHUNK, self.fps[0], {g.group_id: g for g in groups}, [],
                                  {0: 2 * PAGE, 1: PAGE}, {0: "full", 1: "mamba"}, rank_fingerprints=self.fps)
        self.announcer.register(self.engine)
        self.index._index.set_ranks(self.fps)

    def close(self) -> None:
        self.pool.close()

    def note(self, c: int) -> BlockNote:
        toks = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype="<u4").tobytes()
        return BlockNote(self.key(c), [10 * c + 1, 10 * c + 2], 10 * c - 8 if c else None, toks, None, None, None)

    @staticmethod
    def key(c: int) -> bytes:
        return c.to_bytes(16, "big")

    def write(self, c: int, group: int = 0, rank: int = 0, pending: bool = False) -> Any:
        note = self.note(c)
        self.announcer.check(self.engine, [note], [Item(group, c, note.key, [1])])
        noted = self.announcer.accept(self.engine, [note])
        e = self.index._index.begin_write((self.fps[rank], group, self.key(c)), (2 if group == 0 else 1) * PAGE,
                                   "full" if group == 0 else "mamba", 1)
        assert e is not None
        self.index._index.finish_write(e, pending=pending)
        self.announcer.settle(self.engine, noted)
        return e

    def events(self) -> list[Any]:
        """The events published since the last call (a write flushes its own)."""
        self.log.flush()
        batches = self.log.kept(self.seen)
        self.seen = self.log.next_seq
        return [ev for b in batches for ev in decode(b.payload).events]


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


def _summary(events: list[Any]) -> list[tuple[str, str | None, int | None, list[Any]]]:
    return [(type(e).__name__, getattr(e, "medium", None), getattr(e, "group_idx", None),
             getattr(e, "block_hashes", [])) for e in events]


def test_pool_entries_are_announced_when_ready_and_withdrawn_when_dropped(world: World) -> None:
    assert _summary(world.events()) == [("AllBlocksCleared", None, None, [])]  # the model's topic opens
    e0 = world.write(0)
    world.write(1)
    ev = world.events()  # two stores, two batches (a store's events go out before its reply)
    assert _summary(ev) == [("BlockStored", MEDIUM_POOL, 0, [1, 2]), ("BlockStored", MEDIUM_POOL, 0, [11, 12])]
    assert ev[0].token_ids == list(range(CHUNK)) and ev[0].parent_block_hash is None
    assert ev[1].token_ids == list(range(CHUNK, 2 * CHUNK)) and ev[1].parent_block_hash == 2
    world.index.drop(e0)
    assert _summary(world.events()) == [("BlockRemoved", MEDIUM_POOL, 0, [1, 2])]
    assert world.announcer.statistics().notes == 1  # chunk 0's note went with its last entry


def test_a_mamba_state_is_announced_on_confirmation_as_the_chunks_last_block(world: World) -> None:
    world.events()
    e = world.write(1, group=1, pending=True)
    assert world.events() == []
    assert world.index.confirm(e)
    (ev,) = world.events()
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.block_hashes, ev.parent_block_hash) == (1, "mamba", [12], 11)
    assert ev.token_ids == list(range(CHUNK + BLOCK, 2 * CHUNK))


def test_disk_and_cluster_are_media_of_their_own(world: World) -> None:
    world.events()
    e = world.write(0)
    key = (world.fps[0], 0, world.key(0))
    world.disk.add(key)
    world.announcer.tier_changed(MEDIUM_DISK, [key], True)
    world.announcer.tier_changed(MEDIUM_CLUSTER, [key], True)
    assert sorted(s[1] for s in _summary(world.events())) == sorted([MEDIUM_POOL, MEDIUM_DISK, MEDIUM_CLUSTER])
    world.index.drop(e)  # evicted from the pool, kept on disk and in the cluster
    assert _summary(world.events()) == [("BlockRemoved", MEDIUM_POOL, 0, [1, 2])]
    world.disk.discard(key)
    world.announcer.tier_changed(MEDIUM_DISK, [key], False)
    assert _summary(world.events()) == [("BlockRemoved", MEDIUM_DISK, 0, [1, 2])]
    assert world.announcer.statistics().notes == 1  # still announced in the cluster
    for c in (1, 2):  # two more units put in the cluster: over max_cluster_units, the oldest is withdrawn
        world.write(c)
        world.announcer.tier_changed(MEDIUM_CLUSTER, [(world.fps[0], 0, world.key(c))], True)
    assert ("BlockRemoved", MEDIUM_CLUSTER, 0, [1, 2]) in _summary(world.events())
    assert world.announcer.statistics().announced == {MEDIUM_POOL: 2, MEDIUM_DISK: 0, MEDIUM_CLUSTER: 2}


def test_tensor_parallel_chunks_are_announced_once_every_rank_holds_them() -> None:
    w = World(ranks=2)
    try:
        w.events()
        w.write(0, rank=0)
        assert w.events() == []
        e1 = w.write(0, rank=1)
        assert _summary(w.events()) == [("BlockStored", MEDIUM_POOL, 0, [1, 2])]
        w.index.drop(e1)  # one rank's entry gone: no hit any more
        assert _summary(w.events()) == [("BlockRemoved", MEDIUM_POOL, 0, [1, 2])]
    finally:
        w.close()


def test_notes_are_checked_against_the_engine_and_the_items(world: World) -> None:
    good = world.note(0)
    with pytest.raises(OutOfRange, match="no item"):
        world.announcer.check(world.engine, [good], [Item(0, 1, world.key(1), [1])])
    with pytest.raises(OutOfRange, match="tokens"):
        world.announcer.check(world.engine, [good._replace(tokens=good.tokens[:-4])], [Item(0, 0, good.key, [1])])
    with pytest.raises(OutOfRange, match="block hashes"):
        world.announcer.check(world.engine, [good._replace(hashes=[1])], [Item(0, 0, good.key, [1])])


def test_a_partial_chunk_is_announced_in_each_group_as_one_block_of_the_hash_unit(world: World) -> None:
    world.events()
    unit = BLOCK // 2
    key = b"p" * 16  # chunk 1's partial chunk ending at CHUNK + BLOCK + unit (one block and a half in)
    toks = np.arange(CHUNK + BLOCK, CHUNK + BLOCK + unit, dtype="<u4").tobytes()
    note = BlockNote(key, [77], 76, toks, None, None, None)
    items = [Item(0, 1, key, [1]), Item(1, 1, key, [2])]
    world.announcer.check(world.engine, [note], items)
    noted = world.announcer.accept(world.engine, [note])
    for group, nbytes, kind in ((0, 2 * PAGE, "full"), (1, PAGE, "mamba")):
        e = world.index._index.begin_write((world.fps[0], group, key), nbytes, kind, 1)
        assert e is not None
        world.index._index.finish_write(e, pending=False)
    world.announcer.settle(world.engine, noted)
    ev = world.events()
    assert sorted((e.group_idx, e.block_hashes[0], e.parent_block_hash, e.block_size, tuple(e.token_ids))
                  for e in ev) == [(g, 77, 76, unit, tuple(range(CHUNK + BLOCK, CHUNK + BLOCK + unit)))
                                   for g in (0, 1)]
    with pytest.raises(OutOfRange, match="does not divide"):  # a block of 5 tokens is no hash unit of 16
        world.announcer.check(world.engine, [note._replace(tokens=toks[:20])], items)


def test_a_chunk_without_a_note_is_never_announced_and_leaves_nothing_behind(world: World) -> None:
    world.events()
    e = world.index._index.begin_write((world.fps[0], 0, world.key(5)), 2 * PAGE, "full", 1)
    assert e is not None
    world.index._index.finish_write(e, pending=False)
    world.index.drop(e)
    assert world.events() == [] and world.announcer.statistics().notes == 0


# ---- notes from a real vLLM request ---------------------------------------------------------------------
def _request(tokens: list[int], salt: str | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@pytest.mark.parametrize("int_hashes", [True, False])
def test_a_note_carries_vllms_block_hashes_and_never_the_salt(monkeypatch: pytest.MonkeyPatch, int_hashes: bool
                                                              ) -> None:
    from vllm import envs
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setattr(envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    tokens = list(range(100, 100 + 3 * CHUNK))
    plain, salted = _request(tokens), _request(tokens, salt="tenant-a")
    maker = NoteMaker(BLOCK)
    n1 = maker.note(plain, b"k" * 16, 1, CHUNK)
    assert n1 is not None
    assert n1.hashes == [maybe_convert_block_hash(h) for h in plain.block_hashes[2:4]]
    assert n1.parent == maybe_convert_block_hash(plain.block_hashes[1])
    assert isinstance(n1.hashes[0], int if int_hashes else bytes)
    assert np.frombuffer(n1.tokens, "<u4").tolist() == tokens[CHUNK:2 * CHUNK] and n1.extra_keys is None
    s0 = maker.note(salted, b"k" * 16, 0, CHUNK)
    assert s0 is not None and s0.parent is None
    assert s0.hashes == [maybe_convert_block_hash(h) for h in salted.block_hashes[:2]]
    assert set(s0.hashes).isdisjoint(maybe_convert_block_hash(h) for h in plain.block_hashes)  # salted hashes
    assert s0.extra_keys is None  # the salt is the only extra key, and it is never sent
    assert maker.note(plain, b"k" * 16, 3, CHUNK) is None  # not hashed yet: no note


def test_a_partial_note_is_what_vllm_announces_for_its_own_partial_entry() -> None:
    """vLLM's block pool caches a block from a position inside it (``cache_partial_block``, as its Mamba
    checkpoints below the block size do) and announces it; hkvd's note for a partial chunk ending there
    names the same hash, parent and tokens, and its block size is the hash unit."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    unit = BLOCK // 4
    init_none_hash(sha256)
    tokens = list(range(200, 200 + 2 * CHUNK))
    req = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(unit, sha256))
    pool = BlockPool(8, True, unit, enable_kv_cache_events=True)
    end = CHUNK + BLOCK + 3 * unit  # inside chunk 1's second block
    (block,) = pool.get_new_blocks(1)
    pool.cache_partial_block(req, block, end, kv_cache_group_id=0, block_size=BLOCK)
    (theirs,) = [e for e in pool.take_events() if isinstance(e, kv_events.BlockStored)]
    maker = NoteMaker(BLOCK, unit)
    note = maker.partial_note(req, b"p" * 16, end)
    assert note is not None
    assert (note.hashes, note.parent) == (theirs.block_hashes, theirs.parent_block_hash)
    assert np.frombuffer(note.tokens, "<u4").tolist() == theirs.token_ids and theirs.block_size == unit
    # No vLLM hash ends between two multiples of the unit, nor anywhere without a unit below the block size.
    assert maker.partial_note(req, b"p" * 16, end - 1) is None
    assert NoteMaker(BLOCK).partial_note(req, b"p" * 16, end) is None
    assert maker.partial_skipped == 1


# ---- the connector's path: the scheduler side's feed ---------------------------------------------------------
def polls(daemon: FakeDaemon) -> list[int]:
    return [s[2] for s in daemon.kinds("events")]


def test_the_feed_hands_vllm_the_events_and_withdraws_a_gone_daemons() -> None:
    log = EventLog(8)
    log.add(FP0, b"", stored([1, 2], None))
    log.add(FP0, b"", BlockRemoved([1], MEDIUM_POOL, 0))
    log.add(FP0, b"", AllBlocksCleared())  # never in an engine's stream (it would clear vLLM's GPU blocks)
    (batch,) = log.flush()
    feed = EventFeed(interval_s=0)
    first = FakeDaemon(server_id="run-1")
    feed.maybe_poll(first)
    feed.maybe_poll(first)  # one poll in flight at most
    assert polls(first) == [0]
    assert not feed.on_completion(Completion(99, True, None, None))  # not the feed's
    assert feed.on_completion(Completion(1, True, KVEvents(1, 7, 0, [batch.payload]), None))
    got = feed.take()
    assert [type(e) for e in got] == [kv_events.BlockStored, kv_events.BlockRemoved]
    feed.maybe_poll(first)
    assert polls(first) == [0, 7]  # continues from the answer's next
    feed.maybe_poll(FakeDaemon(server_id="run-2"))  # the daemon restarted: its pool, and what it held, are gone
    (gone,) = feed.take()
    assert isinstance(gone, kv_events.BlockRemoved) and (gone.block_hashes, gone.medium) == ([2], MEDIUM_POOL)
