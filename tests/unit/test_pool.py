"""HugePagePool and SlabAllocator: allocator invariants (hypothesis) and the real mapping."""

from __future__ import annotations

import ctypes
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvd.daemon.cache import pool as pool_mod
from hkvd.daemon.cache.pool import PAGE, Allocation, HugePagePool, SlabAllocator
from hkvd.transport.errors import PoolError

KIB = 1024
MIB = 1024 * KIB
SB = 64 * KIB  # small superblocks keep hypothesis cases fast; the arithmetic is size-independent
CAPACITY = 32 * SB

sizes = st.one_of(
    st.integers(1, 3 * PAGE),  # sub-page and few-page entries
    st.integers(1, SB),  # up to one superblock
    st.integers(SB // 2, 5 * SB),  # split entries
)
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 10**6)), min_size=1, max_size=120)


def check_invariants(a: SlabAllocator, live: list[Allocation]) -> None:
    intervals: list[tuple[int, int]] = []
    for al in live:
        assert sum(e.length for e in al.extents) == al.nbytes
        assert al.slot_bytes % PAGE == 0 and al.slot_bytes <= a.superblock_bytes
        for e in al.extents:
            assert 0 < e.length <= al.slot_bytes
            # Slot-aligned within its superblock and never crossing into the next one.
            assert (e.pool_offset % a.superblock_bytes) % al.slot_bytes == 0
            assert (
                e.pool_offset // a.superblock_bytes
                == (e.pool_offset + al.slot_bytes - 1) // a.superblock_bytes
            )
            intervals.append((e.pool_offset, e.pool_offset + al.slot_bytes))
    intervals.sort()
    for (_, e0), (s1, _) in itertools.pairwise(intervals):
        assert e0 <= s1, "live allocations overlap"
    if intervals:
        assert intervals[0][0] >= 0 and intervals[-1][1] <= a.capacity
    st_ = a.statistics()
    assert st_.allocations == len(live)
    assert st_.used_bytes == sum(al.nbytes for al in live)
    assert st_.reserved_bytes == sum(al.slot_bytes * len(al.extents) for al in live)
    assert st_.free_bytes == st_.total_bytes - st_.reserved_bytes
    assert st_.superblocks_free + sum(c.superblocks for c in st_.classes) == st_.superblocks_total
    for c in st_.classes:
        # A class owns no fully free superblock (those go back to the global list), so each of
        # its superblocks holds at least one live slot.
        assert c.superblocks >= 1
        assert c.used_slots >= c.superblocks
        assert c.used_slots + c.free_slots == c.superblocks * c.slots_per_superblock


@settings(max_examples=200, deadline=None)
@given(ops)
def test_allocator_invariants_under_random_alloc_free(sequence: list[tuple[bool, int, int]]) -> None:
    a = SlabAllocator(CAPACITY, SB)
    live: list[Allocation] = []
    for is_alloc, nbytes, pick in sequence:
        if is_alloc or not live:
            before = a.statistics()
            got = a.alloc(nbytes)
            if got is None:
                # None only when it truly does not fit: the class's free slots plus whole free
                # superblocks hold fewer slots than the plan needs. And nothing changed.
                slot, k = a.plan(nbytes)
                cls_free = sum(c.free_slots for c in before.classes if c.slot_bytes == slot)
                assert cls_free + before.superblocks_free * (SB // slot) < k
                assert a.statistics() == before
            else:
                live.append(got)
        else:
            a.free(live.pop(pick % len(live)))
        check_invariants(a, live)
    for al in live:
        a.free(al)
    end = a.statistics()
    assert end.superblocks_free == end.superblocks_total and end.classes == ()
    assert end.used_bytes == end.reserved_bytes == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(sizes, st.integers(1, 40), st.integers(0, 10**6)), min_size=1, max_size=30))
