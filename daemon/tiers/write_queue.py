"""A tier's write-behind queue: READY entries offered to a tier (``Tier.offer``), waiting for its writer.

Both tiers below the pool (``hkvd.daemon.tiers.disk``, ``hkvd.daemon.tiers.cluster``) keep one, under
their own lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from hkvd.daemon.cache import EntryKey, Extent


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One READY entry offered for write-behind; its pages stay pinned until ``done`` runs."""

    key: EntryKey
    kind: str
    nbytes: int
    parent: bytes
    extents: tuple[Extent, ...]
    done: Callable[[], None]


class WriteQueue:
    """A tier's bounded write-behind queue: jobs waiting, and the keys and bytes of every job not finished.

    Not locked itself: the tier calls it under its own lock. A job is taken by the tier's writer and
    stays counted (``in`` and ``bytes``) until ``finished``; ``drain`` gives back the jobs not taken.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0  # of every job queued or taken and not finished
        self._jobs: collections.deque[WriteJob] = collections.deque()
        self._keys: set[EntryKey] = set()

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self._keys

    def has_room(self, nbytes: int) -> bool:
        return len(self._jobs) < self.max_entries and self.bytes + nbytes <= self.max_bytes

    def push(self, job: WriteJob) -> None:
        self._jobs.append(job)
        self._keys.add(job.key)
        self.bytes += job.nbytes

    def take(self, most: int) -> list[WriteJob]:
        return [self._jobs.popleft() for _ in range(min(most, len(self._jobs)))]

    def finished(self, job: WriteJob) -> None:
        self._keys.discard(job.key)
        self.bytes -= job.nbytes

    def drain(self) -> list[WriteJob]:
        jobs = self.take(len(self._jobs))
        for job in jobs:
            self.finished(job)
        return jobs
