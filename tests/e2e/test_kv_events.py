"""KV events end to end: a real ``hkvd serve`` publishing, synthetic engines storing, subscribers reading.

Each subscriber decodes with vLLM's own classes (``vllm.distributed.kv_events``), as a router's
indexer does. The synthetic engine's notes stand in for vLLM's block hashes (real vLLM:
tests/shim/test_kv_events_vllm.py).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, block_notes, prompt_tokens
from hkvd.transport.errors import OutOfRange
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.control import KV_EVENTS_PUBLISHED

kv_events = pytest.importorskip("vllm.distributed.kv_events")
DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
END = (-1).to_bytes(8, "big", signed=True)
CHUNK = 32  # the daemon fixture's chunk size: two blocks of 16


@pytest.fixture
def ipc() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvev") as d:  # ipc paths must be short
        yield Path(d)


class Subscriber:
    """A SUB on the daemon's events and a DEALER on its replay socket."""

    def __init__(self, ipc: Path) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"ipc://{ipc}/ev")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.replay_endpoint = f"ipc://{ipc}/rp"

    def live(self, until: Any, timeout_s: float = 10.0) -> list[tuple[int, bytes, Any]]:
        """(seq, topic, batch) as they arrive, until ``until(events so far)`` holds."""
        got: list[tuple[int, bytes, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not until([e for *_, b in got for e in b.events]):
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                got.append((int.from_bytes(seq, "big"), topic, DECODER.decode(payload)))
        return got

    def replay(self, start: int = 0) -> list[tuple[int, bytes, Any]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END:
                break
            out.append((int.from_bytes(seq, "big"), topic, DECODER.decode(payload)))
        dealer.close(linger=0)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def serve(daemon_factory: Any, ipc: Path, *args: str) -> Any:
    return daemon_factory("--chunk-size", str(CHUNK), "--kv-events-endpoint", f"ipc://{ipc}/ev",
                          "--kv-events-replay-endpoint", f"ipc://{ipc}/rp", "--kv-events-topic", "kv@node@{model}",
                          *args)


def engine(d: Any, page: int = 4096, **kw: Any) -> SyntheticEngine:
    return SyntheticEngine(d.socket_path, [GroupShape("full", 2, page)], num_blocks=kw.pop("num_blocks", 64), **kw)


def events_of(batches: list[tuple[int, bytes, Any]], kind: type | None = None, medium: str | None = None) -> list[Any]:
    return [e for *_, b in batches for e in b.events
            if (kind is None or isinstance(e, kind)) and (medium is None or getattr(e, "medium", None) == medium)]


def hashes(events: list[Any]) -> list[Any]:
    return [h for e in events for h in e.block_hashes]


def test_stores_are_announced_under_the_notes_hashes_and_a_late_subscriber_catches_up(daemon_factory, ipc):
    d = serve(daemon_factory, ipc, "--l1-size-gb", "0.125")
    eng = engine(d, model="tiny/model")
    assert eng.ack.kv_events == KV_EVENTS_PUBLISHED
    toks = prompt_tokens(CHUNK * 6, seed=1)
    keys = chunk_keys(toks, CHUNK)
    notes = block_notes(keys, toks, CHUNK, 16)
    eng.store(eng.items(0, keys[:3], 1), notes[:3])  # before anyone subscribed
    eng.store(eng.items(0, keys, 1, chunks=range(3, 6)), notes[3:])
    sub = Subscriber(ipc)
    try:
        late = sub.replay(0)
        seqs = [s for s, *_ in late]
        assert seqs == list(range(len(late))) and len(late) >= 3  # every batch since start, in order
        assert isinstance(late[0][2].events[0], kv_events.AllBlocksCleared)  # the topic opened: a new daemon run
        assert {t for _, t, _ in late} == {b"kv@node@tiny/model"}
        stored = events_of(late, kv_events.BlockStored)
        assert hashes(stored) == [h for n in notes for h in n.hashes]
        first = stored[0]
        assert first.parent_block_hash is None and first.block_size == 16 and first.medium == "HKVD_POOL"
        assert first.group_idx == 0 and first.kv_cache_spec_kind == "full_attention"
        assert first.token_ids == toks[:len(first.block_hashes) * 16]
        assert first.extra_keys == [None] * len(first.block_hashes)
        # Live: the next store reaches the subscriber as the batch after the replayed ones.
        time.sleep(0.5)  # ZMQ's PUB sends to a subscriber only once its subscription arrived
        more = prompt_tokens(CHUNK * 2, seed=2)
        mkeys = chunk_keys(more, CHUNK)
        mnotes = block_notes(mkeys, more, CHUNK, 16)
        eng.store(eng.items(0, mkeys, 40), mnotes)
        want = [h for n in mnotes for h in n.hashes]
        got = [b for b in sub.live(lambda evs: set(want) <= set(hashes(evs))) if b[0] > seqs[-1]]
        assert got and got[0][0] == seqs[-1] + 1  # nothing missing between the replay and the live stream
        assert hashes(events_of(got)) == want
        assert sub.replay(got[0][0])[0][0] == got[0][0]  # replay from a number starts there
        eng.close()
        d.stop()  # the pool goes with the daemon: the topic is cleared
        bye = sub.live(lambda evs: any(isinstance(e, kv_events.AllBlocksCleared) for e in evs))
        assert [type(e).__name__ for e in events_of(bye)] == ["AllBlocksCleared"]
        assert bye[0][0] == got[-1][0] + 1 and bye[0][1] == b"kv@node@tiny/model"
    finally:
        sub.close()
        eng.close()


def store_one_by_one(d: Any, eng: SyntheticEngine, seed: int, n: int, *, disk: bool = False) -> list[Any]:
    """Store ``n`` chunks, one per store, all from blocks 1-2; with ``disk``, each once it is written there.
    Returns their notes."""
    toks = prompt_tokens(CHUNK * n, seed=seed)
    keys = chunk_keys(toks, CHUNK)
    notes = block_notes(keys, toks, CHUNK, 16)
    writes = d.status()["l2"]["writes"] if disk else 0
    for c in range(n):
        eng.store(eng.items(0, keys, 1 - 2 * c, chunks=[c]), notes[c:c + 1])
        if disk:  # the write-behind queue holds few 1 MiB entries: never let it drop one
            d.wait_status(lambda s, w=writes + c + 1: s["l2"]["writes"] >= w, timeout_s=20)
    return notes


# 32 MiB pool of 1 MiB entries (2 blocks x 2 layers x 256 KiB): about 30 fit.
POOL = ("--l1-size-gb", str(32 / 1024))
PAGE = 256 << 10


def test_eviction_withdraws_what_it_announced(daemon_factory, ipc):
    d = serve(daemon_factory, ipc, *POOL)
    eng = engine(d, page=PAGE, num_blocks=4)
    notes = store_one_by_one(d, eng, 3, 40)
    sub = Subscriber(ipc)
    try:
        evs = sub.replay(0)
        stored, removed = hashes(events_of(evs, kv_events.BlockStored)), hashes(events_of(evs, kv_events.BlockRemoved))
        status = d.status()
        evicted = status["index"]["evictions"]
        assert evicted >= 8
        assert stored == [h for n in notes for h in n.hashes]
        assert removed == stored[:2 * evicted]  # LRU: the oldest chunks went first, in order, two blocks each
        assert {e.medium for e in events_of(evs, kv_events.BlockRemoved)} == {"HKVD_POOL"}
        assert status["kv_events"]["announced"]["HKVD_POOL"] == 40 - evicted == status["index"]["ready"]
    finally:
        sub.close()
        eng.close()


def test_disk_tier_drops_are_announced_for_the_disk_alone(daemon_factory, ipc, tmp_path):
    # Disk cap: 5 files of 1 MiB (+ 92-byte headers); 12 chunks: the disk drops 7, the pool none.
    d = serve(daemon_factory, ipc, *POOL, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", str(5.5 / 1024))
    eng = engine(d, page=PAGE, num_blocks=4)
    notes = store_one_by_one(d, eng, 4, 12, disk=True)
    sub = Subscriber(ipc)
    try:
        evs = sub.replay(0)
        on_disk = hashes(events_of(evs, kv_events.BlockStored, "HKVD_DISK"))
        dropped = hashes(events_of(evs, kv_events.BlockRemoved, "HKVD_DISK"))
        assert on_disk == [h for n in notes for h in n.hashes] and d.status()["l2"]["entries"] == 5
        assert dropped == on_disk[:2 * 7]  # the oldest files went first
        assert events_of(evs, kv_events.BlockRemoved, "HKVD_POOL") == []
        assert d.status()["kv_events"]["announced"] == {"HKVD_POOL": 12, "HKVD_DISK": 5, "HKVD_CLUSTER": 0}
    finally:
        sub.close()
        eng.close()


def test_a_chunk_evicted_from_the_pool_stays_announced_on_disk_and_returns_to_the_pool(daemon_factory, ipc,
                                                                                        tmp_path):
    d = serve(daemon_factory, ipc, *POOL, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.1")
    eng = engine(d, page=PAGE, num_blocks=4)
    notes = store_one_by_one(d, eng, 5, 40, disk=True)
    sub = Subscriber(ipc)
    try:
        evs = sub.replay(0)
        evicted = d.status()["index"]["evictions"]
        assert evicted >= 8
        assert hashes(events_of(evs, kv_events.BlockRemoved, "HKVD_POOL")) == [
            h for n in notes[:evicted] for h in n.hashes]
        assert events_of(evs, kv_events.BlockRemoved, "HKVD_DISK") == []  # still on disk: still announced there
        # A lookup reads chunk 0 back from disk into the pool: announced in the pool again.
        toks = prompt_tokens(CHUNK * 40, seed=5)
        assert eng.lookup(chunk_keys(toks, CHUNK)[:1], lease=False)[0] == 1
        first = notes[0].hashes[0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the batch is sent just after the lookup's reply
            if hashes(events_of(sub.replay(0), kv_events.BlockStored, "HKVD_POOL")).count(first) == 2:
                break
            time.sleep(0.05)
        assert hashes(events_of(sub.replay(0), kv_events.BlockStored, "HKVD_POOL")).count(first) == 2
        announced = d.status()["kv_events"]["announced"]
        assert announced["HKVD_DISK"] == 40 and announced["HKVD_POOL"] == d.status()["index"]["ready"]
    finally:
        sub.close()
        eng.close()


def test_an_engine_polls_its_layouts_events_and_a_bad_note_is_a_typed_error(daemon_factory, ipc):
    d = serve(daemon_factory, ipc, "--l1-size-gb", "0.125")
    eng = engine(d)
    other = engine(d, page=8192)  # another layout: its events are not this engine's
    toks = prompt_tokens(CHUNK * 2, seed=6)
    keys = chunk_keys(toks, CHUNK)
    notes = block_notes(keys, toks, CHUNK, 16)
    try:
        eng.store(eng.items(0, keys, 1), notes)
        other.store(other.items(0, keys, 1), notes)
        res = eng.run(eng.client.submit_events_poll(0)).result
        evs = [e for p in res.batches for e in DECODER.decode(p).events]
        assert hashes(evs) == [h for n in notes for h in n.hashes]  # once: the other layout's are not here
        assert not any(isinstance(e, kv_events.AllBlocksCleared) for e in evs)
        again = eng.run(eng.client.submit_events_poll(res.next)).result
        assert again.batches == [] and again.next == res.next
        with pytest.raises(OutOfRange, match="tokens"):
            eng.store(eng.items(0, keys, 1), [notes[0]._replace(tokens=notes[0].tokens[:8])])
        with pytest.raises(OutOfRange, match="no item"):
            eng.store(eng.items(0, keys, 1, chunks=[1]), notes[:1])
        assert eng.lookup(keys)[0] == 2  # the connection serves on
    finally:
        eng.close()
        other.close()
