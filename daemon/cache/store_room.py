"""The room one engine store takes in the pool, and its pass through the admission (``Index.begin_writes``).

Role
    ``BulkRoom`` takes room per entry size in one ``alloc_many`` first; only what that could not place
    evicts, and once a size found no room for a tenant, later entries of that size and tenant are refused
    without evicting again (nothing was freed in between). ``StoreGate`` puts the entries that must evict to
    the admission (``daemon/cache/admission.py``): it remembers the lowest chunk index refused, refuses
    every later entry of the store at that index or past it that must evict (a prefix with a hole serves
    nothing past it), and counts admitted and refused entries and bytes in ``AdmissionCounts``.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hkvd.daemon.cache.admission import Admission, NotAdmitted
from hkvd.daemon.cache.entry import Entry, EntryKey
from hkvd.daemon.cache.pool import Allocation, HugePagePool
from hkvd.transport.errors import PoolFull

#: ``Index._alloc_evicting``: room for ``nbytes`` of a tenant, each victim put to ``admits`` where given.
AllocEvicting = Callable[[int, str, Callable[[Entry], bool] | None], Allocation]


@dataclass(slots=True)
class AdmissionCounts:
    """Engines' stored entries by admission outcome, since start (``IndexStats.admission_*``)."""

    admitted: int = 0
    admitted_bytes: int = 0
    refused: int = 0
    refused_bytes: int = 0


class StoreGate:
    """One store's admission: ``judged`` (an engine's store, not a turn end, under an admission that judges)
    puts each entry that must evict to ``admission``; chunks ``pinned`` holds are always admitted."""

    def __init__(self, admission: Admission, counts: AdmissionCounts, *, judged: bool, counted: bool,
                 pinned: Callable[[bytes, bytes], bool]) -> None:
        self._admission = admission
        self._counts = counts
        self._judged = judged
        self._counted = counted
        self._pinned = pinned
        self._refused_from = -1  # the lowest chunk index refused in this store (-1: none)

    def admits(self, key: EntryKey, kind: str, chunk: int, nbytes: int) -> Callable[[Entry], bool] | NotAdmitted | None:
        """For an entry that must evict: what judges its victims (None: nothing, it is admitted), or its
        refusal where an earlier chunk of the store was refused."""
        if not self._judged or self._pinned(key[0], key[2]):
            return None
        if 0 <= self._refused_from <= chunk:
            return self.refused(NotAdmitted(f"chunk {chunk}: an earlier chunk of this store was not admitted"),
                                nbytes, -1)
        return functools.partial(self._admits_over, (key[2], kind))

    def _admits_over(self, candidate: tuple[bytes, str], victim: Entry) -> bool:
        return self._admission.admits(candidate, (victim.key[2], victim.kind))

    def refused(self, e: NotAdmitted, nbytes: int, chunk: int) -> NotAdmitted:
        """Count ``e`` (the refusal of an entry of ``nbytes`` at ``chunk``, -1: unknown) and return it."""
        self._counts.refused += 1
        self._counts.refused_bytes += nbytes
        if chunk >= 0 and (self._refused_from < 0 or chunk < self._refused_from):
            self._refused_from = chunk
        return e

    def admitted(self, nbytes: int) -> None:
        if self._counted:
            self._counts.admitted += 1
            self._counts.admitted_bytes += nbytes


class BulkRoom:
    """Room for ``wants`` (``(key, nbytes, ...)``, the keys ``entries`` lacks), taken per size at once."""

    def __init__(self, pool: HugePagePool, entries: dict[EntryKey, Entry], wants: Sequence[tuple[EntryKey, int]],
                 alloc_evicting: AllocEvicting) -> None:
        self._pool = pool
        self._alloc_evicting = alloc_evicting
        need: dict[int, int] = {}
        # A repeated key takes room once: bulk room left unused (given back only at the end) would
        # hold superblocks that eviction for the later sizes cannot free.
        counted: set[EntryKey] = set()
        for key, nbytes in wants:
            if key not in entries and key not in counted:
                counted.add(key)
                need[nbytes] = need.get(nbytes, 0) + 1
        self._bulk = {nbytes: pool.alloc_many(nbytes, n) for nbytes, n in need.items()}
        self._used = dict.fromkeys(self._bulk, 0)
        self._full: dict[tuple[int, str], PoolFull] = {}  # per size and tenant: what a tenant may evict differs

    def take(self, nbytes: int, owner: str,
             admits: Callable[[], Callable[[Entry], bool] | NotAdmitted | None]) -> Allocation | PoolFull:
        """Room for one entry of ``owner``: from the bulk, else by evicting (its victims judged by what
        ``admits()`` gives, asked only then); the ``PoolFull`` where there is none, or the ``NotAdmitted``
        ``admits()`` gave. Raises the ``NotAdmitted`` of a victim the admission kept."""
        i = self._used.get(nbytes, 0)
        got = self._bulk.get(nbytes, ())  # none when the key existed at the count, and was evicted since
        if i < len(got):
            self._used[nbytes] = i + 1
            return got[i]
        if (nbytes, owner) in self._full:
            return self._full[(nbytes, owner)]
        judge = admits()
        if isinstance(judge, NotAdmitted):
            return judge
        try:
            return self._alloc_evicting(nbytes, owner, judge)
        except NotAdmitted:
            raise
        except PoolFull as e:
            self._full[(nbytes, owner)] = e
            return e

    def release_unused(self) -> None:
        """Give back the bulk room repeated keys (or an error) left unused."""
        for nbytes, got in self._bulk.items():
            for alloc in got[self._used[nbytes]:]:
                self._pool.free(alloc)
