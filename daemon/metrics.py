"""Counters and gauges the daemon keeps; exported by ``hkvd status`` and the metrics endpoint.

Plain dictionaries on the event loop (no locks needed): ``inc(name, **labels)``. Throughput is a
``RateWindow`` per name and labels: the bytes and seconds of the last ``RATE_WINDOW`` transfers,
read as GB/s (``observe_rate``, ``rate``). ``statistics()`` is a ``CounterStats``
(``hkvd.transport.stat_fields``): a counter declared there is exported as ``hkvd_<name>_total``
with its help, 0 before its first ``inc`` unless it says otherwise; any other counter as
``hkvd_<name>_total`` with its name as help. Nothing here imports prometheus_client.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict, deque
from collections.abc import Mapping

from hkvd.transport.stat_fields import Metric, Sample, counter_series, metric, metrics, series

LabelKey = tuple[tuple[str, str], ...]
Series = Mapping[LabelKey, float]  # label set -> value, of one counter
RATE_WINDOW = 64


def _total(value: Series, _owner: object) -> list[Sample]:
    return [({}, sum(value.values()))]


@dataclasses.dataclass(frozen=True, slots=True)
class CounterStats:
    """Every counter's series (``Metrics.statistics()``); ``hkvd status`` shows their totals (``counters``).
    A field's name is the counter's (``inc(name)``); its family is ``hkvd_<name>``."""

    lookups: Series = counter_series("hkvd_lookups", "Lookup requests served")
    lookup_hit_chunks: Series = counter_series(
        "hkvd_lookup_hit_chunks", "Chunks that lookups found (the hybrid hit, in chunks)")
    lookup_miss_chunks: Series = counter_series("hkvd_lookup_miss_chunks", "Chunks that lookups did not find")
    stored_bytes: Series = counter_series("hkvd_stored_bytes", "Bytes stored into the pool, by group kind")
    retrieved_bytes: Series = counter_series("hkvd_retrieved_bytes", "Bytes retrieved from the pool, by group kind")
    retrieve_misses: Series = counter_series("hkvd_retrieve_misses", "Retrieves of entries no longer in the pool")
    stores_dropped: Series = counter_series(
        "hkvd_stores_dropped", "Entries not stored because the pool was full of pinned entries, by kind")
    step_events: Series = counter_series("hkvd_step_events", "Step events, by outcome")
    step_event_gaps: Series = counter_series(
        "hkvd_step_event_gaps", "Step-event sequence gaps (unconfirmed Mamba states invalidated)")
    snapshots_invalidated: Series = counter_series("hkvd_snapshots_invalidated", "Mamba snapshot jobs invalidated")
    leases_expired: Series = counter_series("hkvd_leases_expired", "Lookup leases that expired unreleased")
    errors: Series = counter_series("hkvd_errors", "Errors sent to clients, by code")
    internal_errors: Series = counter_series("hkvd_internal_errors", "Internal errors (bugs)")
    copy_timeouts: Series = counter_series("hkvd_copy_timeouts", "Copies that exceeded their timeout")
    copy_errors: Series = counter_series("hkvd_copy_errors", "Copies that failed")
    engines_registered: Series = counter_series("hkvd_engines_registered", "Engine registrations")
    lookup_hit_entries: Series = counter_series(
        "hkvd_lookup_hit_entries", "Entries the served hits load, by group kind")
    lookup_miss_entries: Series = counter_series(
        "hkvd_lookup_miss_entries", "Entries whose absence cut a lookup's hit short, by group kind")
    lookup_turn_ends_named: Series = counter_series(
        "hkvd_lookup_turn_ends_named", "Turn-end positions named in lookup replies (stored by any engine)")
    lookup_places: Series = counter_series(
        "hkvd_lookup_places", "Leased lookups answered with their entries' pool extents (in-step loads)")
    uncacheable_requests: Series = counter_series(
        "hkvd_uncacheable_requests", "Requests the shim could not key safely, never cached, by reason")
    connections_refused: Series = counter_series(
        "hkvd_connections_refused", "Engine connections refused at their Hello, by reason (descriptors: the "
        "open-file limit's reserve was reached; raise LimitNOFILE)")
    usable_prefix_requests: Series = counter_series(
        "hkvd_usable_prefix_requests", "Routers' usable-prefix lookups on the metrics port, by outcome (ok, "
        "bad_request, unknown_model)")
    hints: Series = counter_series(
        "hkvd_hints", "KV hints from routers and engines (docs/hints.md), by action (share, prefetch, demote, pin, "
        "retain, unknown) and outcome (accepted, clipped, deferred, rejected)")
    store_entries: Series = counter_series(
        "hkvd_store_entries", "Entries of engines' stores (and Mamba states offered), by outcome: stored, or why not "
        "(present: the pool had it; admission: --admission refused it; no_room: the pool was full of entries it may "
        "not evict; thinned: --mamba-checkpoint-interval; store_tiers: the request's kv_store_tiers leave the pool "
        "out)", always=False)
    store_bytes: Series = counter_series(
        "hkvd_store_bytes", "Bytes of the entries of hkvd_store_entries_total, by the same outcome", always=False)
    lookup_tiers_left_out: Series = counter_series(
        "hkvd_lookup_tiers_left_out", "Lookups whose kv_load_tiers left a tier out (pool, disk, cluster), by tier",
        always=False)
    tier_writes_left_out: Series = counter_series(
        "hkvd_tier_writes_left_out", "Stored entries not written to a tier below the pool because the request's "
        "kv_store_tiers left it out, by tier (l2, cluster)", always=False)
    tier_bytes_left_out: Series = counter_series(
        "hkvd_tier_bytes_left_out", "Bytes of hkvd_tier_writes_left_out_total, by tier", always=False)
    # Only once counted (no 0 before): the tiers' and the collector's, and cross-TP reads.
    tp_reshards: Series = counter_series(
        "hkvd_tp_reshards", "Lookups (op=lookup) and retrieves (op=retrieve) served from entries another TP size "
        "stored, re-sharded on read; pulls from a peer's world of another TP size (op=pull), and pulls refused "
        "because no such world could be read (op=pull_refused)", always=False)
    l2_hits: Series = counter_series(
        "hkvd_l2_hits", "Entries read from the disk tier into the pool for a lookup, by group kind", always=False)
    l2_read_failures: Series = counter_series(
        "hkvd_l2_read_failures", "Disk-tier reads not served (checksum, truncated, io, timeout, pool_full), by "
        "reason", always=False)
    cluster_hits: Series = counter_series(
        "hkvd_cluster_hits", "Entries read from the cluster tier into the pool for a lookup, by group kind",
        always=False)
    cluster_read_failures: Series = counter_series(
        "hkvd_cluster_read_failures", "Cluster-tier reads not served (mac, size, header, gone, io, timeout, "
        "pool_full), by reason", always=False)
    gc_collections: Series = counter_series(
        "hkvd_gc_collections", "Cyclic garbage collections, by generation", always=False)
    gc_pause_seconds: Series = counter_series(
        "hkvd_gc_pause_seconds", "Seconds the event loop stood still in garbage collections, by generation",
        always=False)
    # Kept with ``inc`` once, at start-up; exported as a gauge.
    prefault_gbps: Series = metric("hkvd_prefault_gbps", "Pool pre-fault bandwidth at start-up", samples=_total,
                                   default_factory=dict)
    # Counters not declared above: each exported as hkvd_<name>_total, its name in words as help.
    others: Mapping[str, Series] = metrics(Metric("hkvd_{key}", "{words}", "counter", each=series(always=True)),
                                           default_factory=dict)


class RateWindow:
    """Bytes and seconds of the last ``size`` transfers; ``gbps()`` is their total bytes over their
    total seconds (1e9 bytes per second), 0.0 before the first. Thread-safe (disk threads add)."""

    def __init__(self, size: int = RATE_WINDOW) -> None:
        self._items: deque[tuple[int, float]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._items.append((nbytes, seconds))

    def gbps(self) -> float:
        with self._lock:
            nbytes = sum(b for b, _ in self._items)
            seconds = sum(s for _, s in self._items)
        return nbytes / seconds / 1e9 if seconds > 0 else 0.0


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[LabelKey, float]] = defaultdict(lambda: defaultdict(float))
        self._rates: dict[str, dict[LabelKey, RateWindow]] = defaultdict(dict)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += value

    def get(self, name: str, **labels: str) -> float:
        return self.counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def total(self, name: str) -> float:
        return sum(self.counters.get(name, {}).values())

    def snapshot(self) -> dict[str, dict[LabelKey, float]]:
        return {k: dict(v) for k, v in self.counters.items()}

    def statistics(self) -> CounterStats:
        snap = self.snapshot()
        declared: dict[str, dict[LabelKey, float]] = {f.name: snap.pop(f.name) for f in _DECLARED if f.name in snap}
        return CounterStats(**declared, others=snap)

    def observe_rate(self, name: str, nbytes: int, seconds: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        window = self._rates[name].get(key)
        if window is None:
            window = self._rates[name][key] = RateWindow()
        window.add(nbytes, seconds)

    def rate(self, name: str, **labels: str) -> float:
        window = self._rates.get(name, {}).get(tuple(sorted(labels.items())))
        return window.gbps() if window is not None else 0.0

    def rates(self) -> dict[str, dict[LabelKey, float]]:
        return {name: {k: w.gbps() for k, w in series.items()} for name, series in self._rates.items()}


_DECLARED = tuple(f for f in dataclasses.fields(CounterStats) if f.name != "others")
