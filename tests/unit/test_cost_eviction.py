"""The ``cost`` eviction policy (daemon/cache/eviction.py, over daemon/cache/recompute_cost.py): with the pool full,
a deep attention chunk or a Mamba state outlives a shallow chunk of the same age; an entry never used again still
ages out; orphans go first; evictions are counted by reason, quota's apart, with each tenant's order weighing
its entries."""

from __future__ import annotations

import pytest

from hkvd.daemon.cache import Cache, HugePagePool, make_policy
from hkvd.daemon.cache.eviction import CostPolicy
from hkvd.daemon.cache.hybrid import GroupRule
from hkvd.daemon.cache.quotas import Tenants
from hkvd.daemon.cache.recompute_cost import LINEAR_TOKENS, attention_cost, entry_cost, state_cost
from hkvd.transport.errors import PoolFull

SB = 8 << 20
ENTRY = 1 << 20  # 16 entries fill the pool
FP = b"c" * 16
WORLD = (FP,)
CHUNK = 256
FULL, MAMBA, SWA = 0, 1, 2
KINDS = {FULL: "full", MAMBA: "mamba", SWA: "swa"}


@pytest.fixture
def pool():
    p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def make(pool: HugePagePool, policy: str) -> Cache:
    cache = Cache(pool, make_policy(policy))
    rules = [GroupRule(FULL, "full"), GroupRule(MAMBA, "mamba"), GroupRule(SWA, "swa", window_tokens=1024)]
    cache.formats.add(WORLD, 0, model="m", chunk_size=CHUNK, rules=rules, kinds=KINDS,
                      entry_bytes=dict.fromkeys(KINDS, ENTRY))
    cache.add_format(WORLD, KINDS)
    return cache


def key(tag: str) -> bytes:
    return tag.encode().ljust(16, b".")


def store(cache: Cache, wants: list[tuple[str, int, int]]) -> None:
    """Store ``(tag, group, chunk index)`` entries in one store (the same age), READY at once."""
    got = cache.begin_store([((FP, g, key(t)), ENTRY, KINDS[g], b"") for t, g, _ in wants], 1,
                            chunks=[c for _, _, c in wants], offered=True)
    assert not any(isinstance(e, PoolFull) or e is None for e in got)
    cache.complete_store([e for e in got if e is not None and not isinstance(e, PoolFull)], pending=False)


def here(cache: Cache, tag: str, group: int = FULL) -> bool:
    return cache.is_ready((FP, group, key(tag)))


@pytest.mark.parametrize(("policy", "kept"), [("cost", "deep"), ("lru", "shallow")])
def test_a_deep_chunk_outlives_a_shallow_one_of_the_same_age(pool: HugePagePool, policy: str, kept: str) -> None:
    cache = make(pool, policy)
    store(cache, [("deep", FULL, 40), ("shallow", FULL, 0)])  # the deep one first: LRU's first victim
    store(cache, [(f"fill{i}", FULL, 8) for i in range(14)])  # the pool is full
    store(cache, [("new", FULL, 8)])  # one eviction
    assert here(cache, kept) and not here(cache, "shallow" if kept == "deep" else "deep")


@pytest.mark.parametrize(("policy", "kept"), [("cost", True), ("lru", False)])
def test_a_mamba_state_outlives_a_shallow_chunk_of_the_same_age(pool: HugePagePool, policy: str, kept: bool) -> None:
    cache = make(pool, policy)
    store(cache, [("state", MAMBA, 12), ("shallow", FULL, 0)])
    store(cache, [(f"fill{i}", FULL, 4) for i in range(14)])
    store(cache, [("new", FULL, 4)])
    assert here(cache, "state", MAMBA) is kept and here(cache, "shallow") is not kept


def test_a_costly_entry_never_used_again_still_ages_out(pool: HugePagePool) -> None:
    cache = make(pool, "cost")
    store(cache, [("deep", FULL, 40)])
    ratio = attention_cost(40, CHUNK) / attention_cost(0, CHUNK)  # about 2.2: it outlives about two pools
    evicted_before = 0
    for i in range(200):  # shallow one-shots, each evicting one entry once the pool is full
        store(cache, [(f"s{i}", FULL, 0)])
        if not here(cache, "deep"):
            evicted_before = cache.statistics().evictions
            break
    assert evicted_before, "the deep chunk was never evicted: the priorities do not age"
    assert 15 * (ratio - 1) <= evicted_before <= 15 * (ratio + 1), (evicted_before, ratio)


