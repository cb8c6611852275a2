"""The statistics convention (``hkvd.transport.stat_fields``): every stats field says where it goes, /metrics
exports only what fields declare, and the status JSON keeps its keys and shapes.

The stats dataclasses are found by importing every module of daemon/ and transport/; a fully populated
``DaemonStats`` is built from their type hints (every optional part present, every mapping non-empty), so a
field added later is covered without touching this file.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgpack
import pytest

from hkvd.daemon.app import DaemonStats
from hkvd.transport.stat_fields import (
    SUFFIX,
    Metric,
    Part,
    StatusOnly,
    declaration,
    declared_metrics,
    families,
    status_dict,
)

REPO = Path(__file__).resolve().parents[2]


def _stats_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for layer in ("transport", "daemon"):
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            module = importlib.import_module("hkvd." + ".".join(parts))
            for name, obj in vars(module).items():
                if isinstance(obj, type) and obj.__module__ == module.__name__ and name.endswith("Stats"):
                    assert name not in found, f"two stats classes named {name}"
                    found[name] = obj
    return found


STATS = _stats_classes()


def test_stats_classes_are_frozen_slotted_dataclasses() -> None:
    assert {"DaemonStats", "ServiceStats", "PoolStats", "IndexStats", "DiskStats", "ClusterStats", "PeerStats",
            "TransportStats", "GateStats", "CounterStats", "SnapshotStats"} <= set(STATS)
    for name, cls in STATS.items():
        assert dataclasses.is_dataclass(cls), f"{name} is not a dataclass (a NamedTuple? convert it)"
        assert cls.__dataclass_params__.frozen, f"{name} is not frozen"  # type: ignore[attr-defined]
        assert "__slots__" in cls.__dict__, f"{name} is not slotted"


def test_every_stats_field_declares_a_metric_or_status_only_or_a_part() -> None:
    missing = [f"{name}.{f.name}" for name, cls in STATS.items() for f in dataclasses.fields(cls)
               if declaration(f) is None]
    assert not missing, ("stats fields without a declaration (hkvd.transport.stat_fields: metric(...), "
                         f"status_only() or part()): {', '.join(missing)}")


def test_no_component_keeps_a_dict_stats_method() -> None:
    """One convention: ``statistics()`` returning a stats dataclass. ``status()`` is the service's JSON view of
    its statistics; ``describe()`` only the usable-prefix route's answer (``Format``)."""
    bad = []
    for layer in ("daemon", "transport"):
        for path in (REPO / layer).rglob("*.py"):
            text = path.read_text()
            rel = path.relative_to(REPO)
            bad += [f"{rel}: def stats(" for _ in re.finditer(r"def stats\(", text)]
            if str(rel) != "daemon/routing/usable_prefix.py":
                bad += [f"{rel}: def describe(" for _ in re.finditer(r"def describe\(", text)]
    assert not bad, bad


# ---- a fully populated DaemonStats --------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    # Types named only under TYPE_CHECKING in a module resolve through every stats class's name.
    return typing.get_type_hints(cls, localns={**STATS, **vars(collections.abc)})


def _fill(tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _fill(next(a for a in args if a is not type(None)))
    if dataclasses.is_dataclass(tp):
        return tp(**{name: _fill(hint) for name, hint in _hints(tp).items()})  # type: ignore[operator]
    if origin is tuple:
        return (_fill(args[0]),) if args[-1] is Ellipsis else tuple(_fill(a) for a in args)
    if origin in (dict, collections.abc.Mapping):
        return {_fill(args[0]): _fill(args[1])}
    return {bool: True, int: 3, float: 1.5, str: "worker", bytes: b"x"}[tp]


@pytest.fixture(scope="module")
def full() -> DaemonStats:
    stats = _fill(DaemonStats)
    assert isinstance(stats, DaemonStats) and stats.service is not None and stats.service.l2 is not None
    return stats


def _declared() -> list[Metric]:
    return [m for cls in STATS.values() for _, m in declared_metrics(cls)]


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name).replace(re.escape("{key}"), "[a-z0-9_]+") + "$")


