"""Eviction policies: which unpinned, unleased entry goes first when the pool is full.

A policy only orders candidates; the index decides whether a candidate may go (never while a copy
or a lease holds it). ``lru`` is plain least-recently-used. ``hybrid`` (hybrid-aware LRU) first
evicts entries that can no longer serve any hit -- orphans: entries whose prefix chain is broken,
and attention chunks left without any Mamba state at or after them (see ``daemon/cache/chains.py``) --
and only then falls back to LRU order. An orphan that is used by a hit again is unmarked. ``cost``
(value per byte, Greedy-Dual-Size-Frequency) evicts orphans first as ``hybrid`` does, then the entry of
lowest priority ``L + frequency * recompute cost / bytes``: ``frequency`` counts its insertion and its hits
(leases and read pins) while cached, the cost is the index's model (``daemon/cache/recompute_cost.py``),
and ``L`` rises to each evicted entry's priority, so entries that stop being used age out however costly.
A heap with lazy deletion keeps it O(log n) per insert, hit and eviction.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

#: ``weigh(key)``: an entry's recompute cost per byte (the index binds it: ``EvictionPolicy.bind``).
WeighFn = Callable[[Hashable], float]


class EvictionPolicy(ABC):
    name: str = "abstract"
    # Whether mark_orphan/unmark_orphan change the order: only then does the index keep the prefix
    # chains that find orphans (daemon/cache/chains.py; about 3 us per entry published, 4 us per drop).
    uses_orphans: bool = False

    @abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Keys in eviction order (first = evict first). The index may skip pinned ones."""

    def mark_orphan(self, key: Hashable) -> None:  # noqa: B027 - optional
        """A hint that ``key`` can no longer serve a hit; hybrid-aware policies evict it first."""

    def unmark_orphan(self, key: Hashable) -> None:  # noqa: B027 - optional
        """``key`` can serve a hit again (a state below it came back)."""

    def bind(self, weigh: WeighFn) -> None:  # noqa: B027 - optional
        """The index's value per byte of its entries, for policies that weigh them (``cost``)."""

    def spawn(self) -> EvictionPolicy:
        """A new, empty policy of the same kind and binding (one per tenant: ``daemon/cache/quotas.py``)."""
        return type(self)()

    def evicted(self, key: Hashable) -> None:  # noqa: B027 - optional
        """``key`` is being evicted (not merely dropped): ``cost`` ages by it."""

    def reason(self, key: Hashable) -> str:
        """Why ``key`` is a candidate now: "orphan" (it can serve no hit) or "policy" (its order)."""
        return "policy"

    def demote(self, key: Hashable) -> bool:
        """Put ``key`` at the front of the order (a ``demote`` hint, docs/hints.md): the first evicted, until a
        hit moves it back; False when it is in no order."""
        return False


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return _oldest_first(self._order, set())

    def demote(self, key: Hashable) -> bool:
        if key not in self._order:
            return False
        self._order.move_to_end(key, last=False)
        return True


def _oldest_first(order: OrderedDict[Hashable, None], yielded: set[Hashable]) -> Iterator[Hashable]:
    """Keys of ``order`` from the oldest, each once, while the caller evicts (removes) some of them.

    No copy of the whole order per allocation: each step looks at the front, past the keys already
    yielded that are still there (pinned or leased ones the index skipped), so the cost is the
    number of skipped keys, not the size of the cache.
    """
    while True:
        for key in order:
            if key not in yielded:
                break
        else:
            return
        yielded.add(key)
        yield key


class HybridAwarePolicy(LRUPolicy):
    """LRU, except that entries marked orphan (they cannot serve any hit any more) go first."""

    name = "hybrid"
    uses_orphans = True

    def __init__(self) -> None:
        super().__init__()
        self._orphans: OrderedDict[Hashable, None] = OrderedDict()

    def mark_orphan(self, key: Hashable) -> None:
        if key in self._order:
            self._orphans[key] = None

    def unmark_orphan(self, key: Hashable) -> None:
        self._orphans.pop(key, None)

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        self._orphans.pop(key, None)

    def touch(self, key: Hashable) -> None:
        # A touched entry is part of a hit (a lease or a retrieve), so it is not an orphan.
        super().touch(key)
        self._orphans.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        yielded: set[Hashable] = set()
        yield from _oldest_first(self._orphans, yielded)
        yield from _oldest_first(self._order, yielded)

    def reason(self, key: Hashable) -> str:
        return "orphan" if key in self._orphans else "policy"


