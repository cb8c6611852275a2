"""The cache core: the one place that decides what counts as a hit and what gets leased.

Role
    ``Cache`` is the index (``daemon/cache/index.py``: entries, states, pins, eviction, chains)
    with the decisions every caller shares. A lookup of an engine, a peer's lookup, a pull's local
    answer, promotion from the lower tiers and a router's usable-prefix question all ask ``plan``
    (the hybrid hit rule, ``daemon/cache/hybrid.py``, over every tensor-parallel rank named and
    whatever tiers the presence test covers) and take their leases through ``lease``; stores go
    through ``begin_store``/``complete_store`` and retrieves pin through ``pin_for_read``. Callers
    outside ``daemon/cache/`` use this class and the names ``hkvd.daemon.cache`` exports, never the
    modules under it (``tests/unit/test_layers.py`` holds them to that).

Tensor parallelism (one rule)
    A hit is the hybrid hit that every rank named holds: a (group, chunk) counts only when each
    rank's entry of it is present. A lease holds the needed entries of every rank named and serves
    one retrieve per rank (``uses = len(fingerprints)``): an engine's lookup names its world's ranks,
    a peer's lookup and a pull name the one rank whose shards they move.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hkvd.daemon.cache.eviction import EvictionPolicy
from hkvd.daemon.cache.formats import Formats
from hkvd.daemon.cache.hybrid import GroupRule, HitPlan, plan_hit, required_chunks
from hkvd.daemon.cache.index import Entry, EntryKey, EntryState, Index
from hkvd.daemon.cache.leases import Lease
from hkvd.daemon.cache.pool import Allocation, HugePagePool
from hkvd.daemon.cache.quotas import Tenants
from hkvd.transport.errors import PoolFull

_UNFINISHED = (EntryState.WRITING, EntryState.PENDING)  # may still turn READY (a CORRUPT entry never does)

#: ``has(entry_key)``: is that entry available where the plan may take it from?
HasFn = Callable[[EntryKey], bool]


class Withheld(Protocol):
    """What ``Cache.withheld`` needs of its holder: membership of (fingerprint, group) pairs, and a size
    (empty: nothing withheld). ``Quarantine`` (daemon/integrity/quarantine.py), or an empty tuple."""

    def __contains__(self, pair: object, /) -> bool: ...

    def __len__(self) -> int: ...


class Shape(Protocol):
    """What the hit rule needs of an engine format: its groups' rules and its chunk size."""

    @property
    def rules(self) -> Sequence[GroupRule]: ...

    @property
    def chunk_size(self) -> int: ...


def plan_ranks(shape: Shape, keys: Sequence[bytes], fingerprints: Sequence[bytes], has: HasFn,
               max_chunks: int | None = None, missing: dict[str, int] | None = None) -> HitPlan:
    """The hybrid hit over ``keys`` that every rank of ``fingerprints`` holds, by ``has``.

    ``missing``, when given, counts the entries found absent by group kind (every rank's that was
    probed). Read-only: ``has`` must not change what it reports during the call."""
    if missing is None and len(fingerprints) == 1:
        fp = fingerprints[0]

        def present(group_id: int, chunk: int) -> bool:
            return has((fp, group_id, keys[chunk]))
    else:
        kinds = {r.group_id: r.kind for r in shape.rules}

        def present(group_id: int, chunk: int) -> bool:
            key = keys[chunk]
            lacking = sum(not has((fp, group_id, key)) for fp in fingerprints)
            if not lacking:
                return True
            if missing is not None:
                missing[kinds[group_id]] = missing.get(kinds[group_id], 0) + lacking
            return False

    return plan_hit(shape.rules, len(keys), shape.chunk_size, present, max_chunks)


def plan_keys(plan: HitPlan, keys: Sequence[bytes], fingerprints: Sequence[bytes]) -> list[EntryKey]:
    """Every rank's entry keys that a retrieve of ``plan`` loads, rank by rank."""
    return [(fp, gid, keys[c]) for fp in fingerprints for gid, chunks in plan.needed.items() for c in chunks]