def test_hits_keep_an_entry_longer(pool: HugePagePool) -> None:
    cache = make(pool, "cost")
    store(cache, [("used", FULL, 0), ("unused", FULL, 0)])
    used = cache.get((FP, FULL, key("used")))
    assert used is not None
    cache.pin_for_read([used])()  # one retrieve read it
    store(cache, [(f"fill{i}", FULL, 0) for i in range(14)])
    store(cache, [("new", FULL, 0)])
    assert here(cache, "used") and not here(cache, "unused")


def test_orphans_go_first_and_evictions_are_counted_by_reason(pool: HugePagePool) -> None:
    cache = make(pool, "cost")
    store(cache, [("a", FULL, 30), ("b", FULL, 30)])
    store(cache, [(f"fill{i}", FULL, 0) for i in range(14)])
    entry = cache.get((FP, FULL, key("a")))
    assert entry is not None
    cache._index.policy.mark_orphan(entry.key)  # as the chain tracker would (daemon/cache/chains.py)
    store(cache, [("new", FULL, 0)])
    assert not here(cache, "a") and here(cache, "b")
    store(cache, [("new2", FULL, 0)])
    assert cache.statistics().evictions_by_reason == {"orphan": 1, "policy": 1}


def test_the_cost_model() -> None:
    c = CHUNK
    assert attention_cost(0, c) == c * (c / 2 + LINEAR_TOKENS)
    assert attention_cost(3, c) == c * (3 * c + c / 2 + LINEAR_TOKENS)
    assert attention_cost(30, c, window=1024) == c * (1024 + LINEAR_TOKENS)  # capped at the window
    assert state_cost(4, c) == pytest.approx(sum(attention_cost(j, c) for j in range(5)))  # the whole prefix
    assert entry_cost("mamba", -1, c) == state_cost(0, c)  # unknown position: as chunk 0
    assert entry_cost("swa", 30, c, 1024) == attention_cost(30, c, 1024)


def test_the_heap_walk_skips_stale_items_and_keeps_skipped_keys() -> None:
    policy = CostPolicy({"a": 1.0, "b": 2.0, "c": 3.0}.__getitem__)
    for k in "abc":
        policy.insert(k)
    policy.touch("a")
    policy.touch("a")  # a: 3.0 now, after b (2.0), tied with c but pushed later
    walk = policy.candidates()
    assert next(walk) == "b"
    policy.remove("b")  # evicted
    assert list(walk) == ["c", "a"]
    assert list(policy.candidates()) == ["c", "a"]  # a walk that only passed keys over leaves them in place


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_quota_evictions_are_counted_apart_and_each_tenant_order_weighs(pool: HugePagePool, policy: str) -> None:
    cache = Cache(pool, make_policy(policy), tenants=Tenants(pool.allocator.capacity, 0.5))
    rules = [GroupRule(FULL, "full")]
    cache.formats.add(WORLD, 0, model="m", chunk_size=CHUNK, rules=rules, kinds={FULL: "full"},
                      entry_bytes={FULL: ENTRY})
    cache.add_format(WORLD, {FULL: "full"})

    def put(tag: str, chunk: int, tenant: str) -> None:
        got = cache.begin_store([((FP, FULL, key(tag)), ENTRY, "full", b"")], 1, tenant, chunks=[chunk], offered=True)
        cache.complete_store([e for e in got if e is not None and not isinstance(e, PoolFull)], pending=False)

    put("deep", 40, "salt:a")
    for i in range(11):
        put(f"a{i}", 0, "salt:a")  # 12 of a's: over its quota of 8
    for i in range(4):
        put(f"b{i}", 0, "salt:b")  # the pool is full
    put("b4", 0, "salt:b")  # b is within its quota: it takes from a, over its own
    assert cache.statistics().evictions_by_reason == {"quota": 1}
    assert here(cache, "deep") is (policy == "cost")  # a's own order weighs its entries: the shallow one went

