"""Session pins (daemon/cache/pins.py) in the index: a pinned session's entries are never evicted while its TTL
runs; the TTL lapses, a hit restarts it, a newer turn supersedes the older pins it extends, the budget lapses
the oldest pins first, and an unpin frees them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hkvd.daemon.cache import Cache, GroupRule, HugePagePool, make_policy
from hkvd.daemon.cache.pins import Pins

SB = 8 << 20
ENTRY = 1 << 20  # 16 entries fill the pool
FP = b"f" * 16
WORLD = (FP,)


@dataclass(frozen=True)
class Shape:
    rules: tuple[GroupRule, ...] = (GroupRule(0, "full"),)
    chunk_size: int = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool():
    p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def make(pool: HugePagePool, clock: Clock, policy: str = "lru", pin_fraction: float = 0.5) -> Cache:
    cache = Cache(pool, make_policy(policy), clock, pin_fraction=pin_fraction)
    cache.add_format(WORLD, {0: "full"})
    return cache


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".") for i in range(n)]


def store(cache: Cache, ks: list[bytes], tenant: str = "") -> int:
    """Store ``ks`` (one full-attention entry each); how many were placed."""
    got = cache.begin_store([((FP, 0, k), ENTRY, "full", b"") for k in ks], 1, tenant)
    placed = [e for e in got if e is not None and not isinstance(e, Exception)]
    cache.complete_store(placed, pending=False)
    return len(placed)


def held(cache: Cache, ks: list[bytes]) -> int:
    return sum(cache.is_ready((FP, 0, k)) for k in ks)


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_a_pinned_session_survives_a_flood_that_evicts_an_unpinned_one(pool: HugePagePool, policy: str) -> None:
    clock = Clock()
    cache = make(pool, clock, policy)
    pinned, loose = keys("pinned", 4), keys("loose", 4)
    store(cache, pinned)
    store(cache, loose)
    assert cache.sessions.pin(WORLD, "s1", "", pinned, 300.0)
    assert cache._index.pinned_bytes() == 4 * ENTRY
    for i in range(5):  # 40 entries through a 16-entry pool
        assert store(cache, keys(f"flood{i}", 8)) == 8
    assert held(cache, pinned) == 4
    assert held(cache, loose) == 0
    assert cache.statistics().evictions >= 28


def test_chunks_pinned_before_they_are_stored_are_held_once_stored(pool: HugePagePool) -> None:
    cache = make(pool, Clock())
    ks = keys("later", 3)
    cache.sessions.pin(WORLD, "s1", "", ks, 300.0)
    store(cache, ks)
    assert cache._index.pinned_bytes() == 3 * ENTRY
    for i in range(4):
        store(cache, keys(f"flood{i}", 8))
    assert held(cache, ks) == 3


def test_the_ttl_lapses_and_the_entries_go_back_to_eviction(pool: HugePagePool) -> None:
    clock = Clock()
    cache = make(pool, clock)
    ks = keys("s", 4)
    store(cache, ks)
    cache.sessions.pin(WORLD, "s1", "", ks, 60.0)
    clock.now += 59
    assert cache._index.expire_pins() == 0
    clock.now += 2
    assert cache._index.expire_pins() == 1
    assert cache._index.pins.lapsed["ttl"] == 1
    assert cache._index.pinned_bytes() == 0 and cache._index.pins.sessions() == 0
    for i in range(3):
        store(cache, keys(f"flood{i}", 8))
    assert held(cache, ks) == 0


def test_a_hit_restarts_the_ttl(pool: HugePagePool) -> None:
    clock = Clock()
    cache = make(pool, clock)
    ks = keys("s", 4)
    store(cache, ks)
    cache.sessions.pin(WORLD, "s1", "", ks, 60.0)
    clock.now += 50
    asked = ks[:2] + keys("new", 2)  # the next turn: a hit on the pinned prefix
    plan = cache.plan_lookup(Shape(), asked, [FP])
    assert plan.hit_chunks == 2
    cache.release(cache.lease(plan, owner=1, ttl_s=5.0))
    clock.now += 50  # 100 s after the pin, 50 after the hit
    assert cache._index.expire_pins() == 0
    [row] = cache._index.pins.remaining(5)
    assert (row.session, row.tenant, row.pins, row.ttl_left_s) == ("s1", "", 1, pytest.approx(10.0))
    clock.now += 11
    assert cache._index.expire_pins() == 1


def test_a_newer_turn_supersedes_the_pins_it_extends(pool: HugePagePool) -> None:
    cache = make(pool, Clock())
    turn = keys("chat", 6)
    cache.sessions.pin(WORLD, "s1", "", turn[:2], 300.0)
    cache.sessions.pin(WORLD, "s1", "", turn[:4], 300.0)
    other = keys("other", 2)
    cache.sessions.pin(WORLD, "s1", "", other, 300.0)  # not an extension: kept beside
    cache.sessions.pin(WORLD, "s1", "", turn, 300.0)
    assert cache._index.pins.lapsed["superseded"] == 2
    assert [r.keys for r in cache._index.pins.records()] == [tuple(other), tuple(turn)]
    assert cache._index.pins.is_pinned(FP, turn[0]) and cache._index.pins.is_pinned(FP, other[1])


def test_a_turns_partial_chunks_are_held_with_its_pin_and_end_with_it(pool: HugePagePool) -> None:
    """Partial keys (a turn's end inside a block) are held like the pin's chunks but stay out of the prefix
    rule: the next turn's keys supersede the record although they never continue its partial key."""
    clock = Clock()
    cache = make(pool, clock)
    turn, ends = keys("chat", 6), keys("end", 2)
    store(cache, turn[:4] + ends[:1])
    cache.sessions.pin(WORLD, "s1", "", turn[:4], 300.0, [ends[0]])
    assert cache._index.pinned_bytes() == 5 * ENTRY and cache._index.pins.is_pinned(FP, ends[0])
    for i in range(4):  # 32 entries through a 16-entry pool: the turn's end stays
        store(cache, keys(f"flood{i}", 8))
    assert held(cache, turn[:4] + ends[:1]) == 5

    cache.sessions.pin(WORLD, "s1", "", turn, 300.0, [ends[1]])  # the next turn: its own end
    assert cache._index.pins.lapsed["superseded"] == 1 and len(cache._index.pins) == 1
    assert not cache._index.pins.is_pinned(FP, ends[0]) and cache._index.pins.is_pinned(FP, ends[1])
    for i in range(4):
        store(cache, keys(f"again{i}", 8))
    assert held(cache, ends[:1]) == 0 and held(cache, turn[:4]) == 4


def test_a_pin_with_partial_keys_crosses_the_wire_and_an_older_shape_still_parses() -> None:
    from hkvd.transport.errors import ProtocolViolation
    from hkvd.transport.wire import kv
    from hkvd.transport.wire.message import message_from_wire

    whole, part = keys("w", 2), keys("p", 1)
    msg = kv.Pin("s1", "", 60.0, whole, part)
    assert message_from_wire(msg.to_wire()) == msg
    older = kv.Pin("s1", "", 60.0, whole)  # no partial keys: the four fields an older daemon parses
    assert len(older.to_wire()) == 5 and message_from_wire(older.to_wire()).partial_keys == []
    with pytest.raises(ProtocolViolation, match="partial keys"):
        kv.Pin("s1", "", 60.0, whole, keys("p", kv.MAX_PIN_PARTIALS + 1)).validate()
    with pytest.raises(ProtocolViolation, match="16 bytes"):
        kv.Pin("s1", "", 60.0, whole, [b"short"]).validate()


def test_past_the_budget_the_oldest_pins_lapse_first(pool: HugePagePool) -> None:
    clock = Clock()
    cache = make(pool, clock, pin_fraction=0.25)  # 4 MiB of a 16 MiB pool: 4 entries
    a, b, c = keys("a", 2), keys("b", 2), keys("c", 2)
    store(cache, a + b + c)
    cache.sessions.pin(WORLD, "a", "", a, 300.0)
    clock.now += 1
    cache.sessions.pin(WORLD, "b", "", b, 300.0)
    assert cache._index.pins.lapsed["budget"] == 0
    clock.now += 1
    plan = cache.plan_lookup(Shape(), a, [FP])  # a hit on a: b is now the least recently used pin
    cache.release(cache.lease(plan, owner=1, ttl_s=5.0))
    cache.sessions.pin(WORLD, "c", "", c, 300.0)
    assert cache._index.pins.lapsed["budget"] == 1
    assert [r.session for r in cache._index.pins.records()] == ["a", "c"]
    assert cache._index.pinned_bytes() == 4 * ENTRY
    cache.sessions.pin(WORLD, "d", "", keys("d", 1), 300.0)  # not stored yet: holds no bytes
    store(cache, keys("d", 1))  # now it does: a lapses
    assert [r.session for r in cache._index.pins.records()] == ["c", "d"]
    assert cache._index.pinned_bytes() == 3 * ENTRY <= cache._index.pin_budget_bytes


def test_an_unpin_frees_the_session(pool: HugePagePool) -> None:
    cache = make(pool, Clock())
    ks = keys("s", 4)
    store(cache, ks)
    cache.sessions.pin(WORLD, "s1", "", ks[:2], 300.0)
    cache.sessions.pin(WORLD, "s1", "", ks[2:], 300.0)
    assert cache.sessions.unpin("s1") == 2
    assert cache.sessions.unpin("s1") == 0
    assert cache._index.pins.lapsed["unpin"] == 2 and cache._index.pinned_bytes() == 0
    for i in range(3):
        store(cache, keys(f"flood{i}", 8))
    assert held(cache, ks) == 0


def test_a_chunk_two_sessions_pin_stays_held_until_both_let_go(pool: HugePagePool) -> None:
    cache = make(pool, Clock())
    shared = keys("system", 2)
    store(cache, shared)
    cache.sessions.pin(WORLD, "s1", "", shared, 300.0)
    cache.sessions.pin(WORLD, "s2", "", shared, 300.0)
    cache.sessions.unpin("s1")
    assert cache._index.pinned_bytes() == 2 * ENTRY
    cache.sessions.unpin("s2")
    assert cache._index.pinned_bytes() == 0


def test_sessions_and_records_per_session_are_bounded() -> None:
    changes: list[tuple[bytes, bytes, bool]] = []
    pins = Pins(lambda fp, k, h: changes.append((fp, k, h)), Clock(), max_per_session=2, max_sessions=2)
    assert pins.pin(WORLD, "a", "", keys("a", 1), 10.0)
    assert pins.pin(WORLD, "b", "", keys("b", 1), 10.0)
    assert not pins.pin(WORLD, "c", "", keys("c", 1), 10.0)  # refused, not raised
    assert pins.refused == 1
    assert pins.pin(WORLD, "a", "", keys("a2", 1), 10.0)
    assert pins.pin(WORLD, "a", "", keys("a3", 1), 10.0)
    assert pins.lapsed["session_limit"] == 1
    assert not pins.is_pinned(FP, keys("a", 1)[0]) and pins.is_pinned(FP, keys("a3", 1)[0])
    assert (FP, keys("a", 1)[0], False) in changes
