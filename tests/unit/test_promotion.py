"""The read-through path (``hkvd.daemon.tiers.promotion.Promoter``) with scripted tiers, in-process.

A ``ScriptedTier`` holds payloads by entry key and copies them into the pool pages ``read_batch`` is
given, or fails the keys it is told to. The pool, the index and the engine's registration are the
daemon's own; no thread but the tier's read executor, no socket, no subprocess.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from hkvd.daemon.cache import Cache
from hkvd.daemon.cache.entry import EntryKey
from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.pool import Extent, HugePagePool
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.registry import EngineState, Registry
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.tiers.contract import Source, Tier
from hkvd.daemon.tiers.promotion import Promoter
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.control import EngineSpec

PAGE = 4096
CHUNK = 32  # tokens: two blocks of 16, so one entry is 2 pages
ENTRY = 2 * PAGE
KEYS = chunk_keys(list(range(6 * CHUNK)), CHUNK)


class ScriptedTier(Tier[dict[str, int]]):
    """Holds ``payloads`` (by entry key); ``failing`` keys read as I/O errors, ``gone`` keys vanish
    between ``holds`` and ``source``; ``stall`` makes ``holds`` wait until it is set."""

    label = "scripted tier"
    read_threads = 1

    def __init__(self, name: str, payloads: dict[EntryKey, bytes], pool: HugePagePool, *,
                 failing: frozenset[EntryKey] = frozenset(), gone: frozenset[EntryKey] = frozenset(),
                 budget_s: float = 5.0) -> None:
        self.name = name
        self.payloads = payloads
        self.pool = pool
        self.failing = failing
        self.gone = gone
        self.budget_s = budget_s
        self.executor = ThreadPoolExecutor(1)
        self.asked: list[list[EntryKey]] = []  # each holds() call's keys
        self.read: list[EntryKey] = []
        self.stall: asyncio.Event | None = None

    def usable(self) -> bool:
        return True

    async def holds(self, keys: Sequence[EntryKey]) -> set[EntryKey]:
        self.asked.append(list(keys))
        if self.stall is not None:
            await self.stall.wait()
        return {k for k in keys if k in self.payloads}

    def source(self, key: EntryKey, nbytes: int, kind: str, parent: bytes) -> Source | str:
        if key in self.gone:
            return "gone"
        return Source(self.payloads[key], parent)

    def offer(self, key: EntryKey, kind: str, nbytes: int, parent: bytes, extents: Sequence[Extent],
              done: Callable[[], None]) -> bool:
        return False

    def statistics(self) -> dict[str, int]:
        return {"reads": len(self.read)}

    def read_batch(self, jobs: Sequence[tuple[EntryKey, object, Sequence[Extent]]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for key, handle, extents in jobs:
            if key in self.failing or not isinstance(handle, bytes):
                out.append(OSError(f"scripted read failure of {key[2].hex()[:8]}"))
                continue
            at = 0
            for off, length in extents:
                self.pool.buffer[off:off + length] = handle[at:at + length]
                at += length
            self.read.append(key)
            out.append(None)
        return out


@pytest.fixture
def pool() -> Iterator[HugePagePool]:
    p = HugePagePool(4 << 20, "off")
    yield p
    p.close()


@pytest.fixture
def index(pool: HugePagePool) -> Cache:
    return Cache(pool, make_policy("lru"))


@pytest.fixture
def engine(pool: HugePagePool) -> Iterator[EngineState]:
    copy_engine = HostCopyEngine(pool)
    group = GroupSpec(0, "full", 16, 0, 64, "bfloat16", (View(0, 0, 1, 64 * PAGE, PAGE, PAGE),))
    # Lookup-only (no regions), as a scheduler registers: promotion needs the layout, not the engine's memory.
    yield Registry(CHUNK, copy_engine, pool=pool).register(
        EngineSpec("m", 1, 0, "t", CHUNK, 16, 8192, "none", [], [group]), 1, 1)
    copy_engine.close()


def key(engine: EngineState, chunk: int) -> EntryKey:
    return (engine.fingerprint, 0, KEYS[chunk])


def payload(chunk: int) -> bytes:
    return bytes([chunk + 1]) * ENTRY


def pool_bytes(pool: HugePagePool, index: Cache, k: EntryKey) -> bytes:
    e = index.get(k)
    assert e is not None
    return b"".join(bytes(pool.buffer[off:off + n]) for off, n in e.alloc.extents)


def store(index: Cache, pool: HugePagePool, k: EntryKey, data: bytes) -> None:
    e = index._index.begin_write(k, ENTRY, "full", 0)
    assert e is not None
    (off, n), = e.alloc.extents
    pool.buffer[off:off + n] = data
    index._index.finish_write(e, pending=False)


async def test_a_short_lookup_reads_what_the_tier_holds_into_the_pool(pool, index, engine) -> None:
    store(index, pool, key(engine, 0), payload(0))
    tier = ScriptedTier("fake", {key(engine, c): payload(c) for c in (1, 2)}, pool)
    metrics = Metrics()
    promoter = Promoter(index, metrics, [tier])

    assert await promoter.promote(engine, KEYS[:4], {}) is True

    # Asked once, for what the pool lacks; chunk 3 is nowhere, so the hit is chunks 0-2.
    assert tier.asked == [[key(engine, c) for c in (1, 2, 3)]]
    for c in (0, 1, 2):
        assert index.is_ready(key(engine, c))
        assert pool_bytes(pool, index, key(engine, c)) == payload(c)
    assert index.get(key(engine, 3)) is None
    assert metrics.get("fake_hits", kind="full") == 2


async def test_each_key_is_read_from_the_first_tier_that_holds_it(pool, index, engine) -> None:
    near = ScriptedTier("near", {key(engine, 0): payload(0)}, pool)
    far = ScriptedTier("far", {key(engine, c): b"\xff" * ENTRY for c in (0, 1)}, pool)
    promoter = Promoter(index, Metrics(), [near, far])

    assert await promoter.promote(engine, KEYS[:2], {})

    assert far.asked == [[key(engine, 1)]]  # only what the nearer tier lacks
    assert near.read == [key(engine, 0)] and far.read == [key(engine, 1)]
    assert pool_bytes(pool, index, key(engine, 0)) == payload(0)


async def test_a_failed_read_is_a_miss_and_leaves_nothing_in_the_pool(pool, index, engine) -> None:
    held = {key(engine, c): payload(c) for c in range(3)}
    tier = ScriptedTier("fake", held, pool, failing=frozenset({key(engine, 1)}), gone=frozenset({key(engine, 2)}))
    metrics = Metrics()
    promoter = Promoter(index, metrics, [tier])

    assert await promoter.promote(engine, KEYS[:3], {}) is True  # chunk 0 made it

    assert index.is_ready(key(engine, 0))
    # The failed read is dropped, never served; the chunk past it is not needed by the shorter hit.
    assert index.get(key(engine, 1)) is None and index.get(key(engine, 2)) is None
    assert metrics.get("fake_read_failures", reason="io") == 1
    assert len(index) == 1


async def test_a_tier_silent_past_its_budget_is_skipped(pool, index, engine) -> None:
    tier = ScriptedTier("slow", {key(engine, 0): payload(0)}, pool, budget_s=0.01)
    tier.stall = asyncio.Event()  # never set: holds() never answers
    metrics = Metrics()

    assert await Promoter(index, metrics, [tier]).promote(engine, KEYS[:2], {}) is False

    assert metrics.get("slow_read_failures", reason="timeout") == 1
    assert len(index) == 0


async def test_reads_never_evict_the_pool_entries_the_hit_needs(pool, index, engine) -> None:
    """A nearly full pool: reading chunks 2-4 must not evict chunk 0 or 1, which the same hit needs.

    Without the pin, the third read evicted chunk 0 (the least recent) and the lookup's hit fell
    from the pool's 2 chunks to none; with it, that read finds the pool full and the hit is 4 chunks.
    """
    taken = []
    while (a := pool.alloc(ENTRY)) is not None:  # leave room for exactly 4 entries
        taken.append(a)
    for a in taken[:4]:
        pool.free(a)
    for c in (0, 1):
        store(index, pool, key(engine, c), payload(c))
    tier = ScriptedTier("fake", {key(engine, c): payload(c) for c in (2, 3, 4)}, pool)
    metrics = Metrics()

    assert await Promoter(index, metrics, [tier]).promote(engine, KEYS[:5], {})

    assert [index.is_ready(key(engine, c)) for c in range(5)] == [True, True, True, True, False]
    assert metrics.get("fake_read_failures", reason="pool_full") == 1
    assert len(index._index.leases) == 0  # the pin is gone once the lookup can plan