def _unit(_: Hashable) -> float:
    return 1.0


class CostPolicy(EvictionPolicy):
    """Greedy-Dual-Size-Frequency over the bound value per byte; orphans first (module docstring)."""

    name = "cost"
    uses_orphans = True

    def __init__(self, weigh: WeighFn = _unit) -> None:
        self._weigh = weigh
        self.inflation = 0.0  # L: the priority of the last entry evicted by this order (never falls)
        self._heap: list[tuple[float, int, Hashable]] = []  # (priority, seq, key); stale items stay until popped
        self._live: dict[Hashable, tuple[float, int]] = {}  # key -> its current (priority, seq) in the heap
        self._freq: dict[Hashable, int] = {}
        self._value: dict[Hashable, float] = {}  # key -> its value per byte, weighed once at insert
        self._orphans: OrderedDict[Hashable, None] = OrderedDict()
        self._seq = 0
        self._changes = 0  # heap pushes and rebuilds: a walk that sees it move starts over

    def bind(self, weigh: WeighFn) -> None:
        self._weigh = weigh

    def spawn(self) -> EvictionPolicy:
        return CostPolicy(self._weigh)

    def priority(self, key: Hashable) -> float:
        """``key``'s priority now (lowest is evicted first); KeyError when it is in no order."""
        return self._live[key][0]

    def _push(self, key: Hashable) -> None:
        prio = self.inflation + self._freq[key] * self._value[key]
        self._seq += 1
        self._live[key] = (prio, self._seq)
        heap = self._heap
        if len(heap) > 2 * len(self._live) + 64:  # mostly stale: rebuild from the live items
            heap[:] = [(p, q, k) for k, (p, q) in self._live.items()]
            heapq.heapify(heap)
            self._changes += 1
            return
        heapq.heappush(heap, (prio, self._seq, key))
        self._changes += 1

    def insert(self, key: Hashable) -> None:
        if key not in self._live:
            self._freq[key] = 1
            self._value[key] = self._weigh(key)
        self._push(key)

    def touch(self, key: Hashable) -> None:
        if key in self._live:
            self._freq[key] += 1
            self._orphans.pop(key, None)  # part of a hit: not an orphan
            self._push(key)

    def remove(self, key: Hashable) -> None:
        if self._live.pop(key, None) is not None:
            del self._freq[key], self._value[key]
        self._orphans.pop(key, None)

    def mark_orphan(self, key: Hashable) -> None:
        if key in self._live:
            self._orphans[key] = None

    def unmark_orphan(self, key: Hashable) -> None:
        self._orphans.pop(key, None)

    def demote(self, key: Hashable) -> bool:
        # With the orphans, ahead of every priority; a hit (``touch``) takes it out again.
        if key not in self._live:
            return False
        self._orphans[key] = None
        return True

    def evicted(self, key: Hashable) -> None:
        live = self._live.get(key)
        if live is not None and key not in self._orphans:  # an orphan goes for what it is, not its priority
            self.inflation = max(self.inflation, live[0])

    def reason(self, key: Hashable) -> str:
        return "orphan" if key in self._orphans else "policy"

    def candidates(self) -> Iterator[Hashable]:
        yielded: set[Hashable] = set()
        yield from _oldest_first(self._orphans, yielded)
        while True:
            changes = self._changes
            for key in self._ascending(yielded):
                yielded.add(key)
                yield key
                if self._changes != changes:  # pushed to meanwhile: walk the new heap (yielded keys skipped)
                    break
            else:
                return

    def _ascending(self, skip: set[Hashable]) -> Iterator[Hashable]:
        """The live keys not in ``skip`` by ascending priority, without popping: a second heap of the
        first heap's positions walks its tree from the root (O(log n) per key, stale items passed)."""
        heap, live = self._heap, self._live
        if not heap:
            return
        front: list[tuple[tuple[float, int, Hashable], int]] = [(heap[0], 0)]
        n = len(heap)
        while front:
            item, i = heapq.heappop(front)
            for c in (2 * i + 1, 2 * i + 2):
                if c < n:
                    heapq.heappush(front, (heap[c], c))
            _, seq, key = item
            cur = live.get(key)
            if cur is not None and cur[1] == seq and key not in skip:
                yield key


POLICIES = ("lru", "hybrid", "cost")


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "hybrid":
        return HybridAwarePolicy()
    if name == "cost":
        return CostPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
