"""The lease table on its own (daemon/cache/leases.py): TTL expiry on an injected clock, uses counting,
release by id and by owner, unknown and expired ids, random non-zero ids, watches on a lease's
end, and, through the index that owns it, entries held against eviction until their lease ends."""

from __future__ import annotations

import pytest

from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.leases import ENDED_KEPT, Leases
from hkvd.daemon.cache.pool import HugePagePool
from hkvd.transport.errors import LeaseExpired, PermissionDenied, PoolFull


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Table:
    """The index's side of the callbacks: which keys exist, and how many leases hold each."""

    def __init__(self, keys: list[str]) -> None:
        self.held = dict.fromkeys(keys, 0)

    def hold(self, key: str) -> bool:
        if key not in self.held:
            return False
        self.held[key] += 1
        return True

    def unhold(self, key: str) -> None:
        if key in self.held:
            self.held[key] -= 1


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table() -> Table:
    return Table(["a", "b", "c"])


@pytest.fixture
def leases(table: Table, clock: Clock) -> Leases[str]:
    return Leases(table.hold, table.unhold, clock)


def test_a_lease_holds_only_the_keys_that_exist(leases: Leases[str], table: Table) -> None:
    lid = leases.take(["a", "missing", "b"], owner=1, ttl_s=10)
    assert leases.check(lid).keys == ["a", "b"]
    assert table.held == {"a": 1, "b": 1, "c": 0}
    assert leases.check(lid).uncovered(["a", "b", "c"]) == "c"
    assert leases.check(lid).uncovered(["b"]) is None
    assert len(leases) == 1 and lid in leases


def test_ttl_expiry_on_the_injected_clock(leases: Leases[str], table: Table, clock: Clock) -> None:
    lid = leases.take(["a"], owner=1, ttl_s=10)
    clock.now += 10  # at the deadline it is still live (expiry is strictly after)
    assert leases.check(lid).lease_id == lid
    clock.now += 0.001
    with pytest.raises(LeaseExpired):
        leases.check(lid)
    assert lid not in leases and table.held["a"] == 0  # the failed check ended it
    with pytest.raises(LeaseExpired):
        leases.check(lid)


def test_the_sweep_ends_only_expired_leases(leases: Leases[str], table: Table, clock: Clock) -> None:
    short = leases.take(["a"], owner=1, ttl_s=1)
    long = leases.take(["a", "b"], owner=1, ttl_s=100)
    assert leases.expire() == 0
    clock.now += 2
    assert leases.expire() == 1
    assert short not in leases and long in leases
    assert table.held == {"a": 1, "b": 1, "c": 0}
    clock.now += 100
    assert leases.expire() == 1 and len(leases) == 0
    assert table.held == {"a": 0, "b": 0, "c": 0}


def test_uses_count_down_and_the_last_use_ends_the_lease(leases: Leases[str], table: Table) -> None:
    lid = leases.take(["a"], owner=1, ttl_s=10, uses=3)
    leases.use(lid)
    leases.use(lid)
    assert leases.check(lid).uses == 1 and table.held["a"] == 1
    leases.use(lid)
    assert lid not in leases and table.held["a"] == 0
    leases.use(lid)  # unknown now: a no-op
    assert len(leases) == 0


def test_release_by_id_and_by_owner(leases: Leases[str], table: Table) -> None:
    mine = leases.take(["a"], owner=1, ttl_s=10)
    theirs = leases.take(["a", "b"], owner=2, ttl_s=10)
    assert not leases.release(theirs, owner=1)  # another connection's lease: refused, still held
    assert theirs in leases and table.held["a"] == 2
    assert leases.release(mine, owner=1)
    assert not leases.release(mine)  # already gone
    assert leases.release(theirs)  # without an owner: any
    assert table.held == {"a": 0, "b": 0, "c": 0}


def test_release_owner_ends_every_lease_of_a_connection(leases: Leases[str], table: Table) -> None:
    for _ in range(3):
        leases.take(["a"], owner=7, ttl_s=10)
    other = leases.take(["b"], owner=8, ttl_s=10)
    assert leases.release_owner(7) == 3
    assert leases.release_owner(7) == 0
    assert list(table.held.values()) == [0, 1, 0] and other in leases


def test_a_watch_hears_written_only_when_every_use_wrote(leases: Leases[str]) -> None:
    heard: list[tuple[str, bool]] = []
    ok = leases.take(["a"], owner=1, ttl_s=10, uses=2)
    bad = leases.take(["b"], owner=1, ttl_s=10, uses=2)
    leases.watch(ok, 1, lambda w: heard.append(("ok", w)))
    leases.watch(bad, 1, lambda w: heard.append(("bad", w)))
    leases.use(ok, written=True)
    leases.use(bad, written=False)  # one rank's retrieve failed
    assert heard == []  # each has a rank to go
    leases.use(ok, written=True)
    leases.use(bad, written=True)
    assert heard == [("ok", True), ("bad", False)]


def test_a_watch_hears_not_written_on_release_expiry_and_owner_loss(leases: Leases[str], clock: Clock) -> None:
    heard: list[bool] = []
    ids = [leases.take(["a"], owner=1, ttl_s=10) for _ in range(3)]
    for lid in ids:
        leases.watch(lid, 1, heard.append)
    leases.release(ids[0])
    clock.now += 11
    assert leases.expire() == 2
    assert heard == [False, False, False]
    lid = leases.take(["a"], owner=2, ttl_s=10)
    leases.watch(lid, 2, heard.append)
    leases.release_owner(2)
    assert heard == [False] * 4


