"""The tier contract: what a tier below the pool (disk, cluster) offers the service.

``Tier`` is implemented by the disk tier (``hkvd.daemon.tiers.disk``) and the cluster tier
(``hkvd.daemon.tiers.cluster``); the read-through path that uses it is ``hkvd.daemon.tiers.promotion``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, NamedTuple, Protocol, TypeVar

from hkvd.daemon.cache import EntryKey, Extent
from hkvd.transport.tier_matchers import CLUSTER, DISK

# Each tier's bit in a request's skip_tiers (hkvd.transport.tier_matchers), by the tier's ``name``.
TIER_BITS_BY_NAME = {"l2": DISK, "cluster": CLUSTER}


def skipped_names(skip: int) -> frozenset[str]:
    """The names of the tiers below the pool that a request's ``skip_tiers`` leaves out."""
    return frozenset(name for name, bit in TIER_BITS_BY_NAME.items() if skip & bit)

StatsT_co = TypeVar("StatsT_co", covariant=True)  # what ``statistics()`` returns: DiskStats, ClusterStats


class Source(NamedTuple):
    """Where a tier will read one entry from: ``handle`` is the tier's own, opaque to the caller
    (``object``: tiers of several kinds share one read-through path) and passed back unchanged to
    ``read_batch``, which narrows it to its own type; ``parent`` is the chain parent the fresh pool
    entry gets."""

    handle: object
    parent: bytes


class EntryChecks(Protocol):
    """The pool's entry checksums as a tier's writer sees them (``hkvd.daemon.integrity.checksums.Checksums``).

    ``expected(key)``: the checksum of the pinned entry ``key`` (0: not taken yet, so not checked).
    ``report(key, where, found)``: its bytes hashed to ``found`` instead; the entry is dropped (on the
    loop, before the write's ``done`` runs). Both are called from the tier's own threads."""

    def expected(self, key: EntryKey) -> int: ...

    def report(self, key: EntryKey, where: str, found: int) -> None: ...


class Tier(ABC, Generic[StatsT_co]):
    """A tier below the pool. Implementor contracts:

    - ``usable()``, ``source()``, ``offer()`` and ``statistics()`` never block (event loop).
    - ``offer()`` queues a READY entry for write-behind; True: ``done`` runs on the loop once it is
      written or given up, and the caller keeps the entry pinned until then. False: not taken
      (already there, or skipped and counted: a full queue, the tier unreachable).
    - ``holds()`` answers for a batch at once; the caller bounds it with ``budget_s``.
    - ``read_batch()`` runs on ``executor``; it fills each job's extents (pool pages) and returns,
      per job, None (read and verified: the bytes may be served) or the exception that made it a
      miss (its ``reason`` attribute, if any, is the metric label). It never raises.
    """

    name: str  # metric prefix: "l2", "cluster"
    # Called on the event loop with (keys, present) after the tier took (True: written) or lost (False:
    # deleted, found gone) entries, once ``start`` gave it the loop. Set by the owner (KV events,
    # daemon/routing/announcer.py); None: nobody listens.
    listener: Callable[[list[EntryKey], bool], None] | None = None
    # The pool's checksums: a write-behind hashes the bytes it sends and skips an entry that no longer
    # matches its checksum (reported, and dropped from the pool). Set by the owner; None: not checked.
    checks: EntryChecks | None = None
    label: str  # in log lines: "disk tier", "cluster tier"
    budget_s: float  # one lookup's work in this tier
    executor: Executor
    read_threads: int  # read_batch calls run in parallel for one lookup

    @abstractmethod
    def usable(self) -> bool:
        """Worth asking now (holds anything; connected)."""

    @abstractmethod
    async def holds(self, keys: Sequence[EntryKey]) -> set[EntryKey]:
        """Which of ``keys`` this tier can be asked to read."""

    @abstractmethod
    def source(self, key: EntryKey, nbytes: int, kind: str, parent: bytes) -> Source | str:
        """How to read ``key`` as an entry of ``nbytes`` bytes of ``kind`` (the engine's layout), or
        why it cannot be (a metric reason). ``parent`` is the previous chunk's key."""

    @abstractmethod
    def offer(self, key: EntryKey, kind: str, nbytes: int, parent: bytes, extents: Sequence[Extent],
              done: Callable[[], None]) -> bool:
        """Queue a READY entry for write-behind; see the class docstring."""

    @abstractmethod
    def statistics(self) -> StatsT_co:
        """The tier's frozen stats (``hkvd.transport.stat_fields``): its part of ``hkvd status`` and /metrics."""

    @abstractmethod
    def read_batch(self, jobs: Sequence[tuple[EntryKey, object, Sequence[Extent]]]) -> list[BaseException | None]:
        """Read ``(key, handle, extents)`` jobs into pool extents; see the class docstring. A handle that
        is not this tier's (a caller's bug) is that job's miss (``TypeError``), like any other failure."""
