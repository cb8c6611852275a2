"""Eviction policies: which unpinned, unleased entry goes first when the pool is full.

A policy only orders candidates; the index decides whether a candidate may go (never while a copy
or a lease holds it). ``lru`` is plain least-recently-used. ``hybrid`` (hybrid-aware LRU) first
evicts entries that can no longer serve any hit -- orphans: entries whose prefix chain is broken,
and attention chunks left without any Mamba state at or after them (see ``daemon/cache/chains.py``) --
and only then falls back to LRU order. An orphan that is used by a hit again is unmarked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator


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


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "hybrid":
        return HybridAwarePolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose lru or hybrid")
