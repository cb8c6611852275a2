"""Entry checksums (daemon/integrity/checksums.py) and the scrubber (daemon/integrity/scrub.py), in-process:
a real pool, index and threads; damage is a byte flipped in the pool's memory."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import xxhash

from hkvd.daemon.cache import Cache, Entry, EntryState, HugePagePool, make_policy
from hkvd.daemon.integrity.checksums import Checksums, checksum
from hkvd.daemon.integrity.scrub import Pace, Scrubber
from hkvd.daemon.tiers.disk import DiskTier

FP = b"c" * 16
SB = 2 << 20
ENTRY = 48 << 10  # split over slots (the allocator's extents)


@pytest.fixture
def pool() -> Iterator[HugePagePool]:
    p = HugePagePool(4 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def key(i: int) -> tuple[bytes, int, bytes]:
    return (FP, 0, i.to_bytes(16, "little"))


def store(cache: Cache, n: int, nbytes: int = ENTRY) -> list[Entry]:
    """``n`` READY entries of random bytes, stored as the service does (begin, copy, complete)."""
    got = cache.begin_store([(key(i), nbytes, "full", b"") for i in range(n)], job_id=1)
    entries = [e for e in got if isinstance(e, Entry)]
    assert len(entries) == n
    for e in entries:
        for off, length in e.alloc.extents:
            cache.pool.buffer[off:off + length] = os.urandom(length)
    cache.complete_store(entries, pending=False)
    return entries


def flip(cache: Cache, e: Entry, at: int = 0) -> None:
    off = e.alloc.extents[-1].pool_offset + at
    cache.pool.buffer[off] ^= 0x01


async def until(cond, what: str, timeout_s: float = 20.0) -> None:
    """Wait for ``cond()`` (``what``, for the failure) within ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110  (set by other threads and callbacks: polled)
            await asyncio.sleep(0.005)


async def checked(cache: Cache) -> Checksums:
    checks = Checksums(cache, cache.pool.buffer)
    checks.start(asyncio.get_running_loop())
    return checks


def test_checksum_is_xxh3_of_the_extents_in_order_and_sees_one_bit():
    buf = memoryview(bytearray(os.urandom(1 << 16)))
    extents = [(4096, 100), (0, 50), (60000, 3000)]
    joined = b"".join(bytes(buf[o:o + n]) for o, n in extents)
    assert checksum(buf, extents) == (xxhash.xxh3_64_intdigest(joined) or 1)
    before = checksum(buf, extents)
    buf[60000 + 2999] ^= 0x80
    assert checksum(buf, extents) != before
    assert checksum(buf, list(reversed(extents))) != checksum(buf, extents)  # order matters


def test_pace_holds_the_rate_over_any_span_and_idle_time_buys_only_a_burst():
    now = [100.0]
    rate, burst, n = 1_000_000.0, 0.1, 64 << 10
    pace = Pace(rate, lambda: now[0], burst_s=burst)
    hashed: list[tuple[float, int]] = []
    for _ in range(500):
        now[0] += pace.delay(n)
        hashed.append((now[0], n))
    start, total = hashed[0][0], sum(b for _, b in hashed)
    span = hashed[-1][0] - start
    assert total <= rate * (span + burst) + n  # never faster than the rate
    assert total >= rate * span * 0.99  # and not needlessly slower
    now[0] += 3600.0  # an hour idle
    free = 0
    while pace.delay(n) == 0:
        free += n
    assert free <= rate * burst + n
    with pytest.raises(ValueError, match="positive"):
        Pace(0)


async def test_checksums_are_taken_after_ready_off_the_loop(pool):
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    try:
        entries = store(cache, 6)
        await until(lambda: checks.taken == 6, "checksums")
        for e in entries:
            assert e.checksum == checksum(pool.buffer, e.alloc.extents)
        assert cache.statistics().checksummed == 6
    finally:
        assert checks.stop(5)


