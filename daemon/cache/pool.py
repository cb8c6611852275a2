"""The daemon's huge-page pool and its superblock allocator.

Role
    ``HugePagePool`` owns one shared-memory mapping (a memfd, so the pool can later be handed
    to peers or registered for DMA by fd) that holds every cached entry. ``SlabAllocator``
    carves it into entries. The index decides *which* entries live; this module only decides
    *where*.

    Backing, best first:
      - ``hugetlb``: ``memfd_create(MFD_HUGETLB)`` when enough huge pages are reserved
        (``HugePages_Free * Hugepagesize >= size`` in /proc/meminfo). 2 MiB pages cut TLB
        misses during 10+ GB/s copies and are reserved at mmap time, so no SIGBUS later.
      - ``thp``: a plain memfd madvised ``MADV_HUGEPAGE``; the kernel backs it with
        transparent huge pages when ``shmem_enabled`` allows it.
      - ``plain``: 4 KiB pages (``hugepages="off"``, or THP disabled for shmem).

Allocator
    The pool is cut into fixed superblocks. A superblock is either free (global min-heap, so
    the low end of the pool is reused first) or owned by exactly one size class and cut into
    equal slots. An allocation of ``nbytes`` takes ``k`` slots of one class, where the slot is
    ``ceil(nbytes / k)`` rounded up to 4 KiB; ``k > 1`` splits entries larger than a superblock
    and also entries that would waste a large tail of one (see ``plan_slots``). When the last
    slot of a superblock is freed the superblock returns to the global free list, so a class can
    never hoard memory another class needs: fragmentation is bounded by the live entries, not
    by history. ``alloc`` is O(k + log S), ``free`` O(k + log S) for S superblocks.

    Superblock size (``superblock_bytes_for``): 1/64 of the pool, rounded down to a power of
    two and clamped to [2 MiB, 32 MiB]: 2 MiB below a 256 MiB pool (32 superblocks in a 64 MiB
    one), 4 MiB at 256 MiB, 16 MiB for the default 1 GiB, 32 MiB from 2 GiB on. Always a
    multiple of 2 MiB, so a superblock never shares a huge page with another. A fixed 32 MiB
    made a 64 MiB pool two superblocks: four entry sizes need four, and one hybrid chunk did
    not fit.

Overhead bound (what "fits by bytes" means)
    - Slot rounding: for entries of 32 KiB or more (every KV entry of a real model), a class's
      slots carry payload on at least 7/8 of each superblock they take (``_TARGET_DENSITY``;
      checked for every superblock size above). Smaller entries pay the 4 KiB page rounding.
    - Stranding: a class's free slots serve that class only. A pool filled without frees has at
      most one superblock with free slots per class, so with C entry sizes it holds at least
      ``7/8 * (capacity - C * superblock_bytes)`` bytes of entries: for a 64 MiB pool and four
      sizes, 49 MiB; for 1 GiB and four sizes, 840 MiB. After frees, a class refills its own
      holes before it takes a free superblock, and the index's eviction (daemon/cache/index.py)
      evicts only entries whose freeing makes room: entries of the size class it needs, or every
      entry of a superblock at once.
    - ``superblocks_needed`` / ``smallest_pool_bytes`` give the exact room an empty pool needs
      for a set of entries at once; registration refuses an engine whose one chunk does not fit.

Pre-fault and admission
    ``HugePagePool(faulted_only=True)`` (the daemon) starts with an allocator that may hand out
    nothing: ``start_prefault(threads)`` faults superblocks in on background threads, in pool
    order, with one ``MADV_POPULATE_WRITE`` per superblock, and admits each to the free heap only
    once it is fully faulted (daemon/cache/prefault.py). The daemon serves once a first slice is in; no
    copy ever lands in unfaulted memory, and a page that cannot be had (hugetlb reservation gone,
    cgroup limit, bound NUMA node full) is a ``PoolError`` from ``populate``, never a SIGBUS in a
    copy. Without ``faulted_only`` every superblock is admitted at once and faults on first touch
    (tools, benches); ``prefault()`` then faults them all and waits.

    ``backing()`` reports what the kernel put behind the mapping (daemon/cache/backing.py:
    /proc/self/smaps), which is what status shows, not the kind asked for. ``numa_node`` binds the
    mapping with ``mbind(MPOL_BIND)`` before the first fault.

Threading
    The allocator is guarded by one ``threading.Lock`` (uncontended: ~50 ns), so the loop can
    allocate while a copy thread frees after a failed copy and a pre-fault thread admits a
    superblock. The mapping itself is shared by every copy and pre-fault thread; pre-fault
    threads only write to superblocks not yet admitted (the fallback touch rewrites bytes in
    place), so they may run while the pool serves. ``close`` stops and joins them first, and
    must not race with copies.

Contracts
    - ``alloc`` returns ``None`` when the request does not fit *now*; the caller evicts and
      retries. It raises ``ValueError`` for nbytes <= 0 and never returns a partial allocation.
      ``alloc_many(nbytes, count)`` returns as many whole allocations as fit now (0 to count).
    - The extents of an ``Allocation`` are disjoint from every other live allocation's, lie in
      ``[0, capacity)``, and their lengths sum to exactly ``nbytes`` (the logical entry bytes,
      mapped in order by ``hkvd.transport.layout.segments_for_entry``).
    - ``free`` of an allocation that is not live raises ``ValueError`` and changes nothing.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, cast

from hkvd.daemon.cache.backing import Backing, bind, observe, thp_page_size
from hkvd.daemon.cache.prefault import Prefaulter, PrefaultStats
from hkvd.transport.errors import PoolError
from hkvd.transport.libc import LIBC
from hkvd.transport.stat_fields import Metric, Sample, metric, metrics, part, status_only

PAGE = 4096
HUGE_PAGE = 2 * 1024 * 1024
# Superblock size bounds (see ``superblock_bytes_for``): a huge page at least, 32 MiB at most (a
# 32 MiB superblock already holds 8+ slots of every entry up to 4 MiB), about 1/64 of the pool.
MIN_SUPERBLOCK_BYTES = HUGE_PAGE
MAX_SUPERBLOCK_BYTES = 32 * 1024 * 1024
_SUPERBLOCKS_PER_POOL = 64
# Not exported by Python 3.11's mmap module; Linux >= 5.14. Faults the range in for writing
# without touching the bytes, in-kernel: ~10x faster than a Python-driven touch loop.
MADV_POPULATE_WRITE = 23
# A split plan is accepted once at least 7/8 of every superblock of its class carries payload;
# otherwise up to 8 slot counts are tried and the densest wins. Example with 32 MiB superblocks:
# a 17 MiB entry in one slot fills 53%; in 3 slots of 5.67 MiB, 5 per superblock, it fills 88%.
_TARGET_DENSITY = 7 / 8
_MAX_EXTRA_SPLITS = 8


def _load_madvise() -> Callable[[int, int, int], int]:
    """libc's ``madvise`` through ctypes, which drops the GIL for the call. ``mmap.madvise`` holds
    it: a background populate of one superblock then stalls the daemon's event loop for as long as
    the fault takes (15 ms for 32 MiB on an idle VM, far more under load)."""
    libc = LIBC
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


_madvise = _load_madvise()

HugePagesMode = Literal["auto", "require", "off"]
ProgressFn = Callable[[int, int], None]


class Extent(NamedTuple):
    pool_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """A live piece of the pool: ``extents`` in logical order, summing to ``nbytes``."""

    extents: tuple[Extent, ...]
    nbytes: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class SizeClassStats:
    """One size class of the allocator: its slots and the superblocks they take."""

    slot_bytes: int = status_only()
    slots_per_superblock: int = status_only()
    superblocks: int = status_only()
    used_slots: int = status_only()
    free_slots: int = status_only()


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """The allocator's occupancy (``SlabAllocator.statistics()``); ``PoolStats`` shows part of it."""

    total_bytes: int = status_only()  # allocator capacity: whole superblocks only
    used_bytes: int = status_only()  # payload bytes of live allocations
    reserved_bytes: int = status_only()  # slot bytes held by live allocations (>= used_bytes: 4 KiB rounding)
    free_bytes: int = status_only()  # total - reserved: every byte no live allocation holds
    free_superblock_bytes: int = status_only()  # available to any size class right now
    superblock_bytes: int = status_only()
    superblocks_total: int = status_only()
    superblocks_free: int = status_only()
    allocations: int = status_only()
    # whole superblocks alloc may use: in the daemon, those faulted in so far
    admitted_bytes: int = status_only(default=0)
    classes: tuple[SizeClassStats, ...] = status_only(default=())