def test_every_exported_family_comes_from_a_declared_field(full: DaemonStats) -> None:
    patterns = [_pattern(m.name) for m in _declared()]
    for fam in families(full):
        assert any(p.match(fam.name) for p in patterns), f"{fam.name} is exported but no stats field declares it"
        assert fam.samples, f"{fam.name} has no sample from a populated field"


def test_every_declared_metric_is_exported_from_its_field(full: DaemonStats) -> None:
    exported = {fam.name for fam in families(full)}
    for m in _declared():
        assert any(_pattern(m.name).match(n) for n in exported), f"{m.name} is declared but never exported"


def test_fields_that_share_a_family_agree_on_help_and_type() -> None:
    seen: dict[str, tuple[str, str]] = {}
    for m in _declared():
        assert seen.setdefault(m.name, (m.help, m.type)) == (m.help, m.type), m.name


# Dashboards and alerts read these: name -> (type, label names, help). Keep them as they are.
PUBLISHED = {
    "hkvd_bytes_stored": ("gauge", "", "Bytes held by index entries"),
    "hkvd_cluster_connected": ("gauge", "", "1 while the cluster's master answers"),
    "hkvd_cluster_corrupt": ("counter", "reason",
        "Cluster values found unusable (mac: not sealed with a fleet key this node holds, or damaged; size, header) "
        "and removed, by reason"),
    "hkvd_cluster_errors": ("counter", "reason", "Cluster calls that failed (connect, exist, put, get), by operation"),
    "hkvd_cluster_get_bytes": ("counter", "", "Payload bytes read from the cluster"),
    "hkvd_cluster_get_gbps": ("gauge", "", "Cluster get throughput, last 64 batches"),
    "hkvd_cluster_gets": ("counter", "", "Entries read from the cluster and verified"),
    "hkvd_cluster_insecure": ("gauge", "", "1 when values are sealed with the public key (--cluster-insecure)"),
    "hkvd_cluster_misses": ("counter", "", "Entries a lookup asked the cluster for that it did not hold"),
    "hkvd_cluster_put_bytes": ("counter", "", "Bytes put in the cluster (headers included)"),
    "hkvd_cluster_put_gbps": ("gauge", "", "Cluster put throughput, last 64 batches"),
    "hkvd_cluster_puts": ("counter", "", "Entries put in the cluster (write-behind)"),
    "hkvd_cluster_queued_entries": ("gauge", "", "Entries waiting in the cluster write-behind queue"),
    "hkvd_cluster_reconnects": ("counter", "", "Times the master became reachable again after an outage"),
    "hkvd_cluster_skips": ("counter", "reason",
        "Offers not put in the cluster (queue_full, unavailable, cluster_full, busy), by reason"),
    "hkvd_connections": ("gauge", "", "Open control connections"),
    "hkvd_copy_gbps": ("gauge", "direction", "Copy throughput of the last 64 copies (submit to done), by direction"),
    "hkvd_descriptor_reserve": ("gauge", "",
        "Descriptors kept free for the engines served: new engines are refused once fewer are left"),
    "hkvd_engine_lookup_hit_tokens": ("counter", "model,rank", "Tokens that lookups found, by engine (model, rank)"),
    "hkvd_engine_lookup_miss_tokens": ("counter", "model,rank",
        "Tokens that lookups did not find, by engine (model, rank)"),
    "hkvd_engine_retrieved_bytes": ("counter", "model,rank", "Bytes retrieved from the pool, by engine (model, rank)"),
    "hkvd_engine_stored_bytes": ("counter", "model,rank", "Bytes stored into the pool, by engine (model, rank)"),
    "hkvd_engines": ("gauge", "role", "Registered engines by role"),
    "hkvd_entries": ("gauge", "state", "Index entries by state"),
    "hkvd_entries_by_kind": ("gauge", "kind", "Index entries by group kind"),
    "hkvd_evictions": ("counter", "", "Entries evicted"),
    "hkvd_evictions_by_reason": ("counter", "reason", "Entries evicted, by why they were the candidate (policy: the "
        "eviction order; orphan: they could serve no hit; quota: their tenant was over its quota)"),
    "hkvd_admission_entries": ("counter", "outcome", "Entries of engines' stores by admission outcome (admitted: "
        "placed; refused: the entry they would evict was asked for more often, --admission tinylfu)"),
    "hkvd_admission_bytes": ("counter", "outcome",
        "Bytes of engines' stores by admission outcome (admitted, refused)"),
    "hkvd_index_stores_dropped": ("counter", "", "Stores the index dropped (pool full)"),
    "hkvd_inflight_copies": ("gauge", "", "Copies running now"),
    "hkvd_l2_bytes": ("gauge", "", "Bytes of the disk tier's files"),
    "hkvd_l2_capacity_bytes": ("gauge", "", "The disk tier's cap (--l2-size-gb)"),
    "hkvd_l2_corrupt_files": ("counter", "reason",
        "Disk-tier files skipped as unusable (and deleted, except another format version), by reason"),
    "hkvd_l2_entries": ("gauge", "", "Entries in the disk tier's catalog"),
    "hkvd_l2_evictions": ("counter", "", "Disk-tier files deleted to stay under --l2-size-gb"),
    "hkvd_l2_queue_drops": ("counter", "", "Entries not written because the write-behind queue was full"),
    "hkvd_l2_queued_entries": ("gauge", "", "Entries waiting in the write-behind queue"),
    "hkvd_l2_read_bytes": ("counter", "", "Payload bytes read from the disk tier"),
    "hkvd_l2_read_errors": ("counter", "", "Disk-tier reads that failed with an I/O error"),
    "hkvd_l2_read_gbps": ("gauge", "", "Disk-tier read throughput, last 64 files"),
    "hkvd_l2_reads": ("counter", "", "Disk-tier files read and verified"),
    "hkvd_l2_write_bytes": ("counter", "", "Bytes written to the disk tier (headers included)"),
    "hkvd_l2_write_errors": ("counter", "", "Disk-tier writes that failed (disk full, I/O error)"),
    "hkvd_l2_write_gbps": ("gauge", "", "Disk-tier write throughput, last 64 files"),
    "hkvd_l2_writes": ("counter", "", "Entries written to the disk tier"),
    "hkvd_leases": ("gauge", "", "Lookup leases held"),
    "hkvd_orphans_dropped": ("counter", "", "Orphaned entries dropped"),
    "hkvd_orphans_marked": ("counter", "", "Entries found unable to serve any hit (evicted first by hybrid)"),
    "hkvd_pin_budget_bytes": ("gauge", "", "The most pool bytes session pins may hold (--pin-max-fraction)"),
    "hkvd_pin_sessions": ("gauge", "", "Sessions holding pins"),
    "hkvd_pinned_bytes": ("gauge", "", "Pool bytes of the entries session pins hold"),
    "hkvd_pinned_entries": ("gauge", "", "Entries pinned by a copy or a lease"),
    "hkvd_pins_lapsed": ("counter", "reason",
        "Pins ended, by reason (ttl, budget, unpin, superseded, session_limit)"),
    "hkvd_pins_refused": ("counter", "", "Pins of a new session refused: too many sessions pinned"),
    "hkvd_pool_corrupt": ("counter", "reason",
        "Pool entries dropped as damaged, by reason (checksum: their bytes no longer hash to their checksum)"),
    "hkvd_entries_checksummed": ("gauge", "",
        "READY entries whose checksum is taken"),
    "hkvd_checksums_taken": ("counter", "",
        "Entry checksums taken after their bytes landed"),
    "hkvd_checksums_skipped": ("counter", "",
        "Entries whose checksum was left to the scrubber (the hashing queue was full)"),
    "hkvd_checksums_queued": ("gauge", "",
        "Entries waiting for their checksum"),
    "hkvd_checksum_mismatches": ("counter", "where",
        "Checksum mismatches found, by where (scrub, disk_write, cluster_put, peer_pull)"),
    "hkvd_scrub_rate_mb": ("gauge", "",
        "The scrubber's limit in MB/s (0: off)"),
    "hkvd_scrub_entries": ("counter", "",
        "Pool entries re-hashed by the scrubber"),
    "hkvd_scrub_bytes": ("counter", "",
        "Bytes re-hashed by the scrubber"),
    "hkvd_scrub_adopted": ("counter", "",
        "Entries the scrubber gave their first checksum"),
    "hkvd_scrub_passes": ("counter", "",
        "Scrub passes completed over the whole index"),
    "hkvd_scrub_cpu_seconds": ("counter", "",
        "CPU time of the scrubber's thread"),
    "hkvd_pool_bytes": ("gauge", "state", "Pool bytes by state"),
    "hkvd_pool_huge_bytes": ("gauge", "", "Pool bytes backed by huge pages (hugetlb or THP)"),
    "hkvd_pool_occupancy_ratio": ("gauge", "", "Used / total pool bytes"),
    "hkvd_pool_hits_per_byte": ("gauge", "", "Bytes retrieves copied out of the pool since start over the bytes "
        "its entries hold now: how many times over the pool's contents have been served (0 while it holds nothing)"),
    "hkvd_pool_page_size_bytes": ("gauge", "kind",
        "Page size backing the pool, by the kind the kernel reports (hugetlb, thp or plain; /proc/self/smaps)"),
    "hkvd_prefault_gbps": ("gauge", "", "Pool pre-fault bandwidth at start-up"),
    "hkvd_ready": ("gauge", "", "1 while serving (pool pre-faulted, socket accepting)"),
    "hkvd_quarantined": ("gauge", "fingerprint,group,kind",
        "1 while the entries of a fingerprint and group are not served, by engine fingerprint and group"),
    "hkvd_quarantines": ("counter", "", "Quarantines begun (divergences past the threshold)"),
    "hkvd_quarantines_lifted": ("counter", "", "Quarantines lifted (hkvd quarantine --clear, SIGHUP)"),
    "hkvd_request_duration_seconds": ("histogram", "le,op",
        "Seconds from the daemon taking a request to its reply (or error), by op (lookup, store, retrieve); disk and "
        "cluster reads and copies included"),
    "hkvd_tenant_bytes": ("gauge", "tenant", "Pool bytes held by each tenant's entries ('' is the unsalted share)"),
    "hkvd_tenant_evictions": ("counter", "tenant", "Entries evicted, by the tenant that stored them"),
    "hkvd_tenant_quota_bytes": ("gauge", "tenant", "Each tenant's quota of the pool, in bytes"),
    "hkvd_verify_checks": ("counter", "fingerprint,group,kind",
        "Entries of sampled hits compared with the engine's recomputation, by engine fingerprint and group"),
    "hkvd_verify_divergences": ("counter", "fingerprint,group,kind",
        "Compared entries past their tolerance, by engine fingerprint and group"),
    "hkvd_verify_matches": ("counter", "fingerprint,group,kind",
        "Compared entries within their tolerance, by engine fingerprint and group"),
    "hkvd_verify_max_error": ("gauge", "fingerprint,group,kind",
        "Largest relative error seen in a comparison, by engine fingerprint and group"),
    "hkvd_verify_missing": ("counter", "fingerprint,group,kind",
        "Entries a check named that were no longer held (not compared), by engine fingerprint and group"),
}
# The Metrics counters (``CounterStats``), name -> help: labels are whatever ``inc`` passes.
PUBLISHED_COUNTERS = {
    "hkvd_cluster_hits": "Entries read from the cluster tier into the pool for a lookup, by group kind",
    "hkvd_cluster_read_failures":
        "Cluster-tier reads not served (mac, size, header, gone, io, timeout, pool_full), by reason",
    "hkvd_connections_refused":
        "Engine connections refused at their Hello, by reason (descriptors: the open-file limit's reserve was reached;"
        " raise LimitNOFILE)",
    "hkvd_copy_errors": "Copies that failed",
    "hkvd_copy_timeouts": "Copies that exceeded their timeout",
    "hkvd_engines_registered": "Engine registrations",
    "hkvd_errors": "Errors sent to clients, by code",
    "hkvd_gc_collections": "Cyclic garbage collections, by generation",
    "hkvd_gc_pause_seconds": "Seconds the event loop stood still in garbage collections, by generation",
    "hkvd_internal_errors": "Internal errors (bugs)",
    "hkvd_l2_hits": "Entries read from the disk tier into the pool for a lookup, by group kind",
    "hkvd_l2_read_failures": "Disk-tier reads not served (checksum, truncated, io, timeout, pool_full), by reason",
    "hkvd_leases_expired": "Lookup leases that expired unreleased",
    "hkvd_lookup_hit_chunks": "Chunks that lookups found (the hybrid hit, in chunks)",
    "hkvd_lookup_hit_entries": "Entries the served hits load, by group kind",
    "hkvd_lookup_miss_chunks": "Chunks that lookups did not find",
    "hkvd_lookup_miss_entries": "Entries whose absence cut a lookup's hit short, by group kind",
    "hkvd_lookup_turn_ends_named": "Turn-end positions named in lookup replies (stored by any engine)",
    "hkvd_lookup_places": "Leased lookups answered with their entries' pool extents (in-step loads)",
    "hkvd_lookups": "Lookup requests served",
    "hkvd_retrieve_misses": "Retrieves of entries no longer in the pool",
    "hkvd_retrieved_bytes": "Bytes retrieved from the pool, by group kind",
    "hkvd_hints": "KV hints from routers and engines (docs/hints.md), by action (share, prefetch, demote, pin, "
                  "retain, unknown) and outcome (accepted, clipped, deferred, rejected)",
    "hkvd_snapshots_invalidated": "Mamba snapshot jobs invalidated",
    "hkvd_step_event_gaps": "Step-event sequence gaps (unconfirmed Mamba states invalidated)",
    "hkvd_step_events": "Step events, by outcome",
    "hkvd_stored_bytes": "Bytes stored into the pool, by group kind",
    "hkvd_stores_dropped": "Entries not stored because the pool was full of pinned entries, by kind",
    "hkvd_store_entries": "Entries of engines' stores (and Mamba states offered), by outcome: stored, or why not "
        "(present: the pool had it; admission: --admission refused it; no_room: the pool was full of entries it may "
        "not evict; thinned: --mamba-checkpoint-interval; store_tiers: the request's kv_store_tiers leave the pool "
        "out)",
    "hkvd_store_bytes": "Bytes of the entries of hkvd_store_entries_total, by the same outcome",
    "hkvd_lookup_tiers_left_out": "Lookups whose kv_load_tiers left a tier out (pool, disk, cluster), by tier",
    "hkvd_tier_writes_left_out": "Stored entries not written to a tier below the pool because the request's "
        "kv_store_tiers left it out, by tier (l2, cluster)",
    "hkvd_tier_bytes_left_out": "Bytes of hkvd_tier_writes_left_out_total, by tier",
    "hkvd_tp_reshards": "Lookups (op=lookup) and retrieves (op=retrieve) served from entries another TP size "
                        "stored, re-sharded on read; pulls from a peer's world of another TP size (op=pull), and "
                        "pulls refused because no such world could be read (op=pull_refused)",
    "hkvd_uncacheable_requests": "Requests the shim could not key safely, never cached, by reason",
    "hkvd_usable_prefix_requests":
        "Routers' usable-prefix lookups on the metrics port, by outcome (ok, bad_request, unknown_model)",
}


