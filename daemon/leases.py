"""Lookup leases: the lease table and its rules (ids, time to live, uses, owners).

Role
    A lookup may take a lease on the entries of its hit, so that they are not evicted before the
    engine retrieves them. A lease ends at its last use (one retrieve per tensor-parallel rank), on
    release, when its connection goes, or once its time to live has passed (the next check or sweep
    ends it). The index owns one ``Leases`` and gives it two callbacks: ``hold(key)`` marks a READY
    entry held (False where there is none to hold) and ``unhold(key)`` undoes that; the per-entry
    hold count they keep is what the eviction walk reads.

Threading
    Event-loop only, like the index.

Ids
    Random non-zero 63-bit integers: a neighbour cannot guess another engine's lease.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from hkvd.transport.errors import LeaseExpired

K = TypeVar("K")


@dataclass(slots=True)
class Lease(Generic[K]):
    lease_id: int
    keys: list[K]
    expires_at: float
    owner: int  # connection id
    # Retrieves it serves before it ends by itself: one per rank of a tensor-parallel engine, each
    # loading its own rank's entries (a release or the TTL ends it sooner).
    uses: int = 1

    def uncovered(self, keys: Iterable[K]) -> K | None:
        """The first of ``keys`` this lease does not hold, or None."""
        held = set(self.keys)
        return next((k for k in keys if k not in held), None)


class Leases(Generic[K]):
    """The lease table: which keys each lease holds, until when, for whom and for how many uses."""

    def __init__(self, hold: Callable[[K], bool], unhold: Callable[[K], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._hold = hold
        self._unhold = unhold
        self.clock = clock
        self._table: dict[int, Lease[K]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._table

    def take(self, keys: Iterable[K], owner: int, ttl_s: float, uses: int = 1) -> int:
        """A new lease on those of ``keys`` that ``hold`` accepts, for ``ttl_s`` seconds or ``uses`` retrieves."""
        held = [k for k in keys if self._hold(k)]
        lease_id = self._new_id()
        self._table[lease_id] = Lease(lease_id, held, self.clock() + ttl_s, owner, uses)
        return lease_id

    def _new_id(self) -> int:
        """A random non-zero 63-bit id: a neighbour cannot guess another engine's lease."""
        while True:
            lease_id = secrets.randbits(63)
            if lease_id and lease_id not in self._table:
                return lease_id

    def use(self, lease_id: int) -> None:
        """One retrieve served from the lease: it ends after its last use (an unknown id is a no-op)."""
        lease = self._table.get(lease_id)
        if lease is None:
            return
        lease.uses -= 1
        if lease.uses <= 0:
            self.release(lease_id)

    def check(self, lease_id: int) -> Lease[K]:
        """The live lease ``lease_id``; raises LeaseExpired when it is unknown or its TTL has passed (ending it)."""
        lease = self._table.get(lease_id)
        if lease is None or lease.expires_at < self.clock():
            if lease is not None:
                self.release(lease_id)
            raise LeaseExpired(f"lease {lease_id} expired or unknown; look up again (leases last "
                               "--lease-ttl-s seconds)")
        return lease

    def release(self, lease_id: int, owner: int | None = None) -> bool:
        """End a lease; with ``owner``, only if that connection took it (False otherwise)."""
        lease = self._table.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            return False
        del self._table[lease_id]
        for k in lease.keys:
            self._unhold(k)
        return True

    def release_owner(self, owner: int) -> int:
        """End every lease ``owner`` took (its connection went); the number ended."""
        ids = [lid for lid, lease in self._table.items() if lease.owner == owner]
        for lid in ids:
            self.release(lid)
        return len(ids)

    def expire(self) -> int:
        """End every lease whose TTL has passed; the number ended."""
        now = self.clock()
        ids = [lid for lid, lease in self._table.items() if lease.expires_at < now]
        for lid in ids:
            self.release(lid)
        return len(ids)
