"""Lookup leases: the lease table and its rules (ids, time to live, uses, owners).

Role
    A lookup may take a lease on the entries of its hit, so that they are not evicted before the
    engine retrieves them. A lease ends at its last use (one retrieve per tensor-parallel rank), on
    release, when its connection goes, or once its time to live has passed (the next check or sweep
    ends it). Its owner may watch it (``watch``): told once it ends whether every use wrote all its
    bytes into the engine's blocks. A lease that ended written is remembered a while (the last
    ``ENDED_KEPT``) for a watch that arrives after the retrieves. The index owns one ``Leases`` and
    gives it two callbacks: ``hold(key)`` marks a READY entry held (False where there is none to
    hold) and ``unhold(key)`` undoes that; the per-entry hold count they keep is what the eviction
    walk reads.

Threading
    Event-loop only, like the index.

Ids
    Random non-zero 63-bit integers: a neighbour cannot guess another engine's lease.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hkvd.transport.errors import LeaseExpired, PermissionDenied

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
    unwritten: bool = False  # a use did not write all its bytes (failed, or a GPU copy still to wait for)
    watchers: list[Callable[[bool], None]] = field(default_factory=list)  # told at the end: written or not

    def uncovered(self, keys: Iterable[K]) -> K | None:
        """The first of ``keys`` this lease does not hold, or None."""
        held = set(self.keys)
        return next((k for k in keys if k not in held), None)


ENDED_KEPT = 1024  # leases that ended written, kept for watches that come late


class Leases(Generic[K]):
    """The lease table: which keys each lease holds, until when, for whom and for how many uses."""

    def __init__(self, hold: Callable[[K], bool], unhold: Callable[[K], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._hold = hold
        self._unhold = unhold
        self.clock = clock
        self._table: dict[int, Lease[K]] = {}
        self._ended_written: OrderedDict[int, int] = OrderedDict()  # lease id -> owner, newest last

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

    def use(self, lease_id: int, written: bool = False) -> None:
        """One retrieve served from the lease, ``written`` when it wrote all its bytes into the engine's
        blocks: the lease ends after its last use (an unknown id is a no-op)."""
        lease = self._table.get(lease_id)
        if lease is None:
            return
        lease.uses -= 1
        lease.unwritten |= not written
        if lease.uses <= 0:
            self._end(lease, written=not lease.unwritten)

    def watch(self, lease_id: int, owner: int, notify: Callable[[bool], None]) -> None:
        """Call ``notify(written)`` once lease ``lease_id`` ends (at once if it already ended written).

        Raises PermissionDenied for another connection's lease, LeaseExpired for one that ended
        otherwise, or long ago, or never existed."""
        lease = self._table.get(lease_id)
        if lease is not None:
            if lease.owner != owner:
                raise PermissionDenied(f"lease {lease_id} belongs to another connection; watch only the leases "
                                       "this connection's lookups took")
            lease.watchers.append(notify)
            return
        if self._ended_written.get(lease_id) == owner:
            del self._ended_written[lease_id]
            notify(True)
            return
        raise LeaseExpired(f"lease {lease_id} ended without every retrieve written, or is unknown; the worker "
                           "reports the load")

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
        self._end(lease, written=False)
        return True

    def _end(self, lease: Lease[K], written: bool) -> None:
        del self._table[lease.lease_id]
        for k in lease.keys:
            self._unhold(k)
        if written and not lease.watchers:
            self._ended_written[lease.lease_id] = lease.owner
            while len(self._ended_written) > ENDED_KEPT:
                self._ended_written.popitem(last=False)
        for notify in lease.watchers:
            notify(written)

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
