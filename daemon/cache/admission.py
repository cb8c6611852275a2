"""Admission: whether an engine's new chunk may push a resident entry out of a full pool.

Role
    ``--admission none`` (the default) admits every store, as hkvd always did. ``--admission tinylfu`` keeps
    a frequency sketch of chunk keys (``daemon/cache/frequency_sketch.py``) and, when a store's entry can
    only be placed by evicting, compares the new chunk's estimated frequency with the victim's (the entry
    the eviction policy would take first): where the victim was asked for more often, the store of that
    entry is refused (``NotAdmitted``, a ``PoolFull``: the engine's store reply counts it as dropped, never an
    error) and the victim stays. Ties admit. So a flood of first-sighting chunks (one-shot prompts) cycles
    through the least used part of the pool instead of flushing a conversation that is looked up every turn.

    What counts as a sighting: a lookup counts every chunk key it asks for, and the Mamba/GDN state where
    its hit ends (``seen``); a store only marks the entries it offers as seen once (``offered``: the
    doorkeeper), because in vLLM a store follows the lookup of the same request, which already counted it.
    A chunk stored without a lookup (a decode chunk) is thus seen once, and its next lookup counts it again.
    States are counted apart from their chunk (the chunk key's hash xor ``STATE_SALT``): a lookup through a
    chunk uses its attention entries, but its state only where the hit ends there, so the states a
    conversation's every turn passes over are not as frequent as its chunks.

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
STATE_SALT = 0x5EED_57A7_E000_0001  # xor-ed into a chunk key's hash: the sketch's key for the state at that chunk

#: An entry as the admission weighs it: (chunk key, group kind).
Candidate = tuple[bytes, str]


def _hash(key: bytes, kind: str) -> int:
    h = key_hash(key)
    return h ^ STATE_SALT if kind == "mamba" else h


class NotAdmitted(PoolFull):
    """A store refused by admission: the entry it would evict was asked for more often than its chunk."""


class Admission:
    """``none``: every store is admitted; nothing is counted."""

    name = "none"

    def seen(self, keys: Iterable[bytes], end: bytes | None = None) -> None:
        """A lookup asked for ``keys``; its hit ends at chunk key ``end`` (where a state served it), if any."""

    def offered(self, entries: Iterable[Candidate]) -> None:
        """A store offers ``entries`` (seen once at most: its lookup counted them already)."""

    def admits(self, candidate: Candidate, victim: Candidate) -> bool:
        """Whether a new entry ``candidate`` may evict the entry ``victim``."""
        return True

    def frequency(self, entry: Candidate) -> int:
        """The estimated sightings of ``entry`` (0 where nothing is counted)."""
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

    def seen(self, keys: Iterable[bytes], end: bytes | None = None) -> None:
        self._aging()
        hashes = [key_hash(k) for k in keys]
        if end is not None:
            hashes.append(key_hash(end) ^ STATE_SALT)
        self.sketch.add(hashes)

    def offered(self, entries: Iterable[Candidate]) -> None:
        self._aging()
        self.sketch.mark(_hash(k, kind) for k, kind in entries)

    def admits(self, candidate: Candidate, victim: Candidate) -> bool:
        est = self.sketch.estimate
        return est(_hash(*victim)) <= est(_hash(*candidate))

    def frequency(self, entry: Candidate) -> int:
        return self.sketch.estimate(_hash(*entry))


def make_admission(name: str, capacity: int, resident: Callable[[], int]) -> Admission:
    if name == "none":
        return Admission()
    if name == "tinylfu":
        return TinyLFU(capacity, resident)
    raise ValueError(f"unknown admission {name!r}; choose one of {', '.join(ADMISSIONS)}")
