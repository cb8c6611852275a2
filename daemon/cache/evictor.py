"""The index's eviction: room in the pool for a new entry, and the entries an eviction leaves useless.

Role
    ``alloc`` evicts in policy order only entries whose freeing makes room for the allocation
    (another size class frees nothing until its superblock is empty); ``apply`` marks and unmarks
    the orphans the chain tracker reports. After an eviction, the other ranks' shards of the chunk
    and the Mamba states that needed it are dropped, or marked orphans while something holds them.
    With an admission test (``admits``: ``daemon/cache/admission.py``), each victim is put to it before it
    goes; the first it keeps ends the allocation with ``NotAdmitted``. Counts evictions (by reason:
    policy, orphan, quota) and orphans for ``IndexStats``.

Threading
    Event-loop only, as the index that owns it (``daemon/cache/index.py``). It reads the index's
    entry table, group and rank maps in place and removes entries through the index's ``drop``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hkvd.daemon.cache.admission import NotAdmitted
from hkvd.daemon.cache.chains import ChainChange, Groups
from hkvd.daemon.cache.entry import Entry, EntryKey, EntryState
from hkvd.daemon.cache.eviction import EvictionPolicy
from hkvd.daemon.cache.pool import Allocation, HugePagePool
from hkvd.daemon.cache.quotas import TenantOrder, Tenants
from hkvd.transport.errors import PoolFull

_NO_GROUPS: Groups = (frozenset(), frozenset())

#: ``admits(victim)``: whether the entry being placed may evict ``victim``.
AdmitFn = Callable[[Entry], bool]


@dataclass(slots=True)
class _Noted:
    """Evictable entries seen holding slots in one superblock during one eviction walk."""

    entries: dict[EntryKey, Entry]
    slots: int = 0  # slots they hold there; may run ahead of the live ones (recounted before use)
    reasons: dict[EntryKey, str] = field(default_factory=dict)  # why each was a candidate when noted


def evictable(e: Entry) -> bool:
    """READY and held by nothing: no copy pin, no lease, no session pin."""
    return e.state is EntryState.READY and e.pins == 0 and e.leases == 0 and not e.held


class Evictor:
    """Evicts from ``entries`` through ``drop``; ``groups`` and ``siblings`` are the index's per-fingerprint
    group ids (full, Mamba) and other ranks' fingerprints."""

    def __init__(self, pool: HugePagePool, entries: dict[EntryKey, Entry], policy: EvictionPolicy,
                 by_tenant: TenantOrder | None, tenants: Tenants, drop: Callable[[Entry], None], *,
                 groups: dict[bytes, Groups], siblings: dict[bytes, tuple[bytes, ...]]) -> None:
        self.pool = pool
        self.policy = policy
        self.tenants = tenants
        self._entries = entries
        self._by_tenant = by_tenant
        self._drop = drop
        self._groups = groups
        self._siblings = siblings
        self.evictions = 0
        self.by_reason: dict[str, int] = {}  # evictions by why their entry was a candidate
        self.orphans_dropped = 0
        self.orphans_marked = 0

    def alloc(self, nbytes: int, tenant: str = "", admits: AdmitFn | None = None) -> Allocation:
        """Room for ``nbytes`` for ``tenant``, evicting in policy order only entries whose freeing makes room.

        With tenant quotas, the candidates are those ``TenantOrder.candidates_for`` gives ``tenant``
        (``daemon/cache/quotas.py``); entries a session pin holds are in no order.

        Freeing an entry of another size class gives the pool nothing until its superblock is
        empty, so such entries are only noted per superblock; once every live slot of a superblock
        belongs to noted (evictable) entries, they all go and the superblock is free for any class.
        Entries of the needed class go at once (their slots are what the allocation takes). So
        this evicts a subset of what plain policy order would up to the same candidate, and fails
        only where evicting every evictable entry would too (but for a pending Mamba state that
        such a sweep would drop with its chunk: here it keeps its superblock in use).

        ``admits``: each victim is put to it just before it would go; the first it keeps raises
        ``NotAdmitted`` (what was evicted before stays evicted: its room is free).
        """
        pool = self.pool
        alloc = pool.alloc(nbytes)
        if alloc is not None:
            return alloc
        allocator = pool.allocator
        slot = allocator.plan(nbytes)[0]
        noted: dict[int, _Noted] = {}  # superblock -> evictable entries seen holding slots in it
        by_tenant = self._by_tenant
        policy = self.policy
        candidates = policy.candidates() if by_tenant is None else by_tenant.candidates_for(tenant, nbytes)
        for key in candidates:
            e = self._entries.get(key)  # type: ignore[call-overload]  # the policy holds the index's keys
            if e is None or not evictable(e):
                continue
            if e.alloc.slot_bytes == slot:
                if admits is not None and not admits(e):
                    raise NotAdmitted(f"a {nbytes}-byte entry not admitted: its victim was asked for more often")
                self.evict(e, policy.reason(key))
            elif not self._evict_if_emptied(e, noted, policy.reason(key), admits):
                continue
            alloc = pool.alloc(nbytes)
            if alloc is not None:
                return alloc
        if by_tenant is not None:
            raise PoolFull(f"no room for a {nbytes}-byte entry of tenant {tenant!r}: every entry it may evict is "
                           "pinned, leased, or another tenant's within its quota (--tenant-quota), or shares its "
                           "superblock with one; raise --l1-size-gb or that tenant's quota")
        raise PoolFull(f"no room for a {nbytes}-byte entry: every entry is pinned or leased, or shares its "
                       "superblock with one that is; raise --l1-size-gb or lower the number of in-flight requests")

    def _evict_if_emptied(self, e: Entry, noted: dict[int, _Noted], reason: str, admits: AdmitFn | None) -> bool:
        """Note ``e`` (a candidate for ``reason``) in its superblocks; evict the noted entries of one it would
        leave empty (True), each put to ``admits`` first."""
        allocator = self.pool.allocator
        for ext in e.alloc.extents:
            sb = allocator.superblock_of(ext.pool_offset)
            held = noted.get(sb)
            if held is None:
                held = noted[sb] = _Noted({})
            held.entries[e.key] = e
            held.reasons[e.key] = reason
            held.slots += 1
            if held.slots < allocator.live_slots(sb):
                continue
            # The count can run ahead: a noted entry evicted since (from another superblock) or
            # dropped as an orphan frees nothing here now. Recount the live ones before evicting.
            live = [x for x in held.entries.values() if self._entries.get(x.key) is x and evictable(x)]
            held.entries = {x.key: x for x in live}
            held.slots = sum(allocator.superblock_of(xe.pool_offset) == sb for x in live for xe in x.alloc.extents)
            if held.slots < allocator.live_slots(sb):
                continue
            if admits is not None and not all(admits(x) for x in live):
                raise NotAdmitted("an entry not admitted: a victim sharing its superblock was asked for more often")
            del noted[sb]
            for x in live:
                if self._entries.get(x.key) is x:  # an earlier eviction here may have dropped it as an orphan
                    self.evict(x, held.reasons.get(x.key, "policy"))
            return True
        return False

    def evict(self, e: Entry, reason: str = "policy") -> None:
        """Evict ``e``, a candidate for ``reason`` (policy, orphan, quota), and what it leaves useless."""
        self.policy.evicted(e.key)
        self._drop(e)
        self.evictions += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        self.tenants.evicted(e.tenant)
        # A Mamba state at chunk key k needs the attention chunk with the same key (the last chunk
        # of its prefix): once that chunk is gone the state can never be part of a hit, so it goes
        # now. Other orphans (descendants, attention chunks left without a state) were marked by
        # the chain tracker in ``drop`` and go first under the hybrid policy.
        # The other tensor-parallel ranks' shards of the same chunk serve no hit without this one.
        fp, gid, ck = e.key
        siblings = self._siblings.get(fp, ())
        for sib in siblings:
            if (other := self._entries.get((sib, gid, ck))) is not None:
                self._drop_useless(other)
        if e.kind in ("full", "swa"):
            for f in (fp, *siblings):
                for other in list(self._orphan_candidates(f, ck)):
                    self._drop_useless(other)

    def _drop_useless(self, e: Entry) -> None:
        """An entry no hit can use any more: dropped now (a pending state too: its confirmation would only
        make it servable for no hit), or marked an orphan while it is pinned or leased."""
        if evictable(e) or (e.state is EntryState.PENDING and e.pins == 0 and not e.held):
            self._drop(e)
            self.orphans_dropped += 1
        else:
            self.policy.mark_orphan(e.key)

    def _orphan_candidates(self, fp: bytes, chunk_key: bytes) -> Iterable[Entry]:
        for gid in self._groups.get(fp, _NO_GROUPS)[1]:
            other = self._entries.get((fp, gid, chunk_key))
            if other is not None:
                yield other

    def apply(self, change: ChainChange) -> None:
        """Unmark the entries ``change`` revived; mark its orphans still in the index."""
        for k in change.revived:
            self.policy.unmark_orphan(k)
        for k in change.orphans:
            if k in self._entries:
                self.policy.mark_orphan(k)
                self.orphans_marked += 1
