"""The cache core: the one place that decides what counts as a hit and what gets leased.

Role
    ``Cache`` is the index (``daemon/cache/index.py``: entries, states, pins, eviction, chains)
    with the decisions every caller shares. A lookup of an engine, a peer's lookup, a pull's local
    answer, promotion from the lower tiers and a router's usable-prefix question all ask ``plan_lookup``
    (whole chunks, partial-chunk tails and turn ends, ``daemon/cache/lookup_plan.py``, by the hybrid hit rule,
    ``daemon/cache/hybrid.py``, over every tensor-parallel rank named and whatever tiers the presence
    test covers, less the withheld pairs given at construction) and take their leases through ``lease``; stores go
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
from hkvd.daemon.cache.hybrid import required_chunks
from hkvd.daemon.cache.index import Entry, EntryKey, EntryState, Index
from hkvd.daemon.cache.leases import Lease
from hkvd.daemon.cache.lookup_plan import HasFn, LookupPlan, Shape, Tail, TailSource, plan
from hkvd.daemon.cache.pool import Allocation, HugePagePool
from hkvd.daemon.cache.quotas import Tenants
from hkvd.transport.errors import PoolFull
from hkvd.transport.keys import ROOT_KEY
from hkvd.transport.turn_ends import TurnEnds
from hkvd.transport.wire.kv import MAX_ENDS

_UNFINISHED = (EntryState.WRITING, EntryState.PENDING)  # may still turn READY (a CORRUPT entry never does)

TURN_END_CHUNKS = 65536  # chunk keys whose turn ends the cache remembers, least recently used out first
TURN_ENDS_PER_CHUNK = 32  # turn ends remembered after one chunk key, oldest out first


def _absent(_: EntryKey) -> bool:
    return False


class Withheld(Protocol):
    """What ``Cache.withheld`` needs of its holder: membership of (fingerprint, group) pairs, and a size
    (empty: nothing withheld). ``Quarantine`` (daemon/integrity/quarantine.py), or an empty tuple."""

    def __contains__(self, pair: object, /) -> bool: ...

    def __len__(self) -> int: ...


class Cache(Index):
    """The index with the decisions every caller shares (module docstring), and ``formats``: the one
    record of the engine worlds registered here (``Formats``), which the registry feeds."""

    def __init__(self, pool: HugePagePool, policy: EvictionPolicy, clock: Callable[[], float] = time.monotonic,
                 formats: Formats | None = None, *, tenants: Tenants | None = None, pin_fraction: float = 0.5,
                 withheld: Withheld = (), turn_ends: TurnEnds | None = None) -> None:
        super().__init__(pool, policy, clock, tenants=tenants, pin_fraction=pin_fraction)
        self.formats = formats if formats is not None else Formats()
        # (fingerprint, group) pairs whose entries no plan takes (quarantined: daemon/integrity/quarantine.py)
        self.withheld: Withheld = withheld
        # Where every engine's turn-end states end, by layout and the whole chunk before them (``add_turn_end``),
        # named in lookup plans (``ends_of``).
        self.turn_ends = turn_ends if turn_ends is not None else TurnEnds(TURN_END_CHUNKS, TURN_ENDS_PER_CHUNK)

    # ---- hits ----------------------------------------------------------------------------------
    def plan_lookup(self, shape: Shape, keys: Sequence[bytes], fingerprints: Sequence[bytes], *,
                    tails: Sequence[Tail] | TailSource = (), tiers: HasFn | None = None, pool: bool = True,
                    max_chunks: int | None = None, ends_of: bytes | None = None,
                    count_missing: bool = False) -> LookupPlan:
        """What a lookup of ``keys`` gets, served to every rank of ``fingerprints`` (``daemon/cache/lookup_plan.py``).

        Entries count where they are READY in the pool (``pool``) or where ``tiers`` says a lower tier holds
        them; never those withheld. ``tails``: partial chunks that may end the hit, longest first (or a function
        of the whole chunks' hit giving them); ``max_chunks`` caps the whole chunks. ``ends_of``: the layout
        whose turn ends inside the chunks past the hit to name (when no tail ends it). With ``tiers`` and the
        pool, ``promote`` names the entries to read into the pool first. ``count_missing``: count the entries
        found absent by kind."""
        present = self._presence(pool, tiers)
        withheld = 0
        if self.withheld:
            pairs, base = self.withheld, present

            def present(key: EntryKey) -> bool:
                nonlocal withheld
                if (key[0], key[1]) not in pairs:
                    return base(key)
                withheld += base(key)
                return False

        missing: dict[str, int] = {}
        hit, covered, tail, complete = plan(shape, keys, fingerprints, present, tails=tails, max_chunks=max_chunks,
                                            missing=missing if count_missing else None)
        out = LookupPlan(hit.hit_chunks, hit.needed, covered, tuple(fingerprints), tail, withheld=withheld,
                         missing=missing, complete=complete)
        if ends_of is not None and not tail:
            out.ends.extend(self._ends(ends_of, keys, hit.hit_chunks))
        if tiers is not None and pool:
            ready = self.is_ready
            out.promote.extend(((fp, gid, covered[c]), covered[c - 1] if c else b"") for fp in out.fingerprints
                               for gid, chunks in hit.needed.items() for c in chunks
                               if not ready((fp, gid, covered[c])))
        return out

    def _presence(self, pool: bool, tiers: HasFn | None) -> HasFn:
        if tiers is None:
            return self.is_ready if pool else _absent
        if not pool:
            return tiers
        ready = self.is_ready
        return lambda k: ready(k) or tiers(k)

    def _ends(self, layout: bytes, keys: Sequence[bytes], n: int) -> list[list[int]]:
        """``[chunk_index, offset]`` of the turn ends engines of ``layout`` stored inside chunks n .. len(keys)
        (after the whole chunk before each), the last chunk's first: where a hit of n whole chunks may still
        end (a turn end at a chunk past n carries its own Mamba state, which the whole chunks may lack)."""
        out: list[list[int]] = []
        for j in range(len(keys), n - 1, -1):
            out.extend([j, off] for off in self.turn_ends.offsets(layout + (keys[j - 1] if j else ROOT_KEY)))
            if len(out) >= MAX_ENDS:
                break
        return out[:MAX_ENDS]

    def add_turn_end(self, layout: bytes, parent: bytes, offset: int) -> None:
        """An engine of ``layout`` stored a turn-end state ``offset`` tokens into the chunk after ``parent``."""
        self.turn_ends.add(layout + parent, offset)

    @staticmethod
    def needs(shape: Shape, hit_chunks: int) -> set[tuple[int, int]]:
        """(group, chunk) of every entry a retrieve of a hit of ``hit_chunks`` whole chunks loads."""
        return {(r.group_id, c) for r in shape.rules for c in required_chunks(r, hit_chunks, shape.chunk_size)}

    def busy(self, shape: Shape, keys: Sequence[bytes], fingerprint: bytes, hit: int) -> bool:
        """Whether an entry a hit of ``hit`` chunks needs is in the index but not READY (being written)."""
        return any((e := self.get((fingerprint, r.group_id, keys[c]))) is not None and e.state in _UNFINISHED
                   for r in shape.rules for c in required_chunks(r, hit, shape.chunk_size))

    # ---- leases --------------------------------------------------------------------------------
    def lease(self, plan: LookupPlan, owner: int, ttl_s: float) -> int:
        """A lease on every rank's entries of ``plan`` (those READY now), serving one retrieve per rank. A hit
        on chunks a session pin holds restarts that pin's TTL (``daemon/cache/pins.py``)."""
        if plan.hit_chunks and len(self.pins):
            self.pins.refresh(plan.fingerprints[0], plan.keys[:plan.hit_chunks])
        return self.leases.take(plan.entries(), owner, ttl_s, uses=len(plan.fingerprints))

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