def test_published_metrics_keep_their_names_types_help_and_labels(full: DaemonStats) -> None:
    series = {f.name for f in dataclasses.fields(STATS["CounterStats"])} - {"others", "prefault_gbps"}
    undeclared = {f"hkvd_{name}" for name in full.counters.others}  # exported generically: see below
    got = {}
    for fam in families(full):
        if fam.name.removeprefix("hkvd_") in series:
            got[fam.name] = (fam.type, None, fam.help)
        elif fam.name not in undeclared:
            labels = ",".join(sorted({k for labels, _ in fam.samples for k in labels} - {SUFFIX}))
            got[fam.name] = (fam.type, labels, fam.help)
    want = {**{name: (kind, labels, help_) for name, (kind, labels, help_) in PUBLISHED.items()},
            **{name: ("counter", None, help_) for name, help_ in PUBLISHED_COUNTERS.items()}}
    assert got == want


def test_undeclared_counters_export_generically(full: DaemonStats) -> None:
    from hkvd.daemon.metrics import Metrics

    m = Metrics()
    m.inc("peer_pulls", outcome="ok")
    m.inc("lookups", 2)
    fams = {f.name: f for f in families(m.statistics())}
    assert fams["hkvd_peer_pulls"] == ("hkvd_peer_pulls", "peer pulls", "counter", [({"outcome": "ok"}, 1.0)])
    assert fams["hkvd_lookups"].samples == [({}, 2.0)]
    assert fams["hkvd_errors"].samples == [({}, 0.0)]  # declared: 0 before the first inc
    assert "hkvd_gc_collections" not in fams  # declared "only once counted"
    assert fams["hkvd_prefault_gbps"].samples == [({}, 0.0)]