def test_alloc_many_takes_as_many_as_fit(sequence: list[tuple[int, int, int]]) -> None:
    """``alloc_many`` keeps every invariant of ``alloc`` and stops exactly where ``alloc`` would."""
    a = SlabAllocator(CAPACITY, SB)
    live: list[Allocation] = []
    for nbytes, count, pick in sequence:
        got = a.alloc_many(nbytes, count)
        assert len(got) <= count and all(al.nbytes == nbytes for al in got)
        live += got
        check_invariants(a, live)
        if len(got) < count:  # it stopped because the next one does not fit
            before = a.statistics()
            assert a.alloc(nbytes) is None and a.statistics() == before
        if live and pick % 3 == 0:  # free some, so later calls reuse holes
            for _ in range(1 + pick % 5):
                if live:
                    a.free(live.pop(pick % len(live)))
            check_invariants(a, live)
    for al in live:
        a.free(al)
    assert a.statistics().superblocks_free == a.statistics().superblocks_total


def test_alloc_many_packs_a_fresh_class_back_to_back() -> None:
    a = SlabAllocator(CAPACITY, SB)
    got = a.alloc_many(PAGE, 5)
    assert [al.extents[0].pool_offset for al in got] == [i * PAGE for i in range(5)]
    assert a.alloc_many(PAGE, 0) == []
    with pytest.raises(ValueError):
        a.alloc_many(0, 3)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4 * SB))
def test_plan_fills_every_slot(nbytes: int) -> None:
    a = SlabAllocator(CAPACITY, SB)
    slot, k = a.plan(nbytes)
    assert slot % PAGE == 0 and 0 < slot <= SB
    assert (k - 1) * slot < nbytes <= k * slot
    assert a.plan(nbytes) == (slot, k)


def test_large_entry_is_split_and_dense() -> None:
    a = SlabAllocator(64 * MIB * 4, 32 * MIB)
    # 17 MiB in one 32 MiB superblock would fill 53%; the plan must do better than 7/8.
    slot, k = a.plan(17 * MIB)
    assert k > 1 and (32 * MIB // slot) * (17 * MIB / k) >= 7 / 8 * 32 * MIB
    al = a.alloc(100 * MIB)
    assert al is not None and len(al.extents) >= 4
    assert sum(e.length for e in al.extents) == 100 * MIB


@settings(max_examples=50, deadline=None)
@given(st.lists(sizes, min_size=1, max_size=6), st.integers(1, 5 * SB))
def test_cycles_do_not_fragment(pattern: list[int], probe: int) -> None:
    """After any fill/free cycles, a fresh size gets exactly what a fresh allocator gives it."""
    a = SlabAllocator(CAPACITY, SB)
    for _ in range(3):
        live = []
        i = 0
        while (got := a.alloc(pattern[i % len(pattern)])) is not None:
            live.append(got)
            i += 1
        # Free in an interleaved order (odd then even) to stress partial superblocks.
        for al in live[1::2] + live[0::2]:
            a.free(al)

    def fill_count(alloc: SlabAllocator) -> int:
        n = 0
        while alloc.alloc(probe) is not None:
            n += 1
        return n

    assert fill_count(a) == fill_count(SlabAllocator(CAPACITY, SB))


def test_whole_pool_allocation_after_churn() -> None:
    a = SlabAllocator(CAPACITY, SB)
    small = [a.alloc(3000) for _ in range(200)]
    assert all(x is not None for x in small)
    for x in small:
        assert x is not None
        a.free(x)
    whole = a.alloc(CAPACITY)
    assert whole is not None and a.alloc(1) is None
    a.free(whole)
    assert a.statistics().superblocks_free == CAPACITY // SB


def test_free_rejects_double_and_foreign() -> None:
    a = SlabAllocator(CAPACITY, SB)
    x = a.alloc(5000)
    assert x is not None
    other = SlabAllocator(CAPACITY, SB)
    y = other.alloc(100)
    assert y is not None
    a.free(x)
    before = a.statistics()
    with pytest.raises(ValueError):
        a.free(x)
    with pytest.raises(ValueError):
        a.free(y)  # slot 0 of superblock 0 in a's terms: not live here
    assert a.statistics() == before
    with pytest.raises(ValueError):
        a.alloc(0)


def test_allocator_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError):
        SlabAllocator(CAPACITY, 1000)
    with pytest.raises(ValueError):
        SlabAllocator(SB - 1, SB)


