"""Admission: whether an engine's new chunk may push a resident entry out of a full pool.

Role
    ``--admission none`` (the default) admits every store, as hkvd always did. ``--admission tinylfu`` keeps
    a frequency sketch of chunk keys (``daemon/cache/frequency_sketch.py``) and, when a store's entry can
    only be placed by evicting, compares the new chunk's estimated frequency with the victim's (the entry
    the eviction policy would take first): where the victim was asked for more often, the store of that
    entry is refused (``NotAdmitted``, a ``PoolFull``: the engine's store reply counts it as dropped, never an
    error) and the victim stays. Ties admit. So a flood of first-sighting chunks (one-shot prompts) cycles
    through the least used part of the pool instead of flushing a conversation that is looked up every turn.

    What counts as a sighting: a lookup counts every chunk key it asks for (``seen``); a store only marks
    the chunks it offers as seen once (``offered``: the doorkeeper), because in vLLM a store follows the
    lookup of the same request, which already counted it. A chunk stored without a lookup (a decode chunk)
    is thus seen once, and its next lookup counts it again.

    Always admitted (the index never asks): anything placed in free room, turn-end states, entries of
    chunks a session pin holds, and the entries other paths write (promotion from the lower tiers, peer
    pulls, sampled verification's scratch): those are wanted now.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hkvd.daemon.cache.frequency_sketch import FrequencySketch, key_hash
from hkvd.transport.errors import PoolFull

ADMISSIONS = ("none", "tinylfu")
SLOT_BYTES = 64 << 10  # the sketch's width: one slot per this many pool bytes (entries are 32 KiB and up)
MIN_WIDTH = 1 << 12
MAX_WIDTH = 1 << 22  # 4 rows of uint8 counters: 16 MiB at most
PERIOD_PER_ENTRY = 10  # sightings between halvings, per resident entry (TinyLFU's sample size is 10x the cache)
MIN_PERIOD = 1024


class NotAdmitted(PoolFull):
    """A store refused by admission: the entry it would evict was asked for more often than its chunk."""


class Admission:
    """``none``: every store is admitted; nothing is counted."""

    name = "none"

    def seen(self, keys: Iterable[bytes]) -> None:
        """A lookup asked for ``keys``."""

    def offered(self, keys: Iterable[bytes]) -> None:
        """A store offers ``keys`` (seen once at most: its lookup counted them already)."""

    def admits(self, candidate: bytes, victim: bytes) -> bool:
        """Whether a new entry of chunk ``candidate`` may evict an entry of chunk ``victim``."""
        return True

    def frequency(self, key: bytes) -> int:
        """The estimated sightings of ``key`` (0 where nothing is counted)."""
        return 0


class TinyLFU(Admission):
    """TinyLFU admission over a ``FrequencySketch`` sized for ``capacity`` pool bytes; ``resident()`` is the
    number of entries the pool holds now (the sketch halves every ``PERIOD_PER_ENTRY`` times that)."""

    name = "tinylfu"

    def __init__(self, capacity: int, resident: Callable[[], int]) -> None:
        width = min(max(capacity // SLOT_BYTES, MIN_WIDTH), MAX_WIDTH)
        self.sketch = FrequencySketch(width)
        self._resident = resident

    def _aging(self) -> None:
        self.sketch.period = max(PERIOD_PER_ENTRY * self._resident(), MIN_PERIOD)

    def seen(self, keys: Iterable[bytes]) -> None:
        self._aging()
        self.sketch.add(key_hash(k) for k in keys)

    def offered(self, keys: Iterable[bytes]) -> None:
        self._aging()
        self.sketch.mark(key_hash(k) for k in keys)

    def admits(self, candidate: bytes, victim: bytes) -> bool:
        est = self.sketch.estimate
        return est(key_hash(victim)) <= est(key_hash(candidate))

    def frequency(self, key: bytes) -> int:
        return self.sketch.estimate(key_hash(key))


def make_admission(name: str, capacity: int, resident: Callable[[], int]) -> Admission:
    if name == "none":
        return Admission()
    if name == "tinylfu":
        return TinyLFU(capacity, resident)
    raise ValueError(f"unknown admission {name!r}; choose one of {', '.join(ADMISSIONS)}")
