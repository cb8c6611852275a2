"""vLLM's connector stats for hkvd (``hkvd.shim.connector_stats``): deltas since the last call, sums across
workers and intervals, the log line, and the ``vllm:hkvd_*`` counters. A worker's real ``Loads`` drives them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: make vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hkvd.shim.connector import HkvdConnector
from hkvd.shim.connector_stats import FIELDS, HkvdConnectorStats, StatsReporter
from hkvd.shim.jobs import LoadJob
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.testing.fake_daemon import FakeDaemon
from hkvd.shim.worker import WorkerSide
from hkvd.transport.wire.kv import RetrieveResult


def _done(rid: int, nbytes: int) -> Any:
    return SimpleNamespace(req_id=rid, ok=True, get=lambda _cls: RetrieveResult(rid, nbytes, 1))


def _failed(rid: int) -> Any:
    return SimpleNamespace(req_id=rid, ok=False, error="NOT_FOUND")


def test_stats_are_what_moved_since_the_previous_call() -> None:
    w = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent/hkvd.sock"))
    client, reporter = FakeDaemon(), StatsReporter()
    assert reporter.take(w.transfer_totals()) is None  # nothing moved: vLLM gets None
    for r in ("a", "b"):
        w.loads.start(client, LoadJob(r, 0, [], [1]), 0)
    assert w.loads.absorb(_done(1, 4096)) and w.loads.absorb(_failed(2))
    w.stats["stored_bytes"] += 100
    first = reporter.take(w.transfer_totals())
    assert first is not None and not first.is_empty()
    assert {k: first.data[k] for k in ("loads_ok", "loads_failed", "loaded_bytes", "stored_bytes")} == {
        "loads_ok": 1, "loads_failed": 1, "loaded_bytes": 4096, "stored_bytes": 100}
    assert first.data["load_seconds"] > 0
    assert reporter.take(w.transfer_totals()) is None  # reported once
    w.loads.start(client, LoadJob("c", 0, [], [2]), 0)
    w.loads.absorb(_done(3, 512))
    second = reporter.take(w.transfer_totals())
    assert second is not None and (second.data["loads_ok"], second.data["loaded_bytes"]) == (1, 512)
    assert second.data["loads_failed"] == 0 and second.data["stored_bytes"] == 0


def test_workers_and_intervals_sum_and_reduce_to_the_log_line() -> None:
    a = HkvdConnectorStats(data={"loads_ok": 2, "loads_failed": 0, "loaded_bytes": 2 << 20, "load_seconds": 0.004,
                                 "stored_bytes": 1 << 20})
    # As vLLM sends it to the front end: the plain dict, rebuilt by the connector class.
    b = HkvdConnector.build_kv_connector_stats(
        HkvdConnectorStats(data={"loads_ok": 2, "loads_failed": 1, "loaded_bytes": 2 << 20, "load_seconds": 0.004,
                                 "stored_bytes": 0}).to_dict())
    assert isinstance(b, HkvdConnectorStats)
    total = a.aggregate(b)
    assert total is a and total.reduce() == {"loads_ok": 4, "loads_failed": 1, "loaded_MiB": 4.0,
                                             "avg_load_ms": 2.0, "stored_MiB": 1.0, "lookups_deferred": 0,
                                             "load_settles_won": 0, "loads_reported_early": 0}
    total.reset()
    assert total.is_empty() and set(total.data) == set(FIELDS)
    empty = HkvdConnector.build_kv_connector_stats()
    assert isinstance(empty, HkvdConnectorStats) and empty.is_empty() and empty.reduce()["avg_load_ms"] == 0.0


def test_prometheus_counters_add_each_interval() -> None:
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(self, *a, registry=registry,
                                                                                           **kw)})

    prom = HkvdConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
                                            {Counter: bound(Counter), Gauge: bound(Gauge),
                                             Histogram: bound(Histogram)},
                                            ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:hkvd_loaded_bytes_total", labels) == 0  # there before the first load
    prom.observe({"loads_ok": 2, "loads_failed": 1, "loaded_bytes": 100, "load_seconds": 0.5, "stored_bytes": 7})
    prom.observe({"loads_ok": 1, "loads_failed": 0, "loaded_bytes": 50, "load_seconds": 0.25, "stored_bytes": 0,
                  "lookups_deferred": 3, "load_settles_won": 2, "load_settle_seconds": 0.01,
                  "loads_reported_early": 4})
    assert registry.get_sample_value("vllm:hkvd_loads_total", {**labels, "outcome": "ok"}) == 3
    assert registry.get_sample_value("vllm:hkvd_loads_total", {**labels, "outcome": "failed"}) == 1
    assert registry.get_sample_value("vllm:hkvd_loaded_bytes_total", labels) == 150
    assert registry.get_sample_value("vllm:hkvd_load_seconds_total", labels) == pytest.approx(0.75)
    assert registry.get_sample_value("vllm:hkvd_stored_bytes_total", labels) == 7
    assert registry.get_sample_value("vllm:hkvd_lookups_deferred_total", labels) == 3
    assert registry.get_sample_value("vllm:hkvd_load_settles_won_total", labels) == 2
    assert registry.get_sample_value("vllm:hkvd_load_settle_seconds_total", labels) == pytest.approx(0.01)
    assert registry.get_sample_value("vllm:hkvd_loads_reported_early_total", labels) == 4
    prom.observe({"pins_sent": 2, "pins_refused": 1})
    assert registry.get_sample_value("vllm:hkvd_pins_sent_total", labels) == 2
    assert registry.get_sample_value("vllm:hkvd_pins_refused_total", labels) == 1
    prom.observe({"verify_checks": 3, "verify_max_error": 0.01, "verify_max_error_swa": 0.01})
    prom.observe({"verify_checks": 2, "verify_max_error": 0.002, "verify_max_error_full": 0.002})  # a lower maximum
    assert registry.get_sample_value("vllm:hkvd_verify_checks_total", labels) == 5
    assert registry.get_sample_value("vllm:hkvd_verify_max_error", {**labels, "kind": "all"}) == 0.01
    assert registry.get_sample_value("vllm:hkvd_verify_max_error", {**labels, "kind": "swa"}) == 0.01
    assert registry.get_sample_value("vllm:hkvd_verify_max_error", {**labels, "kind": "full"}) == 0.002


def test_sampled_checks_count_entries_and_keep_the_largest_error() -> None:
    from hkvd.transport.wire.kv import VerifyResult

    w1 = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent/hkvd.sock"))
    w2 = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent/hkvd.sock"))
    r1, r2 = StatsReporter(), StatsReporter()
    w1.verify.result("a", VerifyResult(0, 4096, checked=8, diverged=0, missing=1, max_error=0.0078, quarantined=False),
                     "full")
    w1.verify.failed("b", "unknown message type")  # a daemon without verification: counted, nothing compared
    w2.verify.result("c", VerifyResult(0, 4096, checked=4, diverged=1, missing=0, max_error=0.5, quarantined=True),
                     "swa")
    s1, s2 = r1.take(w1.transfer_totals()), r2.take(w2.transfer_totals())
    assert s1 is not None and s2 is not None
    total = HkvdConnector.build_kv_connector_stats(s1.to_dict())
    assert isinstance(total, HkvdConnectorStats)
    line = total.aggregate(s2).reduce()
    assert {k: line[k] for k in ("verify_checks", "verify_matches", "verify_divergences", "verify_missing",
                                 "verifies_failed", "verify_max_error")} == {
        "verify_checks": 12, "verify_matches": 11, "verify_divergences": 1, "verify_missing": 1,
        "verifies_failed": 1, "verify_max_error": 0.5}  # the maximum across workers, never their sum
    assert (line["verify_max_error_full"], line["verify_max_error_swa"]) == (0.0078, 0.5)  # per group kind
    # A later interval with a smaller error: the running maximum stays, the counts are the new ones.
    w1.verify.result("d", VerifyResult(0, 512, checked=2, diverged=0, missing=0, max_error=0.001, quarantined=False))
    later = r1.take(w1.transfer_totals())
    assert later is not None and later.data["verify_checks"] == 2 and later.data["verify_max_error"] == 0.0078
    assert r1.take(w1.transfer_totals()) is None  # nothing new: a maximum alone is no interval's news
