"""Tenant quotas: each tenant's share of the pool, and the eviction order that keeps tenants apart.

Role
    A tenant is the label a store carries (``Store.tenant``): ``""`` for the unsalted share, ``salt:<hex>`` for
    a ``cache_salt``, ``lora:<name>`` for a LoRA adapter where no salt is given. ``Tenants`` counts the bytes
    each tenant's entries take (WRITING ones too) and their evictions, and knows each tenant's quota: a
    fraction of the pool (``--tenant-quota``, per tenant ``tenant-quotas`` in the TOML config). A tenant is
    over its quota while its bytes exceed it.

    With any quota below 1, the index keeps one eviction order per tenant (``TenantOrder``) and an
    allocation for tenant T evicts, in each order's policy sequence: T's own entries while T is over its
    quota; then the entries of the other tenants over their quotas, the one furthest over first, each only
    while it stays over; then T's own entries. Entries of any other tenant at or under its quota are never
    candidates, and pinned entries are in no order at all (``daemon/cache/pins.py``). When none of that
    makes room, the store is dropped (``PoolFull``), as it would be in a full pool. With every quota at 1
    (the default) the index keeps its one order and tenants are only counted.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass

from hkvd.daemon.cache.eviction import EvictionPolicy
from hkvd.transport.stat_fields import metric, status_only

SHOWN = 64  # tenants shown by bytes (the largest, and every one with its own quota); the rest fold into OTHER
COUNTED = 256  # tenants whose evictions are counted under their own label; later ones count under OTHER
OTHER = "(other tenants)"  # holds a space: no store's label (wire.control.check_tenant) can be it


@dataclass(frozen=True, slots=True)
class TenantStats:
    """Bytes, quotas and evictions per tenant (``hkvd status``: ``tenants``)."""

    quotas: bool = status_only(default=False)  # any quota below 1: tenants are kept apart
    bytes: dict[str, int] = metric("hkvd_tenant_bytes", "Pool bytes held by each tenant's entries ('' is the "
                                   "unsalted share)", key="tenant", default_factory=dict)
    quota_bytes: dict[str, int] = metric("hkvd_tenant_quota_bytes", "Each tenant's quota of the pool, in bytes",
                                         key="tenant", default_factory=dict)
    evictions: dict[str, int] = metric("hkvd_tenant_evictions", "Entries evicted, by the tenant that stored them",
                                       "counter", key="tenant", default_factory=dict)


class Tenants:
    """Bytes per tenant and the quotas (``default`` for every tenant, ``overrides`` by label)."""

    def __init__(self, capacity: int, default: float = 1.0, overrides: Mapping[str, float] | None = None) -> None:
        self.capacity = capacity
        self.default = default
        self.overrides = dict(overrides or {})
        self.active = default < 1.0 or any(f < 1.0 for f in self.overrides.values())
        self.bytes: dict[str, int] = {}
        self.evictions: dict[str, int] = {}

    def quota(self, tenant: str) -> int:
        return int(self.overrides.get(tenant, self.default) * self.capacity)

    def over(self, tenant: str, extra: int = 0) -> bool:
        """Whether ``tenant`` holds more than its quota (with ``extra`` more bytes)."""
        return self.bytes.get(tenant, 0) + extra > self.quota(tenant)

    def add(self, tenant: str, nbytes: int) -> None:
        self.bytes[tenant] = self.bytes.get(tenant, 0) + nbytes

    def sub(self, tenant: str, nbytes: int) -> None:
        left = self.bytes.get(tenant, 0) - nbytes
        if left > 0:
            self.bytes[tenant] = left
        else:
            self.bytes.pop(tenant, None)

    def evicted(self, tenant: str) -> None:
        ev = self.evictions
        if tenant not in ev and len(ev) >= COUNTED:
            tenant = OTHER
        ev[tenant] = ev.get(tenant, 0) + 1

    def statistics(self) -> TenantStats:
        """Every tenant with its own quota, and the others holding the most bytes, up to ``SHOWN`` labels; the
        rest are summed under ``OTHER``, so /metrics stays bounded however many salts there are."""
        largest = sorted((t for t in self.bytes if t not in self.overrides), key=lambda t: -self.bytes[t])
        shown = sorted({*self.overrides, *largest[:max(SHOWN - len(self.overrides), 0)]})
        rest = sum(self.bytes[t] for t in largest[max(SHOWN - len(self.overrides), 0):])
        held = {t: self.bytes.get(t, 0) for t in shown}
        quota = {t: self.quota(t) for t in shown}
        if rest:
            held[OTHER] = rest
            quota[OTHER] = int(self.default * self.capacity)
        return TenantStats(quotas=self.active, bytes=held, quota_bytes=quota, evictions=dict(self.evictions))


class TenantOrder(EvictionPolicy):
    """One eviction order per tenant, each a policy of the configured kind, behind the policy interface.

    ``tenant_of(key)`` names the tenant of an entry the index holds; it is asked once, at ``insert``.
    ``candidates_for`` is the quota order (module docstring); ``candidates`` walks every tenant's order."""

    def __init__(self, make: Callable[[], EvictionPolicy], tenant_of: Callable[[Hashable], str],
                 tenants: Tenants) -> None:
        self._make = make
        self._tenant_of = tenant_of
        self.tenants = tenants
        inner = make()
        self.name = inner.name
        self.uses_orphans = inner.uses_orphans
        self._orders: dict[str, EvictionPolicy] = {"": inner}
        self._tenant: dict[Hashable, str] = {}  # key -> its tenant, for the keys in an order
        self._count: dict[str, int] = {}  # tenant -> keys in its order
        self._over_quota = False  # ``candidates_for`` is yielding entries of tenants over their quotas

    def _order(self, tenant: str) -> EvictionPolicy:
        order = self._orders.get(tenant)
        if order is None:
            order = self._orders[tenant] = self._make()
        return order

    def insert(self, key: Hashable) -> None:
        tenant = self._tenant.get(key)
        if tenant is None:
            tenant = self._tenant[key] = self._tenant_of(key)
            self._count[tenant] = self._count.get(tenant, 0) + 1
        self._order(tenant).insert(key)

    def touch(self, key: Hashable) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._orders[tenant].touch(key)

    def remove(self, key: Hashable) -> None:
        tenant = self._tenant.pop(key, None)
        if tenant is None:
            return
        self._orders[tenant].remove(key)
        left = self._count[tenant] - 1
        if left:
            self._count[tenant] = left
        else:  # a tenant's last entry left its order: the order goes too (salts come and go)
            del self._count[tenant]
            if tenant:
                del self._orders[tenant]

    def mark_orphan(self, key: Hashable) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._orders[tenant].mark_orphan(key)

    def unmark_orphan(self, key: Hashable) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._orders[tenant].unmark_orphan(key)

    def demote(self, key: Hashable) -> bool:
        tenant = self._tenant.get(key)
        return tenant is not None and self._orders[tenant].demote(key)

    def evicted(self, key: Hashable) -> None:
        tenant = self._tenant.get(key)
        if tenant is not None:
            self._orders[tenant].evicted(key)

    def reason(self, key: Hashable) -> str:
        """"quota" while the walk takes entries of tenants over their quotas, else the tenant's order's reason."""
        if self._over_quota:
            return "quota"
        tenant = self._tenant.get(key)
        return self._orders[tenant].reason(key) if tenant is not None else "policy"

    def candidates(self) -> Iterator[Hashable]:
        self._over_quota = False
        for order in list(self._orders.values()):
            yield from order.candidates()

    def candidates_for(self, tenant: str, nbytes: int) -> Iterator[Hashable]:
        """The keys an allocation of ``nbytes`` for ``tenant`` may evict, in the order it evicts them."""
        tenants = self.tenants
        own = self._orders.get(tenant)
        if own is None:  # no entries of this tenant yet: nothing of its own to evict
            own = self._make()
        self._over_quota = True
        if tenants.over(tenant, nbytes):
            for key in own.candidates():
                if not tenants.over(tenant, nbytes):
                    break
                yield key
        others = [t for t in self._orders if t != tenant and tenants.over(t)]
        others.sort(key=lambda t: tenants.quota(t) - tenants.bytes.get(t, 0))  # the furthest over first
        for other in others:
            for key in self._orders[other].candidates():
                if not tenants.over(other):
                    break
                yield key
        self._over_quota = False
        yield from own.candidates()
