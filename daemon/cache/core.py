"""The cache core: the one place that decides what counts as a hit and what gets leased.

Role
    ``Cache`` is the daemon's one way into its cache. It composes a private index (``daemon/cache/index.py``:
    entries, states, pins, eviction, chains) and offers a closed set of verbs: what a lookup gets
    (``plan_lookup``; a lookup of an engine, a peer's lookup, a pull's local answer, promotion from the lower
    tiers and a router's usable-prefix question all ask it: whole chunks, partial-chunk tails and turn ends,
    ``daemon/cache/lookup_plan.py``, by the hybrid hit rule, ``daemon/cache/hybrid.py``, over every
    tensor-parallel rank named and whatever tiers the presence test covers, less the withheld pairs given at
    construction); leases on a plan (``lease``, ``check_lease``, ``use_lease``, ``watch_lease``, ``release``,
    ``release_owner``, ``expire``); stores (``begin_store``, ``complete_store``, ``abandon_store``,
    ``confirm``); reads (``pin_for_read``, ``scratch``); a read-only view of the entries (``get``,
    ``is_ready``, ``keys``); removal (``drop``, ``mark_corrupt``); session pins (``sessions``), quotas
    (``tenants``), formats (``formats``, ``add_format``), ``statistics``; and ``subscribe`` for the ready,
    drop and checksum events (``daemon/cache/subscriptions.py``). Callers outside ``daemon/cache/`` use these
    and the names ``hkvd.daemon.cache`` exports, never the modules under it nor the index
    (``tests/unit/test_layers.py`` holds them to that).

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
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from hkvd.daemon.cache.admission import make_admission
from hkvd.daemon.cache.entry import Entry, EntryKey, EntryState
from hkvd.daemon.cache.eviction import EvictionPolicy
from hkvd.daemon.cache.formats import Formats
from hkvd.daemon.cache.hybrid import required_chunks
from hkvd.daemon.cache.index import Index, IndexStats
from hkvd.daemon.cache.leases import Lease
from hkvd.daemon.cache.lookup_plan import HasFn, LookupPlan, Shape, Tail, TailSource, distinct, plan, turn_ends_past
from hkvd.daemon.cache.pool import Allocation, HugePagePool
from hkvd.daemon.cache.quotas import Tenants
from hkvd.daemon.cache.recompute_cost import RecomputeCost
from hkvd.daemon.cache.session_pins import Sessions
from hkvd.daemon.cache.subscriptions import Callback, EventKind, Subscriptions
from hkvd.transport.errors import PoolFull
from hkvd.transport.turn_ends import TurnEnds

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


class Cache:
    """The daemon's cache (module docstring): the verbs over a private index, and ``formats``, the one record
    of the engine worlds registered here (``Formats``), which the registry feeds."""

    def __init__(self, pool: HugePagePool, policy: EvictionPolicy, clock: Callable[[], float] = time.monotonic,
                 formats: Formats | None = None, *, tenants: Tenants | None = None, pin_fraction: float = 0.5,
                 withheld: Withheld = (), turn_ends: TurnEnds | None = None, admission: str = "none") -> None:
        self.formats = formats if formats is not None else Formats()
        # --admission (daemon/cache/admission.py): the sketch ages by the entries held now.
        adm = make_admission(admission, pool.allocator.capacity, lambda: len(self._index))
        self._index = index = Index(pool, policy, clock, tenants=tenants, pin_fraction=pin_fraction, admission=adm,
                                    cost=RecomputeCost(self.formats))
        self.pool = pool
        self.tenants = index.tenants  # the quotas (daemon/cache/quotas.py)
        self.sessions = Sessions(index)  # session pins (daemon/cache/pins.py)
        self._subscriptions = Subscriptions(index)
        # (fingerprint, group) pairs whose entries no plan takes (quarantined: daemon/integrity/quarantine.py)
        self.withheld: Withheld = withheld
        # Where every engine's turn-end states end, by layout and the whole chunk before them (``add_turn_end``),
        # named in lookup plans (``ends_of``).
        self.turn_ends = turn_ends if turn_ends is not None else TurnEnds(TURN_END_CHUNKS, TURN_ENDS_PER_CHUNK)

    # ---- hits ----------------------------------------------------------------------------------
    def plan_lookup(self, shape: Shape, keys: Sequence[bytes], fingerprints: Sequence[bytes], *,
                    tails: Sequence[Tail] | TailSource = (), tiers: HasFn | None = None, pool: bool = True,
                    max_chunks: int | None = None, ends_of: bytes | None = None,
                    count_missing: bool = False, seen: bool = False) -> LookupPlan:
        """What a lookup of ``keys`` gets, served to every rank of ``fingerprints`` (``daemon/cache/lookup_plan.py``).

        Entries count where they are READY in the pool (``pool``) or where ``tiers`` says a lower tier holds
        them; never those withheld. ``tails``: partial chunks that may end the hit, longest first (or a function
        of the whole chunks' hit giving them); ``max_chunks`` caps the whole chunks. ``ends_of``: the layout
        whose turn ends inside the chunks past the hit to name (when no tail ends it). With ``tiers`` and the
        pool, ``promote`` names the entries to read into the pool first. ``count_missing``: count the entries
        found absent by kind. ``seen``: an engine asks for ``keys`` (once per request): the admission counts
        them, and the state where the whole chunks' hit ends (``daemon/cache/admission.py``)."""
        present = _presence(self.is_ready, pool, tiers)
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
        if seen:
            self._index.admission.seen(keys, covered[hit.hit_chunks - 1] if hit.hit_chunks else None)
        if ends_of is not None and not tail:
            out.ends.extend(turn_ends_past(self.turn_ends, ends_of, keys, hit.hit_chunks))
        if tiers is not None and pool:
            ready = self.is_ready
            out.promote.extend(((fp, gid, covered[c]), covered[c - 1] if c else b"")
                               for fp in distinct(out.fingerprints) for gid, chunks in hit.needed.items()
                               for c in chunks
                               if not ready((fp, gid, covered[c])))
        return out

    def add_turn_end(self, layout: bytes, parent: bytes, offset: int) -> None:
        """An engine of ``layout`` stored a turn-end state ``offset`` tokens into the chunk after ``parent``."""
        self.turn_ends.add(layout + parent, offset)

    @staticmethod
    def needs(shape: Shape, hit_chunks: int) -> set[tuple[int, int]]:
        """(group, chunk) of every entry a retrieve of a hit of ``hit_chunks`` whole chunks loads."""
        return {(r.group_id, c) for r in shape.rules for c in required_chunks(r, hit_chunks, shape.chunk_size)}

    def busy(self, shape: Shape, keys: Sequence[bytes], fingerprint: bytes, hit: int) -> bool:
        """Whether an entry a hit of ``hit`` chunks needs is in the cache but not READY (being written)."""
        get = self._index.get
        return any((e := get((fingerprint, r.group_id, keys[c]))) is not None and e.state in _UNFINISHED
                   for r in shape.rules for c in required_chunks(r, hit, shape.chunk_size))

    # ---- leases (daemon/cache/leases.py) -------------------------------------------------------
    def lease(self, plan: LookupPlan, owner: int, ttl_s: float) -> int:
        """A lease on every rank's entries of ``plan`` (those READY now), serving one retrieve per rank (per
        reader rank, ``plan.readers``, when another TP size's entries are re-sharded). A hit
        on chunks a session pin holds restarts that pin's TTL (``daemon/cache/pins.py``)."""
        index = self._index
        if plan.hit_chunks and len(index.pins):
            index.pins.refresh(plan.fingerprints[0], plan.keys[:plan.hit_chunks])
        return index.leases.take(plan.entries(), owner, ttl_s, uses=plan.readers or len(plan.fingerprints))

    def check_lease(self, lease_id: int) -> Lease[EntryKey]:
        """The live lease ``lease_id``; raises LeaseExpired when it is unknown or past its TTL."""
        return self._index.leases.check(lease_id)

    def use_lease(self, lease_id: int, written: bool) -> None:
        """One retrieve served from the lease (``written``: it wrote all its bytes)."""
        self._index.leases.use(lease_id, written=written)

    def watch_lease(self, lease_id: int, owner: int, notify: Callable[[bool], None]) -> None:
        """``notify(written)`` once the lease ends (``Leases.watch``)."""
        self._index.leases.watch(lease_id, owner, notify)

    def release(self, lease_id: int, owner: int | None = None) -> bool:
        """End a lease; with ``owner``, only if that owner took it (False otherwise, or if unknown)."""
        return self._index.leases.release(lease_id, owner)

    def release_owner(self, owner: int) -> int:
        """End every lease ``owner`` took; the number ended."""
        return self._index.leases.release_owner(owner)

    def expire(self) -> int:
        """End every lease and session pin past its TTL (the daemon's housekeeping); the leases ended."""
        self._index.expire_pins()
        return self._index.leases.expire()

    # ---- stores --------------------------------------------------------------------------------
    def begin_store(self, wants: list[tuple[EntryKey, int, str, bytes]], job_id: int,
                    tenant: str | Sequence[str] = "", *, chunks: Sequence[int] | None = None, offered: bool = False,
                    exempt: bool = False) -> list[Entry | PoolFull | None]:
        """WRITING entries (pinned, never served) of ``tenant`` (one for all, or one per want) for ``(key, nbytes,
        kind, parent)`` each: per want the entry, None when the key exists, or the PoolFull met (evicting as
        needed first; ``Index.begin_writes``). ``chunks``: each want's chunk index (the ``cost`` policy weighs
        it). ``offered``: an engine's store, put to the admission (``NotAdmitted``, a PoolFull, where refused)
        unless ``exempt`` (a turn end)."""
        return self._index.begin_writes(wants, job_id, tenant, chunks=chunks, offered=offered, exempt=exempt)

    def complete_store(self, entries: list[Entry], *, pending: bool) -> None:
        """The copies into ``entries`` completed: READY (or PENDING, awaiting their engine's confirmation)."""
        self._index.finish_writes(entries, pending=pending)

    def abandon_store(self, entries: Iterable[Entry]) -> None:
        """The copies into ``entries`` failed or were aborted: their bytes are not to be trusted, they go."""
        for entry in entries:
            self._index.abandon_write(entry)

    def confirm(self, entry: Entry) -> bool:
        """A PENDING state is confirmed by its engine: READY now. False if it was dropped meanwhile."""
        return self._index.confirm(entry)

    def note_store_dropped(self, n: int = 1) -> None:
        """Count ``n`` store items the pool had no room for (the caller decides which refusals count)."""
        self._index.note_store_dropped(n)

    # ---- reads ---------------------------------------------------------------------------------
    def scratch(self, nbytes: int) -> Allocation:
        """Pool room for bytes that are no entry (a sampled hit's recomputed blocks, compared and given
        back with ``pool.free``), evicting as a store of the unsalted tenant "" would; raises PoolFull."""
        return self._index._alloc_evicting(nbytes)

    def pin_for_read(self, entries: list[Entry]) -> Callable[[], None]:
        """Pin ``entries`` while a copy reads them (no eviction, no reuse); the returned call unpins them (call
        it once)."""
        self._index.pin_many(entries)
        return functools.partial(self._index.unpin_many, entries)

    # ---- hints (docs/hints.md) -----------------------------------------------------------------------
    def retain(self, keys: Iterable[EntryKey]) -> int:
        """Move the READY entries of ``keys`` to the back of the eviction order, as a hit does; how many."""
        retain = self._index.retain
        return sum(retain(k) for k in keys)

    def demote(self, keys: Iterable[EntryKey]) -> int:
        """Put the READY entries of ``keys`` first in the eviction order (a hit moves one back); how many. Held
        entries (a session pin, a lease, a copy) are in no order and stay where they are."""
        demote = self._index.demote
        return sum(demote(k) for k in keys)

    def count_seen(self, chunk_keys: Sequence[bytes], times: int = 1) -> bool:
        """Count ``chunk_keys`` ``times`` over as asked for, in the admission's sketch; False where admission is off
        (``--admission none``: every store is admitted)."""
        adm = self._index.admission
        if adm.name == "none":
            return False
        for _ in range(times):
            adm.seen(chunk_keys)
        return True

    # ---- the entries, read-only ----------------------------------------------------------------
    def get(self, key: EntryKey) -> Entry | None:
        """The entry under ``key`` in any state, or None. Read it; change it only through these verbs."""
        return self._index.get(key)

    def is_ready(self, key: EntryKey) -> bool:
        """Whether the entry under ``key`` is READY (servable)."""
        return self._index.is_ready(key)

    def keys(self) -> list[EntryKey]:
        """Every key in the cache now, in insertion order (a copy)."""
        return self._index.keys()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def writes(self) -> int:
        """Entries begun since start (the heap policy freezes by it)."""
        return self._index.writes

    # ---- removal -------------------------------------------------------------------------------
    def drop(self, entry: Entry) -> None:
        """Remove an entry now (failed copy, invalidated snapshot). Must not be pinned by a reader."""
        self._index.drop(entry)

    def mark_corrupt(self, entry: Entry, reason: str) -> bool:
        """``entry``'s bytes are damaged: served no more, dropped once unpinned and unleased; counted under
        ``reason``. False if ``entry`` is no longer this key's READY entry (``Index.mark_corrupt``)."""
        return self._index.mark_corrupt(entry, reason)

    def note_corrupt(self, reason: str) -> None:
        """Count an entry found damaged that was never published (a pull's)."""
        self._index.note_corrupt(reason)

    # ---- formats, events, statistics -------------------------------------------------------------
    def add_format(self, fingerprints: Sequence[bytes], kinds: dict[int, str]) -> None:
        """An engine world's format (from registration): every rank's entries have these group kinds,
        and an evicted entry takes the same chunk's entries of the other ranks with it."""
        for fp in fingerprints:
            self._index.set_groups(fp, kinds)
        self._index.set_ranks(tuple(fingerprints))

    def subscribe(self, *, ready: Callback | None = None, drop: Callback | None = None,
                  checksum: Callback | None = None) -> Callable[[], None]:
        """Call ``ready(entry)`` after an entry turned READY, ``drop(entry)`` after any entry left the cache,
        ``checksum(entry)`` after an entry turned READY whose checksum is to be taken (off the loop); the
        returned call ends these subscriptions (``daemon/cache/subscriptions.py``)."""
        subs = self._subscriptions
        wanted: list[tuple[EventKind, Callback | None]] = [("ready", ready), ("drop", drop), ("checksum", checksum)]
        ends = [subs.subscribe(kind, fn) for kind, fn in wanted if fn is not None]

        def end() -> None:
            for e in ends:
                e()

        return end

    def statistics(self) -> IndexStats:
        """The entries by state and kind, leases, pins and drops (``hkvd status``: ``index``)."""
        return self._index.statistics()


def _presence(ready: HasFn, pool: bool, tiers: HasFn | None) -> HasFn:
    """Present where READY in the pool (``pool``) or where ``tiers`` says so."""
    if tiers is None:
        return ready if pool else _absent
    if not pool:
        return tiers
    return lambda k: ready(k) or tiers(k)
