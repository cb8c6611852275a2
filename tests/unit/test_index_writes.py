"""Index.begin_writes (the store path's batch) against begin_write one entry at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvd.daemon.cache.entry import Entry, EntryState
from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.pool import PAGE, HugePagePool
from hkvd.transport.errors import PoolFull

FP = b"f" * 16
SB = 32 << 20  # the pool's superblock: two of them make the smallest pool
SIZES = (PAGE, 3 * PAGE, 4 << 20)  # small classes, and one that fills a superblock in 8 entries


@pytest.fixture(scope="module")
def pools():
    made: list[HugePagePool] = []

    def make() -> HugePagePool:
        p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def key(i: int) -> tuple[bytes, int, bytes]:
    return (FP, 0, i.to_bytes(16, "little"))


def _setup(pool: HugePagePool, existing: list[tuple[int, str]]) -> Index:
    """An index holding ``existing``: (key number, "ready" | "pinned" | "leased") entries of 4 MiB."""
    index = Index(pool, make_policy("lru"))
    for i, how in existing:
        e = index.begin_write(key(i), 4 << 20, "full", 1)
        if e is None:
            continue
        index.finish_write(e, pending=False)
        if how == "pinned":
            index.pin(e)
        elif how == "leased":
            index.leases.take([e.key], owner=1, ttl_s=60)
    return index


def _outcome(r: Entry | PoolFull | None) -> str:
    return "skip" if r is None else "full" if isinstance(r, PoolFull) else "new"


def _state(index: Index) -> tuple:
    stats = index.pool.allocator.statistics()
    return (sorted(k[2] for k in index._entries), index.statistics().evictions, stats.used_bytes,
            stats.allocations, index.writes)


existing_st = st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["ready", "ready", "pinned", "leased"])),
                       max_size=20)


@settings(max_examples=120, deadline=None)
@given(existing_st, st.lists(st.integers(0, 40), min_size=1, max_size=40), st.sampled_from(SIZES))
def test_one_size_matches_begin_write_one_by_one(pools, existing, wanted, nbytes):
    """Same answers, same entries evicted, same pool use as the loop it replaces."""
    one, many = _setup(pools(), existing), _setup(pools(), existing)
    try:
        expect = []
        for i in wanted:
            try:
                expect.append(one.begin_write(key(i), nbytes, "full", 7))
            except PoolFull as e:
                expect.append(e)
        got = many.begin_writes([(key(i), nbytes, "full", b"") for i in wanted], 7)
        assert [_outcome(r) for r in got] == [_outcome(r) for r in expect]
        for r in got:
            if isinstance(r, Entry):
                assert r.state is EntryState.WRITING and r.pins == 1 and r.job_id == 7
                assert many.get(r.key) is r
        assert _state(many) == _state(one)
    finally:
        for ix in (one, many):
            for e in list(ix._entries.values()):
                ix.pool.free(e.alloc)


@settings(max_examples=80, deadline=None)
@given(existing_st, st.lists(st.tuples(st.integers(0, 40), st.sampled_from(SIZES)), min_size=1, max_size=40))
def test_mixed_sizes_keep_the_pool_exact(pools, existing, wanted):
    """Several sizes at once: every new entry owns its room, and nothing taken in bulk is leaked."""
    index = _setup(pools(), existing)
    try:
        got = index.begin_writes([(key(i), n, "full", b"") for i, n in wanted], 3)
        seen: set[int] = {i for i, _ in existing}  # (an existing entry may be evicted on the way)
        made: set[int] = set()
        for (i, n), r in zip(wanted, got, strict=True):
            assert r is not None or i in seen  # only repeats and existing keys are skipped
            assert r is None or i not in made  # and a repeat of an entry made here always is
            if isinstance(r, Entry):
                assert r.nbytes == n and r.alloc.nbytes == n and index.get(key(i)) is r
            seen.add(i)
            if isinstance(r, Entry):
                made.add(i)
        live = list(index._entries.values())
        stats = index.pool.allocator.statistics()
        assert stats.allocations == len(live)
        assert stats.used_bytes == sum(e.nbytes for e in live)
        # Refused only where eviction could make no room: entries that are left evictable free nothing
        # for the refused size (another size class, in a superblock that a pinned entry keeps in use).
        for n in {n for (_, n), r in zip(wanted, got, strict=True) if isinstance(r, PoolFull)}:
            with pytest.raises(PoolFull):
                index._alloc_evicting(n)
    finally:
        for e in list(index._entries.values()):
            index.pool.free(e.alloc)


def test_repeated_and_existing_keys_are_skipped_and_finish_writes_publishes(pools):
    index = _setup(pools(), [(1, "ready")])
    got = index.begin_writes([(key(1), PAGE, "full", b""), (key(2), PAGE, "full", b""),
                              (key(2), PAGE, "full", b""), (key(3), PAGE, "mamba", key(2)[2])], 5)
    assert [_outcome(r) for r in got] == ["skip", "new", "skip", "new"]
    assert index.pool.allocator.statistics().allocations == 3  # the repeat's room went back
    new = [r for r in got if isinstance(r, Entry)]
    index.finish_writes(new, pending=True)
    assert all(e.state is EntryState.PENDING and e.pins == 0 for e in new)
    assert not index.is_ready(key(2))
    index.confirm(new[0])
    assert index.is_ready(key(2)) and not index.is_ready(key(3))
    other = index.begin_writes([(key(4), PAGE, "full", b"")], 6)
    index.finish_writes([r for r in other if isinstance(r, Entry)], pending=False)
    assert index.is_ready(key(4))