# ---- the status JSON ---------------------------------------------------------------------------------

STATUS_KEYS = {
    "": ["engines", "pool", "index", "counters", "by_kind", "uncacheable_requests", "rates", "l2", "cluster", "peer",
         "heap", "kv_events", "descriptors", "shutting_down", "engine_traffic", "latency", "verify",
         "integrity", "pins", "tenants", "hints", "keeping"],
    "engines": ["engine_id", "pid", "model", "rank", "world_size", "chunk_size", "fingerprint", "role", "groups"],
    "pool": ["total_bytes", "used_bytes", "free_bytes", "kind", "page_size", "huge_bytes", "hugepages", "mapped_kind",
             "superblock_bytes", "faulted_bytes", "prefault", "numa_node", "numa_policy", "node_bytes"],
    "pool.prefault": ["threads", "done", "error", "seconds", "gbps"],
    "index": ["entries", "ready", "pending", "writing", "bytes_stored", "leases", "pinned_entries", "evictions",
              "orphans_dropped", "orphans_marked", "chain_nodes", "stores_dropped", "by_kind", "corrupt",
              "checksummed", "evictions_by_reason", "admission", "admission_entries", "admission_bytes"],
    "rates": ["copy_gbps"],
    "l2": ["path", "cap_bytes", "entries", "bytes", "queued", "queued_bytes", "writes", "write_bytes", "write_errors",
           "queue_drops", "evictions", "reads", "read_bytes", "read_errors", "corrupt", "write_gbps", "read_gbps",
           "scan"],
    "l2.scan": ["entries", "files", "seconds", "tmp_removed", "evicted"],
    "cluster": ["master", "connected", "protocol", "key_id", "accepted_key_ids", "insecure", "segment_bytes",
                "replicas", "queued", "queued_bytes", "puts", "put_bytes", "gets", "get_bytes", "probes", "probe_keys",
                "probe_hits", "misses", "reconnects", "skips", "errors", "corrupt", "put_gbps", "get_gbps"],
    "peer": ["listen", "advertise", "agent", "allow", "transport", "transport_kind", "read_gbps",
             "quarantined_entries", "links", "serving"],
    "peer.transport": ["reads", "reads_failed", "reads_aborted", "bytes_read", "in_flight", "peers", "host_restarts",
                       "host_pid"],
    "peer.serving": ["listen", "connections", "lingering_refusals", "sessions"],
    "peer.serving.connections": ["connections", "addresses", "max_connections", "max_per_address"],
    "heap": ["freeze_every", "freezes", "frozen_objects", "max_pause_ms"],
    "kv_events": ["notes", "announced", "layouts", "events", "batches", "next_seq", "publisher"],
    "kv_events.publisher": ["endpoint", "replay_endpoint", "sent", "dropped", "send_errors", "queued", "replays",
                            "replayed_batches", "kept"],
    "descriptors": ["used", "limit", "hard_limit", "reserve", "engines_room"],
    "engine_traffic": ["engines"],
    "engine_traffic.engines": ["model", "rank", "lookup_hit_tokens", "lookup_miss_tokens", "stored_bytes",
                               "retrieved_bytes"],
    "latency": ["lookup", "store", "retrieve"],
    "latency.lookup": ["bounds", "counts", "count", "sum_seconds"],
    "verify": ["groups", "quarantines", "lifted"],
    "integrity": ["checksums_taken", "checksums_skipped", "checksums_queued", "mismatches", "scrub_rate_mb",
                  "scrub_entries", "scrub_bytes", "scrub_adopted", "scrub_passes", "scrub_cpu_s"],
    "pins": ["pinned_bytes", "budget_bytes", "sessions", "pins", "lapsed", "refused", "longest"],
    "pins.longest": ["session", "tenant", "pins", "ttl_left_s"],
    "tenants": ["quotas", "bytes", "quota_bytes", "evictions"],
    "keeping": ["stores", "store_bytes", "tiers_left_out", "hit_bytes", "pool_bytes", "hits_per_pool_byte"],
    "verify.groups": ["fingerprint", "group", "kind", "checks", "matches", "divergences", "missing", "max_error",
                      "quarantined", "since"],
}


