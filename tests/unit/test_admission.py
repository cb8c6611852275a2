"""Admission (daemon/cache/admission.py, over daemon/cache/frequency_sketch.py): a flood of one-shot chunks does not
push out a conversation looked up every turn under ``tinylfu``, and does under ``none``; what is always admitted;
how refusals and admissions are counted; the options that choose it."""

from __future__ import annotations

import argparse

import pytest

from hkvd.daemon.cache import Cache, HugePagePool, NotAdmitted, make_policy
from hkvd.daemon.cache.frequency_sketch import CAP, FrequencySketch, key_hash
from hkvd.daemon.cache.hybrid import GroupRule
from hkvd.daemon.config import ConfigError, DaemonConfig
from hkvd.transport.errors import PoolFull

SB = 8 << 20
ENTRY = 1 << 20  # 16 entries fill the pool
FP = b"f" * 16
WORLD = (FP,)
CHUNK = 256


@pytest.fixture
def pool():
    p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def make(pool: HugePagePool, admission: str, policy: str = "lru") -> Cache:
    cache = Cache(pool, make_policy(policy), admission=admission)
    cache.formats.add(WORLD, 0, model="m", chunk_size=CHUNK, rules=[GroupRule(0, "full")], kinds={0: "full"},
                      entry_bytes={0: ENTRY})
    cache.add_format(WORLD, {0: "full"})
    return cache


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".") for i in range(n)]


def request(cache: Cache, ks: list[bytes], *, exempt: bool = False) -> tuple[int, list[object]]:
    """What an engine does for one request: look ``ks`` up (leased, so its hit counts as used), then store
    the chunks past the hit. The hit, and the store's answers."""
    shape = cache.formats.world(FP)
    assert shape is not None
    plan = cache.plan_lookup(shape, ks, WORLD, seen=True)
    if plan.hit_chunks:
        cache.release(cache.lease(plan, 1, 30.0))
    n = plan.hit_chunks
    got = cache.begin_store([((FP, 0, k), ENTRY, "full", ks[i - 1] if i else b"") for i, k in enumerate(ks[n:], n)],
                            1, chunks=list(range(n, len(ks))), offered=True, exempt=exempt)
    cache.complete_store([e for e in got if e is not None and not isinstance(e, PoolFull)], pending=False)
    return n, list(got)


def held(cache: Cache, ks: list[bytes]) -> int:
    return sum(cache.is_ready((FP, 0, k)) for k in ks)


@pytest.mark.parametrize(("admission", "kept"), [("tinylfu", 6), ("none", 0)])
def test_a_flood_of_one_shots_keeps_a_conversation_out_of_the_pool_only_without_admission(
        pool: HugePagePool, admission: str, kept: int) -> None:
    cache = make(pool, admission)
    conv = keys("conv", 6)
    assert request(cache, conv)[0] == 0  # turn 1: computed and stored
    assert request(cache, conv)[0] == 6  # turn 2: a hit; its chunks now seen twice
    for i in range(30):  # 60 one-shot chunks, almost four pools' worth, each asked for once
        request(cache, keys(f"oneshot{i}", 2))
    assert request(cache, conv)[0] == kept  # turn 3
    st = cache.statistics()
    assert st.admission == admission
    if admission == "tinylfu":
        assert st.admission_entries["refused"] > 0 and st.evictions == 0
        assert st.admission_bytes["refused"] == st.admission_entries["refused"] * ENTRY
    else:
        assert st.admission_entries["refused"] == 0 and st.evictions_by_reason["policy"] == st.evictions > 0
    assert st.admission_entries["admitted"] * ENTRY == st.admission_bytes["admitted"] > 0


def test_a_refused_store_answers_not_admitted_a_pool_full(pool: HugePagePool) -> None:
    cache = make(pool, "tinylfu")
    hot = keys("hot", 16)
    request(cache, hot)
    request(cache, hot)  # the whole pool seen twice
    _, got = request(cache, keys("cold", 3))
    assert all(isinstance(g, NotAdmitted) and isinstance(g, PoolFull) for g in got)
    assert held(cache, hot) == 16
    # The first chunk's refusal refuses the chunks after it without a walk: the prefix has a hole.
    assert cache.statistics().admission_entries == {"admitted": 16, "refused": 3}


