"""What ``KVService.statistics()`` returns: the daemon's state, one part per component.

``hkvd status`` (the control socket's ``StatusReply``, ``hkvd status --json``) is
``status_dict(ServiceStats)``; /metrics walks the same fields (``hkvd.daemon.http``). The convention
and its field declarations are ``hkvd.transport.stat_fields``; each part is its component's own
``statistics()``. The keys and shapes of the status JSON are a contract with its readers (the
shim's peer pulls, tools, tests): add fields at the end of a part, never rename one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hkvd.daemon.cache import IndexStats, PinStats, PoolStats, TenantStats
from hkvd.daemon.engines.engine_traffic import EngineTrafficStats
from hkvd.daemon.engines.latency import LatencyStats
from hkvd.daemon.engines.registry import RegistryStats
from hkvd.daemon.fd_budget import DescriptorStats
from hkvd.daemon.heap import HeapStats
from hkvd.daemon.integrity.quarantine import VerifyStats
from hkvd.daemon.integrity.scrub import IntegrityStats
from hkvd.daemon.routing.announcer import AnnouncerStats
from hkvd.daemon.tiers.cluster import ClusterStats
from hkvd.daemon.tiers.disk import DiskStats
from hkvd.transport.stat_fields import metric, part, status_only

if TYPE_CHECKING:  # types only, as in daemon/engines/service.py: they import NIXL's host, zmq
    from hkvd.daemon.peers.links import PeerStats
    from hkvd.daemon.routing.zmq_publisher import PublisherStats


@dataclass(frozen=True, slots=True)
class RateStats:
    """Throughput of the last copies (``hkvd status``: ``rates``)."""

    copy_gbps: dict[str, float] = metric("hkvd_copy_gbps", "Copy throughput of the last 64 copies (submit to "
                                         "done), by direction", key="direction")


@dataclass(frozen=True, slots=True)
class KeepingStats:
    """What the pool keeps and what it is worth (``hkvd status``: ``keeping``; docs/operating.md, "What is kept").

    ``stores`` / ``store_bytes``: engines' store entries and their bytes by outcome (stored, or why not:
    ``hkvd.daemon.engines.stores.STORE_OUTCOMES``); ``tiers_left_out``: entries not written to a tier below the pool
    because the request's store tiers left it out, by tier; ``hit_bytes``: bytes retrieves copied out of the pool
    since start; ``pool_bytes``: bytes the pool's entries hold now; ``hits_per_pool_byte``: their ratio."""

    stores: dict[str, float] = status_only(default_factory=dict)
    store_bytes: dict[str, float] = status_only(default_factory=dict)
    tiers_left_out: dict[str, float] = status_only(default_factory=dict)
    hit_bytes: float = status_only(default=0.0)
    pool_bytes: int = status_only(default=0)
    hits_per_pool_byte: float = metric(
        "hkvd_pool_hits_per_byte", "Bytes retrieves copied out of the pool since start over the bytes its entries "
        "hold now: how many times over the pool's contents have been served (0 while it holds nothing)", default=0.0)


@dataclass(frozen=True, slots=True)
class KVEventsStats:
    """KV events (``hkvd status``: ``kv_events``): the announcer's fields, and ``publisher`` with
    --kv-events-endpoint (absent without)."""

    announcer: AnnouncerStats = part(flatten=True)
    publisher: PublisherStats | None = part(omit_none=True)


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """The whole status, in its JSON's key order. A part that is off (no disk tier, no peers) is None."""

    registry: RegistryStats = part(flatten=True)  # engines
    pool: PoolStats = part()
    index: IndexStats = part()
    counters: dict[str, float] = status_only()  # every counter counted so far: its total (CounterStats: series)
    by_kind: dict[str, dict[str, float]] = status_only()  # per-kind counters: kind -> total
    uncacheable_requests: dict[str, float] = status_only()  # reason -> total
    rates: RateStats = part()
    l2: DiskStats | None = part()
    cluster: ClusterStats | None = part()
    peer: PeerStats | None = part()
    heap: HeapStats | None = part()
    kv_events: KVEventsStats | None = part()
    descriptors: DescriptorStats = part()
    shutting_down: bool = status_only()
    engine_traffic: EngineTrafficStats = part()  # per (model, rank): lookup tokens, bytes stored and retrieved
    latency: LatencyStats = part()  # lookup, store, retrieve: request to reply
    verify: VerifyStats = part()  # sampled hits compared with their recomputation; quarantines (docs/verification.md)
    integrity: IntegrityStats | None = part()  # entry checksums and the scrubber (docs/checksums.md)
    pins: PinStats = part()  # session pins (docs/pins.md)
    tenants: TenantStats = part()  # bytes, quotas and evictions per tenant (docs/pins.md)
    hints: dict[str, dict[str, float]] = status_only(default_factory=dict)  # KV hints: action -> outcome -> total
    keeping: KeepingStats = part(default_factory=KeepingStats)  # stores by outcome, hits per pool byte