def test_status_json_keeps_its_keys_in_order(full: DaemonStats) -> None:
    assert full.service is not None
    s = status_dict(full.service)
    for path, keys in STATUS_KEYS.items():
        node: Any = s
        for part in filter(None, path.split(".")):
            node = node[part]
        if isinstance(node, list):
            node = node[0]
        assert list(node) == keys, path
    assert s["engines"][0]["groups"][0] == {"group_id": 3, "kind": "worker", "tokens_per_block": 3,
                                            "window_tokens": 3, "entry_bytes": 3}
    assert s["peer"]["links"] == [{"address": "worker", "layout": "worker", "up": True, "requests": 3}]
    assert json.loads(json.dumps(s)) == s  # plain lists and dicts, as the control socket's msgpack carries them
    assert msgpack.unpackb(msgpack.packb(s), strict_map_key=False) == s


def test_optional_parts_are_null_and_a_missing_publisher_leaves_no_key(full: DaemonStats) -> None:
    assert full.service is not None and full.service.kv_events is not None
    service = dataclasses.replace(full.service, l2=None, cluster=None, peer=None, heap=None,
                                  kv_events=dataclasses.replace(full.service.kv_events, publisher=None))
    s = status_dict(service)
    assert s["l2"] is None and s["cluster"] is None and s["peer"] is None and s["heap"] is None
    assert "publisher" not in s["kv_events"]
    names = {fam.name for fam in families(dataclasses.replace(full, service=service, server=None))}
    tiers = {n for n in names if n.startswith(("hkvd_l2_", "hkvd_cluster_"))}
    assert tiers == {"hkvd_l2_hits", "hkvd_l2_read_failures", "hkvd_cluster_hits", "hkvd_cluster_read_failures"}
    assert "hkvd_connections" not in names and "hkvd_pool_bytes" in names


def test_declarations_are_what_they_say() -> None:
    for cls in STATS.values():
        for f in dataclasses.fields(cls):
            decl = declaration(f)
            assert isinstance(decl, (tuple, StatusOnly, Part))
            if isinstance(decl, tuple):
                assert decl and all(isinstance(m, Metric) and m.name.startswith("hkvd_") for m in decl), f.name