def test_free_room_turn_ends_and_pinned_sessions_are_always_admitted(pool: HugePagePool) -> None:
    cache = make(pool, "tinylfu")
    hot = keys("hot", 14)
    request(cache, hot)
    request(cache, hot)
    _, got = request(cache, keys("free", 2))  # two free slots: no victim to weigh against
    assert not any(isinstance(g, PoolFull) for g in got)
    _, got = request(cache, keys("end", 1), exempt=True)  # a turn end's state
    assert not any(isinstance(g, PoolFull) for g in got)
    pinned = keys("pinned", 2)
    assert cache.sessions.pin(WORLD, "s", "", pinned, 60.0)
    _, got = request(cache, pinned)
    assert not any(isinstance(g, PoolFull) for g in got) and held(cache, pinned) == 2
    _, got = request(cache, keys("cold", 1))
    assert isinstance(got[0], NotAdmitted)


def test_the_states_a_conversation_passes_over_are_not_as_frequent_as_its_chunks(pool: HugePagePool) -> None:
    # A hybrid format: a state at every chunk boundary. A turn's hit uses its chunks and the state where it ends;
    # the states inside its prefix are counted apart, so they do not refuse newcomers as its chunks do.
    fp, world = b"h" * 16, (b"h" * 16,)
    cache = Cache(pool, make_policy("lru"), admission="tinylfu")
    kinds = {0: "full", 1: "mamba"}
    cache.formats.add(world, 0, model="m", chunk_size=CHUNK, rules=[GroupRule(0, "full"), GroupRule(1, "mamba")],
                      kinds=kinds, entry_bytes=dict.fromkeys(kinds, ENTRY))
    cache.add_format(world, kinds)
    shape = cache.formats.world(fp)
    assert shape is not None

    def turn(ks: list[bytes]) -> list[object]:
        plan = cache.plan_lookup(shape, ks, world, seen=True)
        if plan.hit_chunks:
            cache.release(cache.lease(plan, 1, 30.0))
        n = plan.hit_chunks
        wants = [((fp, g, ks[i]), ENTRY, kinds[g], ks[i - 1] if i else b"") for i in range(n, len(ks)) for g in kinds]
        got = cache.begin_store(wants, 1, chunks=[i for i in range(n, len(ks)) for _ in kinds], offered=True)
        cache.complete_store([e for e in got if e is not None and not isinstance(e, PoolFull)], pending=False)
        return list(got)

    conv = keys("conv", 4)
    turn(conv)  # 8 entries
    turn(conv)  # a hit of 4: chunks 0-3 and the state at 3 leased; the states at 0-2 are the oldest now
    turn(keys("a", 4))  # the pool is full
    got = turn(keys("b", 1))  # its two entries may evict the states at 0 and 1: each seen once, as they are
    assert not any(isinstance(g, PoolFull) for g in got)
    assert not cache.is_ready((fp, 1, conv[0])) and cache.is_ready((fp, 1, conv[3]))
    got = turn(keys("c", 1))  # next in line: the state at 2, then chunk 0 of the conversation, seen twice
    assert isinstance(got[1], NotAdmitted)
    assert cache.plan_lookup(shape, conv, world).hit_chunks == 4


def test_other_writers_are_not_put_to_the_admission(pool: HugePagePool) -> None:
    # Promotion from the lower tiers and peer pulls begin entries without ``offered``: wanted now.
    cache = make(pool, "tinylfu")
    hot = keys("hot", 16)
    request(cache, hot)
    request(cache, hot)
    got = cache.begin_store([((FP, 0, k), ENTRY, "full", b"") for k in keys("promoted", 2)], 1)
    assert not any(isinstance(g, PoolFull) for g in got)
    assert cache.statistics().admission_entries == {"admitted": 16, "refused": 0}  # only engines' stores count


