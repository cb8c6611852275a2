"""The index: entry keys -> pool pages, with entry states, pins, leases and eviction.

Role
    Owns every entry's life: WRITING (a store copy is filling it) -> PENDING (a Mamba state copied
    but not yet confirmed by its engine) -> READY (visible to lookups) -> gone; a READY entry whose
    bytes failed their checksum (``mark_corrupt``, ``docs/checksums.md``) is CORRUPT: served by
    nothing, and gone once no copy pins it and no lease holds it. Allocation evicts
    through the configured policy, passing over entries whose freeing would make no room for it
    (another size class, in a superblock that stays in use; ``daemon/cache/evictor.py``); an entry is
    never evicted or reused while a copy pins it or a lease holds it. The lease table and its
    rules (ids, TTL, uses, owners) live in ``daemon/cache/leases.py``; the index owns one ``Leases`` and
    keeps each entry's hold count, which the eviction walk reads; lease and session-pin holds are
    kept by ``Holds`` (``daemon/cache/holds.py``).
    Session pins (``daemon/cache/pins.py``) hold entries by chunk key for a TTL: a held entry is in no
    eviction order. Each entry counts against its tenant (``daemon/cache/quotas.py``); with quotas the
    eviction order is one per tenant, and an allocation walks only the orders its tenant may take from.
    An engine's store (``begin_writes`` with ``offered``) is put to the admission (``daemon/cache/admission.py``)
    where it must evict: the victim it would take first may keep its place, and the entry is refused
    (``NotAdmitted``). Each entry knows its chunk index, from the store or its parent entry, which the
    ``cost`` policy weighs through the recompute-cost model given (``daemon/cache/recompute_cost.py``).

Threading
    Event-loop only. Copies run on threads but only touch pool bytes; every state change comes
    back to the loop.

Keys
    ``EntryKey = (fingerprint, group_id, chunk_key)``: the engine's layout fingerprint is in every
    key, so engines with different layouts never share entries.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from hkvd.daemon.cache.admission import Admission, NotAdmitted
from hkvd.daemon.cache.chains import ChainTracker, Groups
from hkvd.daemon.cache.entry import Entry, EntryKey, EntryState
from hkvd.daemon.cache.eviction import EvictionPolicy
from hkvd.daemon.cache.evictor import Evictor
from hkvd.daemon.cache.holds import Holds
from hkvd.daemon.cache.leases import Leases
from hkvd.daemon.cache.pins import Pins, PinStats
from hkvd.daemon.cache.pool import Allocation, HugePagePool
from hkvd.daemon.cache.quotas import TenantOrder, Tenants
from hkvd.daemon.cache.recompute_cost import DEFAULT_CHUNK, entry_cost
from hkvd.daemon.cache.store_room import AdmissionCounts, BulkRoom, StoreGate
from hkvd.transport.errors import PoolFull
from hkvd.transport.stat_fields import metric, status_only

_NO_GROUPS: Groups = (frozenset(), frozenset())


_ENTRIES = "Index entries by state"


@dataclass(frozen=True, slots=True)
class IndexStats:
    """The index's entries by state and kind, its leases, pins and drops (``hkvd status``: ``index``)."""

    entries: int = status_only()
    ready: int = metric("hkvd_entries", _ENTRIES, labels={"state": "ready"})
    pending: int = metric("hkvd_entries", _ENTRIES, labels={"state": "pending"})
    writing: int = metric("hkvd_entries", _ENTRIES, labels={"state": "writing"})
    bytes_stored: int = metric("hkvd_bytes_stored", "Bytes held by index entries")
    leases: int = metric("hkvd_leases", "Lookup leases held")
    pinned_entries: int = metric("hkvd_pinned_entries", "Entries pinned by a copy or a lease")
    evictions: int = metric("hkvd_evictions", "Entries evicted", "counter")
    orphans_dropped: int = metric("hkvd_orphans_dropped", "Orphaned entries dropped", "counter")
    orphans_marked: int = metric("hkvd_orphans_marked", "Entries found unable to serve any hit (evicted first by "
                                 "hybrid)", "counter")
    chain_nodes: int = status_only()
    stores_dropped: int = metric("hkvd_index_stores_dropped", "Stores the index dropped (pool full)", "counter")
    by_kind: dict[str, int] = metric("hkvd_entries_by_kind", "Index entries by group kind", key="kind",
                                     default_factory=dict)
    corrupt: dict[str, int] = metric("hkvd_pool_corrupt", "Pool entries dropped as damaged, by reason (checksum: "
                                     "their bytes no longer hash to their checksum)", "counter", key="reason",
                                     default_factory=dict)
    checksummed: int = metric("hkvd_entries_checksummed", "READY entries whose checksum is taken", default=0)
    evictions_by_reason: dict[str, int] = metric(
        "hkvd_evictions_by_reason", "Entries evicted, by why they were the candidate (policy: the eviction order; "
        "orphan: they could serve no hit; quota: their tenant was over its quota)", "counter", key="reason",
        default_factory=dict)
    admission: str = status_only(default="none")  # --admission
    admission_entries: dict[str, int] = metric(
        "hkvd_admission_entries", "Entries of engines' stores by admission outcome (admitted: placed; refused: the "
        "entry they would evict was asked for more often, --admission tinylfu)", "counter", key="outcome",
        default_factory=dict)
    admission_bytes: dict[str, int] = metric(
        "hkvd_admission_bytes", "Bytes of engines' stores by admission outcome (admitted, refused)", "counter",
        key="outcome", default_factory=dict)