def _occupancy(used: int, pool: PoolStats) -> list[Sample]:
    return [({}, used / max(pool.total_bytes, 1))]


def _page_size(page_size: int, pool: PoolStats) -> list[Sample]:
    return [({"kind": pool.kind}, float(page_size))]


_POOL_BYTES = "Pool bytes by state"


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The pool as ``hkvd status`` shows it (``pool``): occupancy, the backing the kernel reports
    (``kind``, ``page_size``: daemon/cache/backing.py), what was asked (``hugepages``), the faulted share and
    the pre-fault's state, the NUMA placement."""

    total_bytes: int = metric("hkvd_pool_bytes", _POOL_BYTES, labels={"state": "total"})
    used_bytes: int = metrics(Metric("hkvd_pool_bytes", _POOL_BYTES, labels=(("state", "used"),)),
                              Metric("hkvd_pool_occupancy_ratio", "Used / total pool bytes", samples=_occupancy))
    free_bytes: int = metric("hkvd_pool_bytes", _POOL_BYTES, labels={"state": "free"})
    kind: str = status_only()  # hugetlb, thp or plain, as the kernel reports it
    page_size: int = metric("hkvd_pool_page_size_bytes", "Page size backing the pool, by the kind the kernel "
                            "reports (hugetlb, thp or plain; /proc/self/smaps)", samples=_page_size)
    huge_bytes: int = metric("hkvd_pool_huge_bytes", "Pool bytes backed by huge pages (hugetlb or THP)")
    hugepages: str = status_only()  # --hugepages: what was asked
    mapped_kind: str = status_only()  # what the mapping was made as
    superblock_bytes: int = status_only()
    faulted_bytes: int = metric("hkvd_pool_bytes", _POOL_BYTES, labels={"state": "faulted"})
    prefault: PrefaultStats | None = part()  # None: no pre-fault started
    numa_node: int | None = status_only()
    numa_policy: str = status_only()
    node_bytes: dict[str, int] = status_only()  # resident bytes per NUMA node


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def superblock_bytes_for(pool_bytes: int) -> int:
    """The superblock size of a ``pool_bytes`` pool: ~1/64 of it, a power of two in [2 MiB, 32 MiB]."""
    target = max(pool_bytes // _SUPERBLOCKS_PER_POOL, 1)
    return min(max(1 << (target.bit_length() - 1), MIN_SUPERBLOCK_BYTES), MAX_SUPERBLOCK_BYTES)


def plan_slots(nbytes: int, superblock_bytes: int) -> tuple[int, int]:
    """Return (slot_bytes, k): an entry of ``nbytes`` takes k slots of that class. Pure: same size,
    same class. Every slot carries payload: (k - 1) * slot_bytes < nbytes <= k * slot_bytes."""
    sb = superblock_bytes
    k_min = -(-nbytes // sb)
    best: tuple[float, int, int] | None = None
    for k in range(k_min, k_min + _MAX_EXTRA_SPLITS):
        # ceil(n/k) <= sb for k >= k_min, and sb is a PAGE multiple, so slot <= sb.
        slot = _round_up(-(-nbytes // k), PAGE)
        if (k - 1) * slot >= nbytes:
            break  # page rounding left the last slot empty; larger k only gets worse
        density = (sb // slot) * nbytes / k / sb
        if density >= _TARGET_DENSITY:
            return slot, k
        if best is None or density > best[0]:
            best = (density, slot, k)
    assert best is not None
    return best[1], best[2]


def superblocks_needed(sizes: Iterable[int], superblock_bytes: int) -> int:
    """How many superblocks an empty allocator takes to hold one entry of each of ``sizes`` at once:
    per size class, its slots over the slots a superblock holds, rounded up."""
    slots: dict[int, int] = {}
    for nbytes in sizes:
        slot, k = plan_slots(nbytes, superblock_bytes)
        slots[slot] = slots.get(slot, 0) + k
    return sum(-(-n // (superblock_bytes // slot)) for slot, n in slots.items())


def smallest_pool_bytes(sizes: Sequence[int], superblock_bytes: int | None = None, above: int = 0) -> int:
    """The smallest pool size over ``above`` (a 2 MiB multiple) that holds one entry of each of
    ``sizes`` at once, with superblocks derived from the pool size (``superblock_bytes=None``, as
    ``HugePagePool`` does) or fixed.

    The superblock size grows with the pool in steps, and a larger superblock can strand more,
    so this checks each step's range of pool sizes rather than assuming bigger always fits.
    """
    floor = _round_up(above + 1, HUGE_PAGE)
    if superblock_bytes:
        return max(floor, superblocks_needed(sizes, superblock_bytes) * superblock_bytes)
    best = 0
    sb = MIN_SUPERBLOCK_BYTES
    while sb <= MAX_SUPERBLOCK_BYTES:
        # Pools whose superblock is sb: [64 sb, 128 sb), from the smallest pool at the floor and
        # without end at the cap (superblock_bytes_for).
        lo = MIN_SUPERBLOCK_BYTES if sb == MIN_SUPERBLOCK_BYTES else _SUPERBLOCKS_PER_POOL * sb
        hi = None if sb == MAX_SUPERBLOCK_BYTES else 2 * _SUPERBLOCKS_PER_POOL * sb
        size = max(floor, lo, superblocks_needed(sizes, sb) * sb)
        if (hi is None or size < hi) and (not best or size < best):
            best = size
        sb *= 2
    return best


@dataclass(slots=True)
class _SizeClass:
    slot_bytes: int
    per_superblock: int
    # Superblocks of this class with at least one free slot, in insertion order: a dict is an
    # O(1) ordered set, and taking the oldest partial superblock first lets newer ones drain.
    partial: dict[int, None] = field(default_factory=dict)
    superblocks: int = 0
    free_slots: int = 0
    used_slots: int = 0


@dataclass(slots=True)
class _Superblock:
    size_class: _SizeClass
    live: bytearray  # 1 per slot handed out; catches double and foreign frees
    free: list[int]  # freed slot indices (stack)
    next_unused: int = 0  # slots >= this were never handed out: carved lazily, O(1) assignment
    used: int = 0


class SlabAllocator:
    """Superblock/size-class allocator over ``[0, capacity)`` offsets. See the module docstring."""

    def __init__(self, capacity: int, superblock_bytes: int | None = None, *, admitted: bool = True) -> None:
        if superblock_bytes is None:
            superblock_bytes = superblock_bytes_for(capacity)
        if superblock_bytes <= 0 or superblock_bytes % PAGE:
            raise ValueError(f"superblock_bytes must be a positive multiple of 4096, got {superblock_bytes}")
        if capacity < superblock_bytes:
            raise ValueError(f"capacity {capacity} is smaller than one superblock ({superblock_bytes})")
        self.superblock_bytes = superblock_bytes
        self.num_superblocks = capacity // superblock_bytes
        self.capacity = self.num_superblocks * superblock_bytes
        self._lock = threading.Lock()
        # Only admitted superblocks are ever handed out (``admit``): the daemon admits each once it is
        # faulted in. ``admitted=False`` starts with none; the default admits all (memory faults on first touch).
        self._admitted = bytearray([1 if admitted else 0]) * self.num_superblocks
        self._admitted_count = self.num_superblocks if admitted else 0
        self._free_superblocks: list[int] = list(range(self.num_superblocks)) if admitted else []  # sorted heap
        self._superblocks: list[_Superblock | None] = [None] * self.num_superblocks
        self._classes: dict[int, _SizeClass] = {}
        self._plans: dict[int, tuple[int, int]] = {}  # nbytes -> plan(nbytes); engines use a few sizes
        self._used_bytes = 0
        self._reserved_bytes = 0
        self._allocations = 0

    # -- planning ------------------------------------------------------------------------------

    def plan(self, nbytes: int) -> tuple[int, int]:
        """Return (slot_bytes, k): ``alloc(nbytes)`` takes k slots of that class (``plan_slots``)."""
        return plan_slots(nbytes, self.superblock_bytes)

    def holds(self, sizes: Iterable[int]) -> bool:
        """Whether this allocator, empty, holds one entry of each of ``sizes`` at once."""
        return superblocks_needed(sizes, self.superblock_bytes) <= self.num_superblocks

    def superblock_of(self, pool_offset: int) -> int:
        """The index of the superblock that holds ``pool_offset``."""
        return pool_offset // self.superblock_bytes

    def live_slots(self, superblock: int) -> int:
        """Slots handed out in ``superblock`` (0 when it is free): it is free again once they are.
        Read without the lock: a hint for the eviction walk, which then retries ``alloc``."""
        block = self._superblocks[superblock]
        return 0 if block is None else block.used

    def admit(self, first: int, count: int) -> None:
        """Let ``alloc`` use superblocks ``[first, first + count)`` from now on (idempotent)."""
        if first < 0 or count < 0 or first + count > self.num_superblocks:
            raise ValueError(f"superblocks [{first}, {first + count}) are outside [0, {self.num_superblocks})")
        with self._lock:
            for index in range(first, first + count):
                if not self._admitted[index]:
                    self._admitted[index] = 1
                    self._admitted_count += 1
                    heapq.heappush(self._free_superblocks, index)

    def is_admitted(self, pool_offset: int) -> bool:
        """Whether the superblock holding ``pool_offset`` may be handed out (is faulted, in the daemon)."""
        return bool(self._admitted[pool_offset // self.superblock_bytes])

    # -- alloc / free -------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Allocation | None:
        """Take room for ``nbytes``; ``None`` when it does not fit now (evict and retry)."""
        got = self.alloc_many(nbytes, 1)
        return got[0] if got else None

    def alloc_many(self, nbytes: int, count: int) -> list[Allocation]:
        """Up to ``count`` allocations of ``nbytes`` each, as many as fit now, under one lock.

        A store of many same-sized entries takes its room in one call (one plan lookup, one
        lock); consecutive allocations of a class come from consecutive free slots where there
        are some, so their pool bytes are often adjacent and their copies merge.
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        planned = self._plans.get(nbytes)
        if planned is None:
            if len(self._plans) >= 4096:  # sizes come from registered layouts: few, but keep it bounded
                self._plans.clear()
            planned = self._plans[nbytes] = self.plan(nbytes)
        slot, k = planned
        out: list[Allocation] = []
        with self._lock:
            cls = self._classes.get(slot)
            per_sb = self.superblock_bytes // slot
            have = cls.free_slots if cls is not None else 0
            fit = min(count, (have + len(self._free_superblocks) * per_sb) // k)
            if fit <= 0:
                return out
            if cls is None:
                cls = self._classes[slot] = _SizeClass(slot_bytes=slot, per_superblock=per_sb)
            take = self._take_slot
            for _ in range(fit):
                if k == 1:
                    extents: tuple[Extent, ...] = (Extent(take(cls), nbytes),)
                else:
                    parts: list[Extent] = []
                    remaining = nbytes
                    for _ in range(k):
                        parts.append(Extent(take(cls), min(slot, remaining)))
                        remaining -= slot
                    extents = tuple(parts)
                out.append(Allocation(extents, nbytes, slot))
            self._used_bytes += fit * nbytes
            self._reserved_bytes += fit * k * slot
            self._allocations += fit
        return out

    def _take_slot(self, cls: _SizeClass) -> int:
        if cls.partial:
            index = next(iter(cls.partial))
        else:
            index = heapq.heappop(self._free_superblocks)
            self._superblocks[index] = _Superblock(
                size_class=cls, live=bytearray(cls.per_superblock), free=[]
            )
            cls.superblocks += 1
            cls.free_slots += cls.per_superblock
            cls.partial[index] = None
        block = self._superblocks[index]
        assert block is not None
        if block.free:
            slot_index = block.free.pop()
        else:
            slot_index = block.next_unused
            block.next_unused += 1
        block.live[slot_index] = 1
        block.used += 1
        cls.free_slots -= 1
        cls.used_slots += 1
        if block.used == cls.per_superblock:
            del cls.partial[index]
        return index * self.superblock_bytes + slot_index * cls.slot_bytes

    def _locate(self, extent: Extent, slot: int) -> tuple[int, int]:
        index, within = divmod(extent.pool_offset, self.superblock_bytes)
        block = self._superblocks[index] if 0 <= index < self.num_superblocks else None
        if block is None or block.size_class.slot_bytes != slot or within % slot:
            raise ValueError(f"extent {extent} is not a slot of a live allocation")
        slot_index = within // slot
        if slot_index >= block.size_class.per_superblock or not block.live[slot_index]:
            raise ValueError(f"extent {extent} is not live (double free?)")
        return index, slot_index

    def free(self, allocation: Allocation) -> None:
        """Return ``allocation``'s slots. Raises ``ValueError`` (changing nothing) if not live."""
        slot = allocation.slot_bytes
        with self._lock:
            located = [self._locate(e, slot) for e in allocation.extents]
            if len(set(located)) != len(located):
                raise ValueError("allocation names the same slot twice")
            for index, slot_index in located:
                block = self._superblocks[index]
                assert block is not None
                cls = block.size_class
                block.live[slot_index] = 0
                block.free.append(slot_index)
                block.used -= 1
                cls.free_slots += 1
                cls.used_slots -= 1
                if block.used == 0:
                    # Whole superblock free again: give it back so any class can use it.
                    cls.partial.pop(index, None)
                    cls.superblocks -= 1
                    cls.free_slots -= cls.per_superblock
                    self._superblocks[index] = None
                    heapq.heappush(self._free_superblocks, index)
                    if cls.superblocks == 0:
                        del self._classes[cls.slot_bytes]
                else:
                    cls.partial[index] = None
            self._used_bytes -= allocation.nbytes
            self._reserved_bytes -= len(allocation.extents) * slot
            self._allocations -= 1

    def statistics(self) -> AllocatorStats:
        with self._lock:
            classes = tuple(
                SizeClassStats(
                    slot_bytes=c.slot_bytes,
                    slots_per_superblock=c.per_superblock,
                    superblocks=c.superblocks,
                    used_slots=c.used_slots,
                    free_slots=c.free_slots,
                )
                for c in sorted(self._classes.values(), key=lambda c: c.slot_bytes)
            )
            n_free = len(self._free_superblocks)
            return AllocatorStats(
                total_bytes=self.capacity,
                used_bytes=self._used_bytes,
                reserved_bytes=self._reserved_bytes,
                free_bytes=self.capacity - self._reserved_bytes,
                free_superblock_bytes=n_free * self.superblock_bytes,
                superblock_bytes=self.superblock_bytes,
                superblocks_total=self.num_superblocks,
                superblocks_free=n_free,
                allocations=self._allocations,
                admitted_bytes=self._admitted_count * self.superblock_bytes,
                classes=classes,
            )


# -- the mapping -------------------------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    value = int(parts[0])
                    out[key] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    except OSError:
        pass
    return out


def _shmem_thp_enabled() -> bool:
    """THP for shmem (memfd) is governed by shmem_enabled, not ``enabled``: '[never]' or '[deny]'
    means MADV_HUGEPAGE is accepted but ignored, and the pool is honestly 'plain'."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return False
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen in ("always", "within_size", "advise", "force")


class HugePagePool:
    """The daemon's shared pool. See the module docstring.

    ``size_bytes`` is rounded up to the page size of the backing; the allocator uses the whole
    superblocks that fit in it. ``superblock_bytes=None`` derives the superblock size from the
    mapped size (``superblock_bytes_for``); ``superblocks_auto`` says which it was.
    """

    def __init__(
        self,
        size_bytes: int,
        hugepages: HugePagesMode = "auto",
        progress: ProgressFn | None = None,
        superblock_bytes: int | None = None,
        *,
        faulted_only: bool = False,
        numa_node: int | None = None,
    ) -> None:
        if hugepages not in ("auto", "require", "off"):
            raise ValueError(f"hugepages must be 'auto', 'require' or 'off', got {hugepages!r}")
        smallest = MIN_SUPERBLOCK_BYTES if superblock_bytes is None else superblock_bytes
        if smallest <= 0 or smallest % HUGE_PAGE:
            raise PoolError(f"superblock size must be a positive multiple of 2 MiB, got {superblock_bytes}")
        if size_bytes < smallest:
            raise PoolError(f"pool size {size_bytes} is smaller than one superblock ({smallest})")
        self.superblocks_auto = superblock_bytes is None
        self.progress = progress
        self._closed = False
        self.kind: str
        self.page_size: int
        self.fd, self.size, self._mmap = self._map(size_bytes, hugepages)
        # The anchor exports the buffer for its address; it is dropped in close() before unmapping.
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mmap)
        self.base_addr: int = ctypes.addressof(self._anchor)
        self.buffer: memoryview = memoryview(self._mmap)
        self.hugepages = hugepages
        self.numa_node = numa_node
        self._prefaulter: Prefaulter | None = None
        self._backing: Backing | None = None
        try:
            if numa_node is not None:
                bind(self.base_addr, self.size, numa_node)  # before the first fault: pages come from the node
            # faulted_only: the allocator hands out a superblock only once prefault has faulted it in.
            self.allocator = SlabAllocator(self.size, superblock_bytes or superblock_bytes_for(self.size),
                                           admitted=not faulted_only)
        except BaseException:
            self.close()
            raise

    def _map(self, size_bytes: int, hugepages: HugePagesMode) -> tuple[int, int, mmap.mmap]:
        if hugepages != "off":
            info = _meminfo()
            huge = info.get("Hugepagesize", 0)
            free_bytes = info.get("HugePages_Free", 0) * huge
            size = _round_up(size_bytes, huge) if huge else size_bytes
            if huge and free_bytes >= size:
                try:
                    fd = os.memfd_create("hkvd-pool", os.MFD_CLOEXEC | os.MFD_HUGETLB)
                    try:
                        os.ftruncate(fd, size)
                        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    except OSError:
                        os.close(fd)
                        raise
                except OSError as exc:
                    if hugepages == "require":
                        total = info.get("HugePages_Total", 0) + size // huge
                        raise PoolError(
                            f"could not map {size} bytes of huge pages ({exc.strerror or exc}): the pages "
                            "free when hkvd checked were taken before it could reserve them; reserve more with "
                            f"`echo {total} > /proc/sys/vm/nr_hugepages` or use hugepages=off"
                        ) from exc
                else:
                    self.kind, self.page_size = "hugetlb", huge
                    return fd, size, mm
            elif hugepages == "require":
                # nr_hugepages is the total reservation, so ask for what is there plus the shortfall.
                need = (
                    info.get("HugePages_Total", 0) + (size - free_bytes) // huge
                    if huge
                    else -(-size_bytes // HUGE_PAGE)
                )
                raise PoolError(
                    f"hugepages=require but only {free_bytes} bytes of huge pages are free for a "
                    f"{size_bytes}-byte pool; reserve them with `echo {need} > /proc/sys/vm/nr_hugepages` "
                    "(as root, before starting hkvd) or run with hugepages=auto/off"
                )
        size = _round_up(size_bytes, HUGE_PAGE)  # 2 MiB multiple so THP can back every byte
        fd = os.memfd_create("hkvd-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise PoolError(f"could not map a {size}-byte pool: {exc}") from exc
        self.kind, self.page_size = "plain", PAGE
        if hugepages != "off":
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)  # must precede the first fault to get huge pages
            except OSError:
                pass
            else:
                if _shmem_thp_enabled():
                    self.kind = "thp"
        return fd, size, mm

    # -- prefault -----------------------------------------------------------------------------

    def start_prefault(self, threads: int = 1) -> Prefaulter:
        """Start faulting the pool in on ``threads`` threads (daemon/cache/prefault.py), superblock by
        superblock in pool order, admitting each to the allocator once faulted. Returns at once."""
        self._check_open()
        if self._prefaulter is not None:
            raise PoolError("the pool is already being pre-faulted")
        self._prefaulter = Prefaulter(self.populate, self.allocator.admit, capacity=self.allocator.capacity,
                                      superblock_bytes=self.allocator.superblock_bytes,
                                      page_size=self.page_size, threads=threads,
                                      on_done=lambda: self.backing(refresh=True))
        return self._prefaulter.start()

    @property
    def prefaulter(self) -> Prefaulter | None:
        return self._prefaulter

    def prefault(self, threads: int = 1) -> float:
        """Fault in every superblock and wait; return the rate reached in GB/s (1e9 bytes per second).

        An untouched page faults on first copy: copies into a cold pool run at ~0.2 GB/s against
        7-14 GB/s once faulted. ``progress(done, total)`` is called as it goes (from this thread).
        Raises ``PoolError`` when a range cannot be faulted (see ``populate``).
        """
        pf = self.start_prefault(threads)
        while not (p := pf.wait_for(pf.total_bytes, 0.25)).done:
            if self.progress is not None:
                self.progress(p.faulted_bytes, p.total_bytes)
        if p.error:
            raise PoolError(p.error)
        if self.progress is not None:
            self.progress(p.faulted_bytes, p.total_bytes)
        return p.gbps

    def populate(self, start: int, n: int) -> None:
        """Fault ``[start, start + n)`` in for writing, keeping its contents.

        ``MADV_POPULATE_WRITE`` (Linux >= 5.14) faults in-kernel and turns what would be a SIGBUS
        at first copy (hugetlb pages gone, a cgroup limit, a bound node out of memory) into an
        error here; older kernels get a read-modify-write of one byte per page, which rewrites
        bytes in place: only safe on superblocks the allocator has not handed out yet.
        """
        self._check_open()
        if not 0 <= start <= start + n <= self.size:
            raise ValueError(f"populate [{start}, {start + n}) lies outside the {self.size}-byte pool")
        if _madvise(self.base_addr + start, n, MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: kernel predates POPULATE_WRITE
            raise PoolError(self._populate_failed(start, OSError(err, os.strerror(err))))
        self._touch(start, n)

    def _populate_failed(self, start: int, exc: OSError) -> str:
        fix = ("reserve more huge pages (`echo N > /proc/sys/vm/nr_hugepages`) or lower --l1-size-gb"
               if self.kind == "hugetlb" else
               "free memory (or raise the cgroup's memory.max) or lower --l1-size-gb")
        node = f" on NUMA node {self.numa_node}" if self.numa_node is not None else ""
        return (f"pre-faulting the {self.kind} pool failed at byte {start} of {self.size}{node}: "
                f"{exc.strerror or exc}; the pool serves only the {start >> 20} MiB faulted before it; {fix}")

    def faulted_bytes(self) -> int:
        """Bytes the allocator may hand out: faulted ones in a ``faulted_only`` pool."""
        return self.allocator.statistics().admitted_bytes

    def backing(self, refresh: bool = False) -> Backing:
        """The pages backing the pool as the kernel reports them (daemon/cache/backing.py), cached: pass
        ``refresh`` (off the event loop: it walks the page tables) after faulting more."""
        self._check_open()
        if self._backing is None or refresh:
            self._backing = observe(self.base_addr, thp_page=thp_page_size())
        return self._backing

    def _touch(self, start: int, n: int) -> None:
        import numpy as np  # only on the fallback path; keeps importing this module cheap

        strided = np.frombuffer(self._mmap, dtype=np.uint8, count=n, offset=start)[::PAGE]
        strided |= 0  # read-modify-write one byte per page: faults it in, keeps contents
        del strided  # release the buffer export now so close() can unmap

    # -- allocation (delegates) ---------------------------------------------------------------

    def alloc(self, nbytes: int) -> Allocation | None:
        self._check_open()
        return self.allocator.alloc(nbytes)

    def alloc_many(self, nbytes: int, count: int) -> list[Allocation]:
        self._check_open()
        return self.allocator.alloc_many(nbytes, count)

    def free(self, allocation: Allocation) -> None:
        self.allocator.free(allocation)

    def statistics(self) -> PoolStats:
        """Occupancy, backing, pre-fault, placement; the allocator's own: ``allocator.statistics()``."""
        a = self.allocator.statistics()
        b = self.backing()
        pf = self._prefaulter.progress() if self._prefaulter is not None else None
        return PoolStats(
            total_bytes=a.total_bytes, used_bytes=a.used_bytes, free_bytes=a.free_bytes, kind=b.kind,
            page_size=b.page_size, huge_bytes=b.huge_bytes, hugepages=self.hugepages, mapped_kind=self.kind,
            superblock_bytes=self.allocator.superblock_bytes, faulted_bytes=pf.faulted_bytes if pf is not None else 0,
            prefault=PrefaultStats.of(pf) if pf is not None else None, numa_node=self.numa_node,
            numa_policy=b.numa_policy, node_bytes={str(n): v for n, v in sorted(b.node_bytes.items())})

    # -- lifetime -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap and close the fd. Idempotent. Raises ``PoolError`` if a caller still holds a
        view of ``buffer`` (unmapping under it would crash the process)."""
        if self._closed:
            return
        if self._prefaulter is not None:
            self._prefaulter.stop()  # workers write into the mapping: they end before it goes
        self.buffer.release()
        self._anchor = None
        try:
            self._mmap.close()
        except BufferError as exc:
            raise PoolError("cannot close the pool: a view of its buffer is still alive") from exc
        os.close(self.fd)
        self._closed = True

    def __enter__(self) -> HugePagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