# -- the mapping -------------------------------------------------------------------------------


def test_pool_maps_memory_at_base_addr() -> None:
    with HugePagePool(8 * MIB, hugepages="auto", superblock_bytes=2 * MIB) as p:
        assert p.kind in ("hugetlb", "thp", "plain")
        assert p.size == 8 * MIB and p.fd >= 0 and p.base_addr != 0
        p.buffer[5 * MIB : 5 * MIB + 4] = b"hkvd"
        assert ctypes.string_at(p.base_addr + 5 * MIB, 4) == b"hkvd"
        al = p.alloc(3 * MIB)
        assert al is not None and sum(e.length for e in al.extents) == 3 * MIB
        assert p.statistics().total_bytes == 8 * MIB
        p.free(al)


def test_pool_off_is_plain_and_rounds_to_2mib() -> None:
    with HugePagePool(3 * MIB, hugepages="off", superblock_bytes=2 * MIB) as p:
        assert p.kind == "plain"
        assert p.size == 4 * MIB
        assert p.allocator.statistics().superblocks_total == 2


def test_prefault_reports_progress_and_keeps_contents() -> None:
    calls: list[tuple[int, int]] = []
    with HugePagePool(
        6 * MIB, hugepages="off", progress=lambda d, t: calls.append((d, t)), superblock_bytes=2 * MIB
    ) as p:
        p.buffer[123] = 7
        rate = p.prefault()
        assert rate > 0
        assert calls and calls[-1] == (p.size, p.size)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
        assert p.buffer[123] == 7


def test_prefault_fallback_touch_keeps_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    # An advice number no kernel knows gives EINVAL, as MADV_POPULATE_WRITE does before 5.14.
    monkeypatch.setattr(pool_mod, "MADV_POPULATE_WRITE", 0x7FFF)
    with HugePagePool(4 * MIB, hugepages="off", superblock_bytes=2 * MIB) as p:
        p.buffer[0:3] = b"abc"
        p.buffer[4 * MIB - 1] = 9
        assert p.prefault() > 0
        assert bytes(p.buffer[0:3]) == b"abc" and p.buffer[4 * MIB - 1] == 9


def test_require_without_reserved_huge_pages_names_the_fix() -> None:
    info = pool_mod._meminfo()
    if info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0) >= 4 * MIB:
        pytest.skip("huge pages are reserved on this machine")
    with pytest.raises(PoolError, match="nr_hugepages"):
        HugePagePool(4 * MIB, hugepages="require", superblock_bytes=2 * MIB)


def test_bad_arguments() -> None:
    with pytest.raises(PoolError):
        HugePagePool(4 * MIB, hugepages="off", superblock_bytes=MIB)
    with pytest.raises(PoolError):
        HugePagePool(MIB, hugepages="off", superblock_bytes=2 * MIB)
    with pytest.raises(ValueError):
        HugePagePool(4 * MIB, hugepages="maybe", superblock_bytes=2 * MIB)  # type: ignore[arg-type]


def test_close_is_idempotent_and_refuses_live_views() -> None:
    p = HugePagePool(2 * MIB, hugepages="off", superblock_bytes=2 * MIB)
    view = memoryview(p._mmap)
    with pytest.raises(PoolError, match="still alive"):
        p.close()
    view.release()
    p.close()
    p.close()
    assert p.closed
    with pytest.raises(PoolError):
        p.alloc(10)