class Cache(Index):
    """The index with the decisions every caller shares (module docstring), and ``formats``: the one
    record of the engine worlds registered here (``Formats``), which the registry feeds."""

    def __init__(self, pool: HugePagePool, policy: EvictionPolicy, clock: Callable[[], float] = time.monotonic,
                 formats: Formats | None = None, *, tenants: Tenants | None = None, pin_fraction: float = 0.5) -> None:
        super().__init__(pool, policy, clock, tenants=tenants, pin_fraction=pin_fraction)
        self.formats = formats if formats is not None else Formats()
        # (fingerprint, group) pairs whose entries no plan takes (quarantined: daemon/integrity/quarantine.py)
        self.withheld: Withheld = ()

    # ---- hits ----------------------------------------------------------------------------------
    def plan(self, shape: Shape, keys: Sequence[bytes], fingerprints: Sequence[bytes], *, has: HasFn | None = None,
             max_chunks: int | None = None, missing: dict[str, int] | None = None) -> HitPlan:
        """The hit every rank of ``fingerprints`` can be served: from the pool (READY entries), or from
        whatever ``has`` says is there (a plan over the lower tiers, or a router's question)."""
        present = self.is_ready if has is None else has
        if self.withheld:
            withheld, base = self.withheld, present

            def present(key: EntryKey) -> bool:
                return (key[0], key[1]) not in withheld and base(key)

        return plan_ranks(shape, keys, fingerprints, present, max_chunks, missing)

    def busy(self, shape: Shape, keys: Sequence[bytes], fingerprint: bytes, hit: int) -> bool:
        """Whether an entry a hit of ``hit`` chunks needs is in the index but not READY (being written)."""
        return any((e := self.get((fingerprint, r.group_id, keys[c]))) is not None and e.state in _UNFINISHED
                   for r in shape.rules for c in required_chunks(r, hit, shape.chunk_size))

    # ---- leases --------------------------------------------------------------------------------
    def lease(self, plan: HitPlan, keys: Sequence[bytes], fingerprints: Sequence[bytes], owner: int,
              ttl_s: float) -> int:
        """A lease on every rank's entries of ``plan`` (those READY now), serving one retrieve per rank. A hit
        on chunks a session pin holds restarts that pin's TTL (``daemon/cache/pins.py``)."""
        if plan.hit_chunks and len(self.pins):
            self.pins.refresh(fingerprints[0], keys[:plan.hit_chunks])
        return self.leases.take(plan_keys(plan, keys, fingerprints), owner, ttl_s, uses=len(fingerprints))

    def hold(self, keys: Sequence[EntryKey], owner: int, ttl_s: float) -> int:
        """A lease that only holds ``keys`` (the READY ones) against eviction, for no retrieve: its owner
        releases it (``release``) or it expires."""
        return self.leases.take(keys, owner, ttl_s)

    def check_lease(self, lease_id: int) -> Lease[EntryKey]:
        """The live lease ``lease_id``; raises LeaseExpired when it is unknown or past its TTL."""
        return self.leases.check(lease_id)

    def use_lease(self, lease_id: int, written: bool) -> None:
        """One retrieve served from the lease (``written``: it wrote all its bytes)."""
        self.leases.use(lease_id, written=written)

    def watch_lease(self, lease_id: int, owner: int, notify: Callable[[bool], None]) -> None:
        """``notify(written)`` once the lease ends (``Leases.watch``)."""
        self.leases.watch(lease_id, owner, notify)

    def release(self, lease_id: int, owner: int | None = None) -> bool:
        """End a lease; with ``owner``, only if that owner took it (False otherwise, or if unknown)."""
        return self.leases.release(lease_id, owner)

    def release_owner(self, owner: int) -> int:
        """End every lease ``owner`` took; the number ended."""
        return self.leases.release_owner(owner)

    def expire_leases(self) -> int:
        """End every lease whose TTL has passed; the number ended."""
        return self.leases.expire()

    # ---- stores and reads ----------------------------------------------------------------------
    def begin_store(self, wants: list[tuple[EntryKey, int, str, bytes]], job_id: int,
                    tenant: str | Sequence[str] = "") -> list[Entry | PoolFull | None]:
        """WRITING entries of ``tenant`` (one for all, or one per want) for ``(key, nbytes, kind, parent)`` each
        (``Index.begin_writes``)."""
        return self.begin_writes(wants, job_id, tenant)

    def complete_store(self, entries: list[Entry], *, pending: bool) -> None:
        """The copies into ``entries`` completed: READY (or PENDING, awaiting their engine's confirmation)."""
        self.finish_writes(entries, pending=pending)

    def scratch(self, nbytes: int) -> Allocation:
        """Pool room for bytes that are no entry (a sampled hit's recomputed blocks, compared and given
        back with ``pool.free``), evicting as a store of the unsalted tenant "" would; raises PoolFull."""
        return self._alloc_evicting(nbytes)

    def pin_for_read(self, entries: list[Entry]) -> Callable[[], None]:
        """Pin ``entries`` while a copy reads them; the returned call unpins them (call it once)."""
        self.pin_many(entries)
        return functools.partial(self.unpin_many, entries)

    # ---- formats -------------------------------------------------------------------------------
    def add_format(self, fingerprints: Sequence[bytes], kinds: dict[int, str]) -> None:
        """An engine world's format (from registration): every rank's entries have these group kinds,
        and an evicted entry takes the same chunk's entries of the other ranks with it."""
        for fp in fingerprints:
            self.set_groups(fp, kinds)
        self.set_ranks(tuple(fingerprints))