async def test_scrub_finds_a_flipped_byte_and_the_entry_is_never_served_again(pool):
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    try:
        entries = store(cache, 8)
        await until(lambda: checks.taken == 8, "checksums")
        bad = entries[3]
        flip(cache, bad, at=17)
        scrub = Scrubber(cache, checks, rate_mb=0, min_pass_s=0)  # stepped by hand: take, hash, settle
        batch = scrub.take()
        assert {e.key for e in batch} == {e.key for e in entries}
        scrub.settle(scrub.hash(batch))
        assert scrub.entries == 8 and scrub.passes == 1
        assert cache.get(bad.key) is None and not cache.is_ready(bad.key)
        assert cache.statistics().corrupt == {"checksum": 1}
        assert checks.mismatches == {"scrub": 1}
        assert all(cache.is_ready(e.key) for e in entries if e is not bad)
        scrub.settle(scrub.hash(scrub.take()))  # a second pass finds nothing more
        assert cache.statistics().corrupt == {"checksum": 1} and scrub.passes == 2
    finally:
        assert checks.stop(5)


async def test_a_pinned_or_leased_damaged_entry_is_hidden_at_once_and_dropped_when_let_go(pool):
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    try:
        a, b = store(cache, 2)
        await until(lambda: checks.taken == 2, "checksums")
        unpin = cache.pin_for_read([a])  # a retrieve's copy reads it
        lease = cache._index.leases.take([b.key], owner=1, ttl_s=60)
        flip(cache, a)
        flip(cache, b)
        scrub = Scrubber(cache, checks, rate_mb=0, min_pass_s=0)
        scrub.settle(scrub.hash(scrub.take()))
        for e in (a, b):
            assert e.state is EntryState.CORRUPT and cache.get(e.key) is e  # its pages are still in use
            assert not cache.is_ready(e.key)
        assert not cache.check_lease(cache._index.leases.take([a.key], owner=2, ttl_s=60)).keys  # no new lease takes it
        unpin()
        assert cache.get(a.key) is None
        cache.release(lease)
        assert cache.get(b.key) is None
        assert cache.statistics().corrupt == {"checksum": 2}
    finally:
        assert checks.stop(5)


async def test_the_scrubber_gives_a_checksum_to_an_entry_the_full_queue_skipped(pool):
    cache = Cache(pool, make_policy("lru"))
    checks = Checksums(cache, pool.buffer, max_queued=0)
    checks.start(asyncio.get_running_loop())
    try:
        (e,) = store(cache, 1)
        assert checks.skipped == 1 and e.checksum == 0
        scrub = Scrubber(cache, checks, rate_mb=0, min_pass_s=0)
        scrub.settle(scrub.hash(scrub.take()))
        assert scrub.adopted == 1 and e.checksum == checksum(pool.buffer, e.alloc.extents)
    finally:
        assert checks.stop(5)


