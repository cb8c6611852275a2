"""The heap policy (daemon/heap.py): frozen index objects still die by reference counting, the
policy freezes when it should, and every collection's pause is counted."""

from __future__ import annotations

import gc
import os

import pytest

from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.pool import PAGE, HugePagePool
from hkvd.daemon.heap import HeapPolicy
from hkvd.daemon.metrics import Metrics


@pytest.fixture
def unfrozen():
    """Each test starts and ends with nothing frozen (the daemon freezes; pytest must not keep it)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _fill(index: Index, fp: bytes, n: int, kinds: tuple[str, ...] = ("full",)) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    for i, k in enumerate(keys):
        for gid, kind in enumerate(kinds):
            e = index.begin_write((fp, gid, k), PAGE, kind, i, keys[i - 1] if i else b"")
            assert e is not None
            index.finish_write(e, pending=False)
    return keys


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_dropping_frozen_entries_frees_them(unfrozen, policy):
    pool = HugePagePool(64 << 20, "off")
    index = Index(pool, make_policy(policy))
    fp = os.urandom(16)
    index.set_groups(fp, {0: "full", 1: "mamba"})
    gc.collect()
    gc.freeze()
    before = gc.get_freeze_count()
    keys = _fill(index, fp, 2000, ("full", "mamba"))
    gc.collect(1)
    gc.freeze()
    grown = gc.get_freeze_count() - before
    assert grown >= 4 * 2000, "each entry should bring tracked objects (entry, allocation, chain node...)"
    for k in keys:
        for gid in (0, 1):
            e = index.get((fp, gid, k))
            assert e is not None
            index.drop(e)
    assert len(index) == 0
    left = gc.get_freeze_count() - before
    # No reference cycles among an entry's objects: reference counting alone freed them although the
    # collector no longer looks at them. A cycle per entry would leave thousands here.
    assert left < 100, f"{left} of {grown} frozen objects outlived their entries (a reference cycle?)"
    pool.close()


def test_policy_freezes_every_n_writes_and_counts_pauses(unfrozen):
    metrics = Metrics()
    heap = HeapPolicy(1000, metrics)
    heap.install()
    try:
        heap.start(writes=0)
        assert heap.freezes == 1 and gc.get_freeze_count() > 0
        assert not heap.maybe_freeze(999)
        assert heap.maybe_freeze(1000)
        assert not heap.maybe_freeze(1500)
        assert heap.maybe_freeze(2000)
        assert heap.freezes == 3
        gc.collect()
        assert metrics.get("gc_collections", generation="2") >= 1
        assert metrics.total("gc_pause_seconds") > 0
        st = heap.statistics()
        assert st.freezes == 3 and st.frozen_objects == gc.get_freeze_count() and st.max_pause_ms > 0
    finally:
        heap.uninstall()
    assert heap._on_gc not in gc.callbacks
    assert gc.get_freeze_count() == 0


def test_policy_off_freezes_nothing(unfrozen):
    heap = HeapPolicy(0, Metrics())
    heap.start(writes=0)
    assert not heap.maybe_freeze(10**9)
    assert heap.freezes == 0 and gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match=">= 0"):
        HeapPolicy(-1, Metrics())