class Index:
    """``tenants``: the quotas (``daemon/cache/quotas.py``; default: none, tenants only counted);
    ``pin_fraction``: the share of the pool session pins may hold (``daemon/cache/pins.py``)."""

    def __init__(self, pool: HugePagePool, policy: EvictionPolicy,
                 clock: Callable[[], float] = time.monotonic, *, tenants: Tenants | None = None,
                 pin_fraction: float = 0.5, admission: Admission | None = None,
                 cost: Callable[[Entry], float] | None = None) -> None:
        self.pool = pool
        self.clock = clock
        self._entries: dict[EntryKey, Entry] = {}
        capacity = pool.allocator.capacity
        self.tenants = tenants if tenants is not None else Tenants(capacity)
        # Admission of engines' stores (daemon/cache/admission.py) and the recompute cost the ``cost`` policy
        # weighs (daemon/cache/recompute_cost.py; by default with hkvd serve's default chunk size).
        self.admission = admission if admission is not None else Admission()
        self._cost = cost if cost is not None else _default_cost
        self._admission_counts = AdmissionCounts()
        policy.bind(lambda key: _cost_per_byte(self._cost, self._entries[cast(EntryKey, key)]))
        self.policy: EvictionPolicy = policy
        self._by_tenant: TenantOrder | None = None
        if self.tenants.active:
            entries = self._entries
            self._by_tenant = TenantOrder(policy.spawn, lambda k: entries[cast(EntryKey, k)].tenant, self.tenants)
            self.policy = self._by_tenant
        self.pin_budget_bytes = int(pin_fraction * capacity)
        self._group_ids: dict[bytes, tuple[int, ...]] = {}  # fingerprint -> every group id of its format
        self._holds = Holds(self._entries, self.policy, self.drop, group_ids=self._group_ids,
                            budget_bytes=self.pin_budget_bytes)
        self.pins = Pins(self._holds.pin_changed, clock)
        self.leases: Leases[EntryKey] = Leases(self._holds.hold, self._holds.unhold, clock)
        self._stores_dropped = 0
        self._corrupt: dict[str, int] = {}
        self.writes = 0  # entries begun since start (the heap policy freezes by it)
        self._groups: dict[bytes, Groups] = {}  # fingerprint -> (full-attention, Mamba) group ids
        self._siblings: dict[bytes, tuple[bytes, ...]] = {}  # fingerprint -> the other ranks' fingerprints
        self._chains = ChainTracker(lambda fp: self._groups.get(fp, _NO_GROUPS))
        self._evictor = Evictor(pool, self._entries, self.policy, self._by_tenant, self.tenants, self.drop,
                                groups=self._groups, siblings=self._siblings)
        # Observers (KV events, daemon/routing/announcer.py): ``on_ready`` after an entry turns READY,
        # ``on_drop`` after any entry left the index, whatever its state. They only read the index.
        self.on_ready: Callable[[Entry], None] | None = None
        self.on_drop: Callable[[Entry], None] | None = None
        # ``on_checksum`` after an entry turned READY: its checksum is to be taken (off the loop).
        self.on_checksum: Callable[[Entry], None] | None = None

    # ---- queries -------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> Entry | None:
        return self._entries.get(key)

    def is_ready(self, key: EntryKey) -> bool:
        e = self._entries.get(key)
        return e is not None and e.state is EntryState.READY

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[EntryKey]:
        """Every key in the index now, in insertion order (a copy)."""
        return list(self._entries)

    def _alloc_evicting(self, nbytes: int, tenant: str = "", admits: Callable[[Entry], bool] | None = None,
                        ) -> Allocation:
        """Room for ``nbytes`` for ``tenant``, evicting as needed (``Evictor.alloc``, each victim put to ``admits``
        where given); raises PoolFull (``NotAdmitted`` where ``admits`` kept a victim)."""
        return self._evictor.alloc(nbytes, tenant, admits)

    # ---- writes --------------------------------------------------------------------------------
    def begin_write(self, key: EntryKey, nbytes: int, kind: str, job_id: int, parent: bytes = b"",
                    tenant: str = "", chunk: int = -1) -> Entry | None:
        """Allocate a WRITING entry (pinned), evicting as needed. None if the key already exists.

        ``parent`` is the previous chunk's key when the client sent it: it places the entry in its
        prefix chain, which the hybrid-aware eviction policy uses to find orphans first.

        Raises PoolFull when nothing evictable frees enough room.
        """
        if key in self._entries:
            return None
        alloc = self._alloc_evicting(nbytes, tenant)
        self.writes += 1
        entry = Entry(key=key, alloc=alloc, nbytes=nbytes, kind=kind, pins=1, job_id=job_id, parent=parent,
                      chunk=chunk if chunk >= 0 else chunk_after(self._entries, self._group_ids, key[0], parent))
        self._add(entry, tenant)
        self._holds.keep_budget(self.pins)
        return entry

    def _add(self, entry: Entry, tenant: str) -> None:
        self._entries[entry.key] = entry
        entry.tenant = tenant
        self.tenants.add(tenant, entry.nbytes)
        if self.pins.is_pinned(entry.key[0], entry.key[2]):
            entry.held = True
            self._holds.pinned_bytes += entry.nbytes

    def begin_writes(self, wants: list[tuple[EntryKey, int, str, bytes]], job_id: int,
                     tenant: str | Sequence[str] = "", *, chunks: Sequence[int] | None = None,
                     offered: bool = False, exempt: bool = False) -> list[Entry | PoolFull | None]:
        """``begin_write`` for many ``(key, nbytes, kind, parent)`` of ``tenant`` (one for all, or one per want)
        at once, in order.

        Each answer is the new WRITING entry, ``None`` when the key already exists (or repeats
        in ``wants``), or the ``PoolFull`` that ``begin_write`` would have raised for it. Room is
        taken as ``BulkRoom`` says (``daemon/cache/store_room.py``).

        ``chunks``: each want's chunk index (else taken from its parent entry where the pool holds it).
        ``offered``: the wants are an engine's store, counted by outcome and, unless ``exempt`` (a turn end),
        put to the admission where they must evict (``StoreGate``): a refused want answers ``NotAdmitted``.
        Chunks a session pin holds are always admitted.
        """
        entries = self._entries
        tenants = [tenant] * len(wants) if isinstance(tenant, str) else tenant
        if len(tenants) != len(wants):
            raise ValueError(f"begin_writes: {len(tenants)} tenants for {len(wants)} entries")
        if chunks is not None and len(chunks) != len(wants):
            raise ValueError(f"begin_writes: {len(chunks)} chunk indexes for {len(wants)} entries")
        if offered:
            self.admission.offered((k[2], kind) for k, _, kind, _ in wants)
        gate = StoreGate(self.admission, self._admission_counts, counted=offered, pinned=self.pins.is_pinned,
                         judged=offered and not exempt and self.admission.name != "none")
        room = BulkRoom(self.pool, entries, [(k, nbytes) for k, nbytes, _, _ in wants], self._alloc_evicting)
        out: list[Entry | PoolFull | None] = []
        try:
            for n, ((key, nbytes, kind, parent), owner) in enumerate(zip(wants, tenants, strict=True)):
                if key in entries:
                    out.append(None)
                    continue
                chunk = chunks[n] if chunks is not None else chunk_after(entries, self._group_ids, key[0], parent)
                try:
                    alloc = room.take(nbytes, owner, functools.partial(gate.admits, key, kind, chunk, nbytes))
                except NotAdmitted as e:
                    out.append(gate.refused(e, nbytes, chunk))
                    continue
                if isinstance(alloc, PoolFull):
                    out.append(alloc)
                    continue
                entry = Entry(key, alloc, nbytes, kind, EntryState.WRITING, 1, 0, job_id, parent, chunk=chunk)
                self._add(entry, owner)
                out.append(entry)
                self.writes += 1
                gate.admitted(nbytes)
        finally:
            room.release_unused()
        self._holds.keep_budget(self.pins)
        return out

    def finish_writes(self, entries: list[Entry], *, pending: bool) -> None:
        """``finish_write`` for each of ``entries``."""
        state = EntryState.PENDING if pending else EntryState.READY
        for entry in entries:
            entry.pins -= 1
            entry.state = state
        if not pending:
            ready = self._ready
            for entry in entries:
                ready(entry)

    def finish_write(self, entry: Entry, *, pending: bool) -> None:
        entry.pins -= 1
        entry.state = EntryState.PENDING if pending else EntryState.READY
        if not pending:
            self._ready(entry)

    def abandon_write(self, entry: Entry) -> None:
        """Undo ``begin_write``: the copy failed or was aborted, so the bytes are not to be trusted."""
        entry.pins -= 1
        self.drop(entry)

    def confirm(self, entry: Entry) -> bool:
        """A pending state is confirmed: it becomes servable. False if it was dropped meanwhile."""
        if entry.state is not EntryState.PENDING or self._entries.get(entry.key) is not entry:
            return False
        entry.state = EntryState.READY
        self._ready(entry)
        return True

    def _ready(self, entry: Entry) -> None:
        if not entry.held:
            self.policy.insert(entry.key)
        if self.policy.uses_orphans:
            entry.tracked = True
            self._evictor.apply(self._chains.add(entry.key, entry.kind, entry.parent))
        if self.on_ready is not None:
            self.on_ready(entry)
        if self.on_checksum is not None:
            self.on_checksum(entry)

    def mark_corrupt(self, entry: Entry, reason: str) -> bool:
        """``entry``'s bytes are damaged: it is served no more (a lookup misses it, a retrieve refuses it)
        and is dropped now, or once the copy pinning it and the leases holding it are done. Counted
        under ``reason``. False (nothing done) if ``entry`` is no longer this key's READY entry."""
        if self._entries.get(entry.key) is not entry or entry.state is not EntryState.READY:
            return False
        self.note_corrupt(reason)
        entry.state = EntryState.CORRUPT
        self._holds.drop_if_corrupt(entry)
        return True

    def note_corrupt(self, reason: str) -> None:
        """Count an entry found damaged (``mark_corrupt``'s, or one never published: a pull's)."""
        self._corrupt[reason] = self._corrupt.get(reason, 0) + 1

    def drop(self, entry: Entry) -> None:
        """Remove an entry now (failed copy, invalidated snapshot). Must not be pinned by a reader."""
        if self._entries.get(entry.key) is not entry:
            return
        del self._entries[entry.key]
        self.policy.remove(entry.key)
        self.pool.free(entry.alloc)
        self.tenants.sub(entry.tenant, entry.nbytes)
        if entry.held:
            self._holds.pinned_bytes -= entry.nbytes
        if entry.tracked:
            entry.tracked = False
            self._evictor.apply(self._chains.remove(entry.key, entry.kind))
        if self.on_drop is not None:
            self.on_drop(entry)

    # ---- reads ---------------------------------------------------------------------------------
    def pin(self, entry: Entry) -> None:
        entry.pins += 1
        self.policy.touch(entry.key)

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.state is EntryState.CORRUPT:
            self._holds.drop_if_corrupt(entry)

    def pin_many(self, entries: list[Entry]) -> None:
        touch = self.policy.touch
        for entry in entries:
            entry.pins += 1
            touch(entry.key)

    def unpin_many(self, entries: list[Entry]) -> None:
        corrupt = EntryState.CORRUPT
        for entry in entries:
            entry.pins -= 1
            if entry.state is corrupt:
                self._holds.drop_if_corrupt(entry)

    # ---- hints (docs/hints.md) -----------------------------------------------------------------------
    def retain(self, key: EntryKey) -> bool:
        """Move ``key``'s READY entry to the back of the eviction order, as a hit does; False: none in the pool."""
        e = self._entries.get(key)
        if e is None or e.state is not EntryState.READY:
            return False
        self.policy.touch(key)
        return True

    def demote(self, key: EntryKey) -> bool:
        """Put ``key``'s entry first in the eviction order; False: none, or held (a session pin, a lease)."""
        e = self._entries.get(key)
        return e is not None and e.state is EntryState.READY and self.policy.demote(key)

    def set_groups(self, fingerprint: bytes, kinds: dict[int, str]) -> None:
        """The group kinds of a layout (from registration): orphan rules depend on them."""
        self._groups[fingerprint] = (frozenset(g for g, k in kinds.items() if k == "full"),
                                     frozenset(g for g, k in kinds.items() if k == "mamba"))
        self._group_ids[fingerprint] = tuple(kinds)

    # ---- session pins (daemon/cache/pins.py) -------------------------------------------------------
    def pin_session(self, world: tuple[bytes, ...], session: str, tenant: str, keys: list[bytes],
                    ttl_s: float, partial_keys: Sequence[bytes] = ()) -> bool:
        """Hold ``keys`` (and ``partial_keys``) of every rank of ``world`` for ``ttl_s`` as pin ``session``
        (``Pins.pin``), then keep the pin budget. False: refused (too many sessions)."""
        ok = self.pins.pin(world, session, tenant, keys, ttl_s, partial_keys)
        self._holds.keep_budget(self.pins)
        return ok

    def unpin_session(self, session: str) -> int:
        """End every pin of ``session``; how many."""
        return self.pins.unpin(session)

    def expire_pins(self) -> int:
        """End every pin past its TTL (the daemon's housekeeping); how many."""
        return self.pins.expire()

    def pinned_bytes(self) -> int:
        """Bytes of the entries session pins hold."""
        return self._holds.pinned_bytes

    def pin_statistics(self) -> PinStats:
        return self.pins.statistics(self._holds.pinned_bytes, self.pin_budget_bytes)

    def set_ranks(self, fingerprints: tuple[bytes, ...]) -> None:
        """The fingerprints of one engine world's ranks (from registration): an evicted entry takes the
        same chunk's entries of the other ranks with it."""
        if len(fingerprints) > 1:
            for fp in fingerprints:
                self._siblings[fp] = tuple(f for f in fingerprints if f != fp)

    # ---- stats ---------------------------------------------------------------------------------
    def note_store_dropped(self, n: int = 1) -> None:
        """Count ``n`` store items the pool had no room for (``begin_writes`` answered ``PoolFull``):
        the caller decides which refusals are dropped stores (a peer pull's are not)."""
        self._stores_dropped += n

    def statistics(self) -> IndexStats:
        states = dict.fromkeys(EntryState, 0)
        kinds: dict[str, int] = {}
        pinned = 0
        total = 0
        checksummed = 0
        counts = self._admission_counts
        for e in self._entries.values():
            checksummed += e.checksum != 0
            states[e.state] += 1
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
            pinned += e.pins > 0 or e.leases > 0
            total += e.nbytes
        return IndexStats(
            entries=len(self._entries), ready=states[EntryState.READY], pending=states[EntryState.PENDING],
            writing=states[EntryState.WRITING], bytes_stored=total, leases=len(self.leases),
            pinned_entries=pinned, evictions=self._evictor.evictions, orphans_dropped=self._evictor.orphans_dropped,
            orphans_marked=self._evictor.orphans_marked, chain_nodes=len(self._chains),
            stores_dropped=self._stores_dropped, by_kind=kinds, corrupt=dict(self._corrupt), checksummed=checksummed,
            evictions_by_reason=dict(self._evictor.by_reason), admission=self.admission.name,
            admission_entries={"admitted": counts.admitted, "refused": counts.refused},
            admission_bytes={"admitted": counts.admitted_bytes, "refused": counts.refused_bytes},
        )


def _default_cost(e: Entry) -> float:
    """The recompute cost of ``e`` where no engine format is known: chunks of hkvd serve's default size."""
    return entry_cost(e.kind, e.chunk, DEFAULT_CHUNK)


def _cost_per_byte(cost: Callable[[Entry], float], e: Entry) -> float:
    """The entry's recompute cost per byte (the ``cost`` policy's value)."""
    return cost(e) / max(e.nbytes, 1)


def chunk_after(entries: dict[EntryKey, Entry], group_ids: dict[bytes, tuple[int, ...]], fp: bytes,
                parent: bytes) -> int:
    """The chunk index after ``parent``'s, where an entry of ``parent`` (of layout ``fp``) knows it; else -1."""
    if not parent:
        return -1
    for gid in group_ids.get(fp, (0,)):
        e = entries.get((fp, gid, parent))
        if e is not None and e.chunk >= 0:
            return e.chunk + 1
    return -1
