"""Tenant quotas (daemon/cache/quotas.py) in the index: a tenant over its quota evicts its own entries first, a
tenant within its quota takes room only from tenants over theirs, and no tenant takes another's pinned or
quota-protected entries."""

from __future__ import annotations

import pytest

from hkvd.daemon.cache import Cache, HugePagePool, make_policy
from hkvd.daemon.cache.quotas import Tenants
from hkvd.transport.errors import PoolFull

SB = 8 << 20
ENTRY = 1 << 20  # 16 entries fill the pool
FP = b"f" * 16
WORLD = (FP,)


@pytest.fixture
def pool():
    p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def make(pool: HugePagePool, default: float, overrides: dict[str, float] | None = None,
         policy: str = "lru") -> Cache:
    cache = Cache(pool, make_policy(policy), tenants=Tenants(pool.allocator.capacity, default, overrides))
    cache.add_format(WORLD, {0: "full"})
    return cache


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".") for i in range(n)]


def store(cache: Cache, ks: list[bytes], tenant: str) -> list[bool]:
    """Store ``ks`` for ``tenant``; whether each was placed."""
    got = cache.begin_store([((FP, 0, k), ENTRY, "full", b"") for k in ks], 1, tenant)
    placed = [e for e in got if e is not None and not isinstance(e, PoolFull)]
    cache.complete_store(placed, pending=False)
    return [e is not None and not isinstance(e, PoolFull) for e in got]


def held(cache: Cache, ks: list[bytes]) -> int:
    return sum(cache.is_ready((FP, 0, k)) for k in ks)


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_a_tenant_flooding_the_pool_evicts_only_its_own_entries_once_over_quota(pool: HugePagePool,
                                                                                 policy: str) -> None:
    cache = make(pool, 0.5, policy=policy)  # 8 entries each
    quiet = keys("quiet", 6)
    assert all(store(cache, quiet, "salt:b"))
    for i in range(5):  # 40 entries of tenant a through the pool
        assert all(store(cache, keys(f"flood{i}", 8), "salt:a"))
    assert held(cache, quiet) == 6
    st = cache.tenants.statistics()
    assert st.evictions == {"salt:a": 40 - 10}  # the pool's 10 free slots, then a's own entries only
    assert st.bytes == {"salt:a": 10 * ENTRY, "salt:b": 6 * ENTRY}
    assert st.quota_bytes["salt:a"] == 8 * ENTRY


def test_a_tenant_within_its_quota_takes_room_from_the_one_over_its_quota(pool: HugePagePool) -> None:
    cache = make(pool, 0.5)
    hog = keys("hog", 16)
    assert all(store(cache, hog, "lora:x"))  # the pool was free: 16 entries, 8 over its quota
    assert all(store(cache, keys("b", 8), ""))  # within its quota: takes the hog's oldest
    assert held(cache, hog) == 8 and held(cache, hog[8:]) == 8
    assert cache.tenants.statistics().evictions == {"lora:x": 8}


def test_a_tenant_over_quota_evicts_its_own_first_even_when_others_are_over_too(pool: HugePagePool) -> None:
    cache = make(pool, 0.4)  # 6.4 MiB each: 6 entries
    a, b = keys("a", 8), keys("b", 8)
    assert all(store(cache, a, "a"))
    assert all(store(cache, b, "b"))  # both over, pool full
    assert all(store(cache, keys("a2", 2), "a"))
    assert held(cache, b) == 8 and held(cache, a) == 6
    assert cache.tenants.statistics().evictions == {"a": 2}


def test_per_tenant_overrides(pool: HugePagePool) -> None:
    cache = make(pool, 1.0, {"salt:ab": 0.25})  # only salt:ab is held to 4 entries
    assert cache.tenants.active
    other = keys("other", 10)
    assert all(store(cache, other, ""))
    for i in range(3):
        assert all(store(cache, keys(f"ab{i}", 4), "salt:ab"))
    assert held(cache, other) == 10
    assert cache.tenants.bytes["salt:ab"] == 6 * ENTRY  # 6 free slots, then its own


def test_no_tenant_takes_pinned_or_protected_entries_the_store_is_dropped(pool: HugePagePool) -> None:
    cache = make(pool, 0.5)
    own, protected = keys("own", 8), keys("prot", 8)
    assert all(store(cache, protected, "b"))  # b at its quota exactly
    assert all(store(cache, own, "a"))
    cache.pin_session(WORLD, "s", "a", own, 300.0)  # a's own entries are pinned: nothing a may evict
    assert store(cache, keys("more", 2), "a") == [False, False]
    assert held(cache, protected) == 8 and held(cache, own) == 8
    assert cache.statistics().evictions == 0


def test_without_quotas_tenants_are_only_counted(pool: HugePagePool) -> None:
    cache = make(pool, 1.0)
    assert not cache.tenants.active
    b = keys("b", 8)
    store(cache, b, "b")
    for i in range(2):
        store(cache, keys(f"a{i}", 8), "a")
    assert held(cache, b) == 0  # plain LRU across tenants
    assert cache.tenants.statistics().evictions == {"b": 8}


def test_room_is_taken_from_another_tenant_only_while_it_stays_over_its_quota(pool: HugePagePool) -> None:
    cache = make(pool, 0.5)
    hog, b = keys("hog", 10), keys("b", 6)
    assert all(store(cache, hog, "lora:x"))  # 2 over its quota
    assert all(store(cache, b, ""))  # the pool is full
    assert all(store(cache, keys("b2", 4), ""))  # 2 from the hog, then b's own
    assert held(cache, hog) == 8
    assert cache.tenants.statistics().evictions == {"lora:x": 2, "": 2}