def test_a_watch_after_the_lease_ended_written_hears_it_once(leases: Leases[str]) -> None:
    heard: list[bool] = []
    lid = leases.take(["a"], owner=1, ttl_s=10)
    leases.use(lid, written=True)  # the retrieve ended before the watch came
    with pytest.raises(LeaseExpired):
        leases.watch(lid, 2, heard.append)  # another connection learns nothing of it
    leases.watch(lid, 1, heard.append)
    assert heard == [True]
    with pytest.raises(LeaseExpired, match="ended without every retrieve written"):
        leases.watch(lid, 1, heard.append)  # told once
    failed = leases.take(["a"], owner=1, ttl_s=10)
    leases.use(failed, written=False)
    with pytest.raises(LeaseExpired):
        leases.watch(failed, 1, heard.append)
    assert heard == [True]


def test_only_the_owner_may_watch_and_ended_leases_are_kept_bounded(leases: Leases[str]) -> None:
    lid = leases.take(["a"], owner=1, ttl_s=10)
    with pytest.raises(PermissionDenied, match="another connection"):
        leases.watch(lid, 2, lambda w: None)
    first = [leases.take(["a"], owner=1, ttl_s=10) for _ in range(ENDED_KEPT + 1)]
    for x in first:
        leases.use(x, written=True)
    with pytest.raises(LeaseExpired):  # the oldest was forgotten
        leases.watch(first[0], 1, lambda w: None)
    heard: list[bool] = []
    leases.watch(first[-1], 1, heard.append)
    assert heard == [True]


def test_unknown_ids_are_refused(leases: Leases[str]) -> None:
    with pytest.raises(LeaseExpired, match="expired or unknown"):
        leases.check(12345)
    with pytest.raises(LeaseExpired):
        leases.check(0)
    assert not leases.release(12345)


def test_ids_are_random_non_zero_and_distinct(leases: Leases[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ids = {leases.take(["a"], owner=1, ttl_s=10) for _ in range(200)}
    assert len(ids) == 200 and 0 not in ids
    assert all(0 < i < 1 << 63 for i in ids)
    assert max(ids) > 1 << 40  # not a counter
    # A zero draw and a repeat of a live id are both drawn again.
    live = next(iter(ids))
    draws = iter([0, live, 42])
    monkeypatch.setattr("hkvd.daemon.cache.leases.secrets.randbits", lambda _bits: next(draws))
    assert leases.take(["a"], owner=1, ttl_s=10) == 42


# ---- through the index: a lease holds READY entries against eviction ----------------------------

SB = 32 << 20
ENTRY = 4 << 20  # 16 entries fill the two-superblock pool
FP = b"f" * 16


@pytest.fixture
def pool():
    p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def _key(i: int) -> tuple[bytes, int, bytes]:
    return (FP, 0, i.to_bytes(16, "little"))


def _write(index: Index, i: int) -> None:
    e = index.begin_write(_key(i), ENTRY, "full", 1)
    assert e is not None
    index.finish_write(e, pending=False)


def test_leased_entries_are_not_evicted_until_the_lease_ends(pool: HugePagePool, clock: Clock) -> None:
    index = Index(pool, make_policy("lru"), clock=clock)
    for i in range(16):
        _write(index, i)
    lid = index.leases.take([_key(i) for i in range(16)], owner=1, ttl_s=5)
    assert index.statistics().leases == 1 and index.statistics().pinned_entries == 16
    with pytest.raises(PoolFull):
        index.begin_write(_key(100), ENTRY, "full", 2)
    clock.now += 6
    assert index.leases.expire() == 1
    assert index.statistics().leases == 0 and index.statistics().pinned_entries == 0
    _write(index, 100)  # the oldest entry goes now
    assert index.get(_key(0)) is None and index.get(_key(100)) is not None
    del lid


def test_an_index_lease_holds_only_ready_entries(pool: HugePagePool, clock: Clock) -> None:
    index = Index(pool, make_policy("lru"), clock=clock)
    _write(index, 0)
    writing = index.begin_write(_key(1), ENTRY, "full", 2)
    assert writing is not None
    lid = index.leases.take([_key(0), _key(1), _key(2)], owner=1, ttl_s=5, uses=2)
    lease = index.leases.check(lid)
    assert lease.keys == [_key(0)] and lease.uses == 2
    assert index.get(_key(0)).leases == 1 and writing.leases == 0  # type: ignore[union-attr]
    index.leases.use(lid)
    index.leases.use(lid)
    assert index.get(_key(0)).leases == 0  # type: ignore[union-attr]
    with pytest.raises(LeaseExpired):
        index.leases.check(lid)


def test_a_dropped_entry_is_skipped_on_release(pool: HugePagePool, clock: Clock) -> None:
    index = Index(pool, make_policy("lru"), clock=clock)
    _write(index, 0)
    _write(index, 1)
    lid = index.leases.take([_key(0), _key(1)], owner=3, ttl_s=5)
    e0 = index.get(_key(0))
    assert e0 is not None
    index.drop(e0)  # an invalidated entry goes even while leased
    assert index.leases.release(lid, owner=3)
    assert index.get(_key(1)).leases == 0  # type: ignore[union-attr]
    assert index.leases.release_owner(3) == 0