def test_the_sketch_counts_past_its_doorkeeper_caps_and_ages() -> None:
    sk = FrequencySketch(1024, period=10_000)
    a, b = key_hash(b"a" * 16), key_hash(b"b" * 16)
    assert sk.estimate(a) == 0
    sk.add([a])
    assert sk.estimate(a) == 1  # the doorkeeper's bit, no counter yet
    sk.mark([a])  # a store's sighting never counts twice
    assert sk.estimate(a) == 1
    for _ in range(3):
        sk.add([a])
    assert sk.estimate(a) == 4 and sk.estimate(b) == 0
    for _ in range(40):
        sk.add([a, b])
    assert sk.estimate(a) == CAP + 1 and sk.estimate(b) == CAP + 1
    sk.halve()  # counters halved, the doorkeeper cleared
    assert sk.estimate(a) == CAP // 2
    sk2 = FrequencySketch(64, period=20)
    for _ in range(5):
        sk2.add([a, b])  # 10 sightings
    before = sk2.estimate(a)
    for _ in range(5):
        sk2.add([b, b])  # the 20th sighting halves
    assert sk2.halvings == 1 and sk2.estimate(a) < before


def test_options_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"--admission 'lfu': choose one of none, tinylfu"):
        DaemonConfig(admission="lfu")
    with pytest.raises(ConfigError, match=r"--eviction-policy 'gdsf': choose one of lru, hybrid, cost"):
        DaemonConfig(eviction_policy="gdsf")
    from hkvd.daemon.cli import _serve_parser, build_config

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    cfg = build_config(parser.parse_args(["serve", "--admission", "TinyLFU", "--eviction-policy", "cost"]))
    assert (cfg.admission, cfg.eviction_policy) == ("tinylfu", "cost")
    assert DaemonConfig().admission == "none"  # today's behaviour stays the default


def test_status_shows_admitted_refused_and_evictions_by_reason(pool: HugePagePool) -> None:
    from hkvd.daemon.cli import _status_admission
    from hkvd.transport.stat_fields import status_dict

    cache = make(pool, "tinylfu")
    hot = keys("hot", 16)
    request(cache, hot)
    request(cache, hot)
    request(cache, keys("cold", 2))
    (line,) = _status_admission(status_dict(cache.statistics()))
    assert line == "admitted  16 entries (16.0 MiB), 2 refused (2.0 MiB) by --admission tinylfu; evicted by none"
    assert _status_admission({"evictions": 0}) == []  # a daemon without these fields


def test_an_engine_store_reports_refused_items_as_dropped_not_as_a_full_pool(pool: HugePagePool) -> None:
    # The store path (daemon/engines/stores.py): a refused item counts in the reply's ``dropped``, as a full
    # pool's does, but not in the pool-full counters (the cache counts it under admission_entries).
    from types import SimpleNamespace

    from hkvd.daemon.engines.stores import Stores
    from hkvd.daemon.metrics import Metrics
    from hkvd.transport.wire.kv import Item

    cache = make(pool, "tinylfu")
    hot = keys("hot", 16)
    request(cache, hot)
    request(cache, hot)
    metrics = Metrics()
    stores = Stores(None, cache, None, metrics, None, [], None)  # type: ignore[arg-type]  # _begin needs none
    engine = SimpleNamespace(fingerprint=FP, entry_bytes={0: ENTRY})
    group = SimpleNamespace(group_id=0, kind="full")
    cold = keys("cold", 2)
    items = [(Item(0, i, k, [1], cold[i - 1] if i else b""), group) for i, k in enumerate(cold)]
    cache.plan_lookup(cache.formats.world(FP), cold, WORLD, seen=True)  # type: ignore[arg-type]
    entries, _, skipped, dropped = stores._begin(engine, items, ["", ""], 1)  # type: ignore[arg-type]
    assert (entries, skipped, dropped) == ([], 0, 2)
    assert cache.statistics().stores_dropped == 0 and metrics.get("stores_dropped", kind="full") == 0
    assert cache.statistics().admission_entries["refused"] == 2
    # A turn end's items are exempt: placed, evicting.
    entries, _, _, dropped = stores._begin(engine, items, ["", ""], 2, exempt=True)  # type: ignore[arg-type]
    assert len(entries) == 2 and dropped == 0
    cache.abandon_store(entries)
