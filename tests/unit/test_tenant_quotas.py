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
    cache.sessions.pin(WORLD, "s", "a", own, 300.0)  # a's own entries are pinned: nothing a may evict
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


def test_many_tenants_keep_the_metrics_bounded() -> None:
    from hkvd.daemon.cache.quotas import COUNTED, OTHER, SHOWN

    tenants = Tenants(1 << 30, 0.5, {"lora:sql": 0.25})
    for i in range(SHOWN + 6):
        tenants.add(f"salt:{i:04x}", (i + 1) * ENTRY)
    st = tenants.statistics()
    assert len(st.bytes) == SHOWN + 1 and st.bytes["lora:sql"] == 0  # its own quota: always shown
    assert st.bytes[OTHER] == sum(range(1, 8)) * ENTRY  # the 7 smallest of 70 folded
    assert st.quota_bytes["lora:sql"] == 1 << 28 and st.quota_bytes[OTHER] == 1 << 29
    for i in range(COUNTED + 44):
        tenants.evicted(f"salt:{i:04x}")
    assert len(tenants.evictions) == COUNTED + 1 and tenants.evictions[OTHER] == 44


def test_a_tenants_eviction_order_goes_with_its_last_entry(pool: HugePagePool) -> None:
    cache = make(pool, 0.5)
    for t in ("a", "b", "c"):
        store(cache, keys(t, 2), f"salt:{t}")
    order = cache._index.policy
    assert sorted(order._orders) == ["", "salt:a", "salt:b", "salt:c"]
    for k in keys("b", 2):
        entry = cache.get((FP, 0, k))
        assert entry is not None
        cache.drop(entry)
    assert sorted(order._orders) == ["", "salt:a", "salt:c"]
    assert cache.tenants.statistics().bytes == {"salt:a": 2 * ENTRY, "salt:c": 2 * ENTRY}


def test_a_bad_quota_in_the_config_is_a_start_up_error_naming_the_key() -> None:
    import tomllib

    from hkvd.daemon.config import ConfigError, DaemonConfig
    from hkvd.daemon.options import from_toml

    got = from_toml(tomllib.loads('tenant-quota = 0.5\ntenant-quotas = { "" = 0.8, "salt:ab" = 0.25 }'), "--config x")
    assert got == {"tenant_quota": 0.5, "tenant_quotas": (("", 0.8), ("salt:ab", 0.25))}
    assert DaemonConfig(**got).tenant_quotas == (("", 0.8), ("salt:ab", 0.25))
    with pytest.raises(ConfigError, match=r"tenant-quotas 'salt:ab' = 1.5: a share of the pool"):
        DaemonConfig(tenant_quotas=(("salt:ab", 1.5),))
    with pytest.raises(ConfigError, match=r"tenant-quotas 'a b': .*without spaces"):
        DaemonConfig(tenant_quotas=(("a b", 0.5),))
    with pytest.raises(ConfigError, match="given twice"):
        DaemonConfig(tenant_quotas=(("x", 0.5), ("x", 0.6)))
    with pytest.raises(ConfigError, match=r"--tenant-quota 0\.0"):
        DaemonConfig(tenant_quota=0.0)
    with pytest.raises(ConfigError, match="--pin-max-fraction 2"):
        DaemonConfig(pin_max_fraction=2)
    with pytest.raises(ConfigError, match=r"tenant-quotas.*a fraction of the pool"):
        from_toml({"tenant-quotas": {"salt:ab": "half"}}, "--config x")
    with pytest.raises(ConfigError, match="LABEL=FRACTION"):
        from_toml({"tenant-quotas": "salt:ab"}, "--config x")