async def test_the_scrub_thread_catches_damage_on_its_own(pool):
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    scrub = Scrubber(cache, checks, rate_mb=1000, min_pass_s=0.05)
    try:
        entries = store(cache, 4)
        await until(lambda: checks.taken == 4, "checksums")
        scrub.start(asyncio.get_running_loop())
        flip(cache, entries[1], at=ENTRY // 3)
        await until(lambda: cache.statistics().corrupt, "the scrubber's mismatch")
        assert cache.get(entries[1].key) is None
        await until(lambda: scrub.passes >= 2, "two passes")
        assert cache.statistics().corrupt == {"checksum": 1}
        assert scrub.statistics().scrub_entries >= 4
    finally:
        assert scrub.stop(5)
        assert checks.stop(5)


async def test_the_disk_write_refuses_bytes_damaged_since_the_checksum_and_drops_the_entry(pool, tmp_path):
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    tier = DiskTier(str(tmp_path / "l2"), 1 << 30, pool.buffer, queue_bytes=1 << 30)
    tier.open()
    tier.start(asyncio.get_running_loop())
    tier.checks = checks
    try:
        good, bad = store(cache, 2)
        await until(lambda: checks.taken == 2, "checksums")
        flip(cache, bad, at=5)
        left = [2]
        for e in (good, bad):  # the service's write-behind: pinned until done
            cache._index.pin(e)

            def done(e: Entry = e) -> None:
                cache._index.unpin(e)
                left[0] -= 1
            assert tier.offer(e.key, e.kind, e.nbytes, e.parent, e.alloc.extents, done)
        await until(lambda: left[0] == 0, "both writes")
        assert good.key in tier and bad.key not in tier  # no file of damaged bytes
        assert not list((tmp_path / "l2").rglob("*.tmp"))
        assert cache.get(bad.key) is None and cache.is_ready(good.key)
        assert checks.mismatches == {"disk_write": 1} and cache.statistics().corrupt == {"checksum": 1}
        assert tier.statistics().write_errors == 0
    finally:
        tier.close(5)
        assert checks.stop(5)


async def test_a_small_pool_is_rescanned_no_sooner_than_the_pass_interval(pool):
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    now = [0.0]
    try:
        store(cache, 3)
        scrub = Scrubber(cache, checks, rate_mb=0, clock=lambda: now[0], min_pass_s=10.0)
        assert len(scrub.take()) == 3 and scrub.passes == 1
        now[0] += 9.9
        assert scrub.take() == []  # the last pass began 9.9 s ago
        now[0] += 0.2
        assert len(scrub.take()) == 3 and scrub.passes == 2
    finally:
        assert checks.stop(5)


class _FakeMooncake:
    """Mooncake Store's client, at the cluster tier's boundary (no Mooncake here): puts are recorded."""

    put: list[str] = []

    def setup(self, *args: object) -> int:
        return 0

    def register_buffer(self, addr: int, size: int) -> int:
        return 0

    def health_check(self) -> int:
        return 0

    def batch_put_from_multi_buffers(self, keys: list[str], ptrs: object, sizes: object, cfg: object) -> list[int]:
        self.put.extend(keys)
        return [0] * len(keys)

    def close(self) -> None:
        pass


async def test_the_cluster_put_refuses_bytes_damaged_since_the_checksum_and_drops_the_entry(pool, monkeypatch):
    import sys
    import types

    from hkvd.daemon.tiers.cluster import ClusterSettings, ClusterTier
    from hkvd.daemon.tiers.cluster_value import FleetKeys, value_key

    store_mod = types.ModuleType("mooncake.store")
    store_mod.MooncakeDistributedStore = _FakeMooncake  # type: ignore[attr-defined]
    store_mod.ReplicateConfig = type("ReplicateConfig", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.store", store_mod)
    _FakeMooncake.put = []
    cache = Cache(pool, make_policy("lru"))
    checks = await checked(cache)
    tier = ClusterTier(ClusterSettings("mooncake://127.0.0.1:50051", 1 << 20, local_host="127.0.0.1"),
                       FleetKeys.load(""), pool.buffer, pool.base_addr)
    tier.checks = checks
    tier.start(asyncio.get_running_loop())
    try:
        await until(tier.usable, "the fake store joined")
        good, bad = store(cache, 2)
        await until(lambda: checks.taken == 2, "checksums")
        flip(cache, bad, at=ENTRY - 1)
        left = [2]
        for e in (good, bad):
            cache._index.pin(e)

            def done(e: Entry = e) -> None:
                cache._index.unpin(e)
                left[0] -= 1
            assert tier.offer(e.key, e.kind, e.nbytes, e.parent, e.alloc.extents, done)
        await until(lambda: left[0] == 0, "both puts")
        assert _FakeMooncake.put == [value_key(good.key)]  # the damaged bytes never left the node
        assert cache.get(bad.key) is None and cache.is_ready(good.key)
        assert checks.mismatches == {"cluster_put": 1} and cache.statistics().corrupt == {"checksum": 1}
    finally:
        await asyncio.to_thread(tier.close, 5)
        assert checks.stop(5)
