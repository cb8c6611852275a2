"""The cache core (daemon/cache/core.py): the one tensor-parallel rule that every lookup, peer lookup,
pull and promotion shares. A hit is what every rank named holds; a lease holds every rank's entries
of the hit and serves one retrieve per rank; a lookup that names one rank (a peer's, a pull's) gets a
lease that one retrieve ends."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hkvd.daemon.cache import Cache, GroupRule, HugePagePool, make_policy
from hkvd.transport.errors import LeaseExpired

SB = 8 << 20
ENTRY = 64 << 10
CHUNK = 16
RANKS = (b"r0" * 8, b"r1" * 8)
KEYS = [bytes([i]) * 16 for i in range(4)]


@dataclass(frozen=True)
class Shape:
    """A hybrid engine's format: one full-attention group and one Mamba group."""

    rules: tuple[GroupRule, ...] = (GroupRule(0, "full"), GroupRule(1, "mamba"))
    chunk_size: int = CHUNK


@pytest.fixture
def cache():
    pool = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield Cache(pool, make_policy("lru"))
    pool.close()


def _store(cache: Cache, fp: bytes, group: int, chunk: int) -> None:
    [e] = cache.begin_store([((fp, group, KEYS[chunk]), ENTRY, "full" if group == 0 else "mamba", b"")], 1)
    assert not isinstance(e, Exception) and e is not None
    cache.complete_store([e], pending=False)


def _store_prefix(cache: Cache, fp: bytes, chunks: int) -> None:
    for c in range(chunks):
        _store(cache, fp, 0, c)
        _store(cache, fp, 1, c)


def test_a_hit_is_what_every_rank_holds_and_its_lease_serves_one_retrieve_per_rank(cache: Cache) -> None:
    _store_prefix(cache, RANKS[0], 3)
    _store_prefix(cache, RANKS[1], 2)  # rank 1 stored two chunks only
    plan = cache.plan_lookup(Shape(), KEYS, RANKS, count_missing=True)
    assert plan.hit_chunks == 2  # the minimum over the ranks, never the longer rank's hit
    assert plan.needed == {0: [0, 1], 1: [1]}
    assert plan.missing == {"full": 1}  # rank 1's chunk 2 stops the full-attention run
    assert cache.plan_lookup(Shape(), KEYS, RANKS[:1]).hit_chunks == 3  # rank 0 alone holds three

    lease_id = cache.lease(plan, owner=7, ttl_s=60)
    lease = cache.check_lease(lease_id)
    held = {(fp, g, KEYS[c]) for fp in RANKS for g, cs in plan.needed.items() for c in cs}
    assert set(lease.keys) == held and len(lease.keys) == 6  # every rank's entries under one lease
    assert cache.statistics().pinned_entries == 6
    cache.use_lease(lease_id, written=True)  # rank 0's retrieve
    assert cache.check_lease(lease_id) is lease  # still held for rank 1's
    cache.use_lease(lease_id, written=True)  # rank 1's: the last use ends it
    with pytest.raises(LeaseExpired):
        cache.check_lease(lease_id)
    assert cache.statistics().pinned_entries == 0


def test_a_lease_that_names_one_rank_ends_at_its_one_retrieve(cache: Cache) -> None:
    # A peer's lookup and a pull name the one rank whose shards they move.
    _store_prefix(cache, RANKS[1], 2)
    plan = cache.plan_lookup(Shape(), KEYS, RANKS[1:])
    assert plan.hit_chunks == 2
    lease_id = cache.lease(plan, owner=7, ttl_s=60)
    assert len(cache.check_lease(lease_id).keys) == 3
    cache.use_lease(lease_id, written=True)
    with pytest.raises(LeaseExpired):
        cache.check_lease(lease_id)


def test_a_plan_over_another_presence_test_counts_every_rank_too(cache: Cache) -> None:
    # Promotion and routers plan over what the lower tiers hold: the same rule, another presence test.
    on_disk = {(fp, g, KEYS[c]) for fp in RANKS for g in (0, 1) for c in range(4)} - {(RANKS[1], 1, KEYS[3])}
    plan = cache.plan_lookup(Shape(), KEYS, RANKS, tiers=on_disk.__contains__)
    assert plan.hit_chunks == 3  # rank 1's last Mamba state is missing: the hit stops a chunk short
    assert cache.plan_lookup(Shape(), KEYS, RANKS).hit_chunks == 0  # the pool itself holds nothing
