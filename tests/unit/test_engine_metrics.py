"""The daemon's per-engine counters (``hkvd.daemon.engines.engine_traffic``) and latency histograms
(``hkvd.daemon.engines.latency``) on their own; tests/unit/test_service.py has them from a served engine."""

from __future__ import annotations

from hkvd.daemon.engines.engine_traffic import OTHER, EngineTraffic
from hkvd.daemon.engines.latency import BOUNDS, Histogram, Latencies
from hkvd.transport.stat_fields import SUFFIX, families, sample_name


def test_histogram_counts_each_observation_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    h = Histogram((0.001, 0.01, 0.1))
    for v in (0.0005, 0.001, 0.002, 0.5):  # a value equal to a bound belongs to that bound (le)
        h.observe(v)
    s = h.statistics()
    assert s.counts == (2, 3, 3) and s.count == 4 and abs(s.sum_seconds - 0.5035) < 1e-12


def test_latency_histogram_exports_buckets_sum_and_count_by_op() -> None:
    lat = Latencies()
    lat.observe("store", 3e-05)
    lat.observe("store", 20.0)  # past the last bound: only +Inf
    (fam,) = families(lat.statistics())
    assert fam.name == "hkvd_request_duration_seconds" and fam.type == "histogram"
    store = {sample_name(fam, labels)[0] + str(sorted(sample_name(fam, labels)[1].items())): v
             for labels, v in fam.samples if labels["op"] == "store"}
    assert store["hkvd_request_duration_seconds_bucket[('le', '5e-05'), ('op', 'store')]"] == 1
    assert store["hkvd_request_duration_seconds_bucket[('le', '10.0'), ('op', 'store')]"] == 1
    assert store["hkvd_request_duration_seconds_bucket[('le', '+Inf'), ('op', 'store')]"] == 2
    assert store["hkvd_request_duration_seconds_count[('op', 'store')]"] == 2
    assert store["hkvd_request_duration_seconds_sum[('op', 'store')]"] == 20.00003
    assert len(store) == len(BOUNDS) + 3
    assert all(SUFFIX in labels for labels, _ in fam.samples)


def test_engine_counters_outlive_their_engine_and_fold_past_the_bound() -> None:
    t = EngineTraffic(max_label_sets=3)
    t.lookup("a", 0, 64, 32)
    t.stored("a", 1, 100)
    t.retrieved("b", 0, 7)  # the third label set: the last one is kept for the fold
    t.stored("c", 0, 5)
    t.stored("a", 0, 10)  # a label set already counted keeps counting under its own labels
    rows = {(e.model, e.rank): (e.lookup_hit_tokens, e.lookup_miss_tokens, e.stored_bytes, e.retrieved_bytes)
            for e in t.statistics().engines}
    assert rows == {("a", "0"): (64, 32, 10, 0), ("a", "1"): (0, 0, 100, 0), OTHER: (0, 0, 5, 7)}
    fams = {f.name: f for f in families(t.statistics())}
    assert set(fams) == {"hkvd_engine_lookup_hit_tokens", "hkvd_engine_lookup_miss_tokens",
                         "hkvd_engine_stored_bytes", "hkvd_engine_retrieved_bytes"}
    assert ({"model": "other", "rank": "other"}, 5.0) in fams["hkvd_engine_stored_bytes"].samples
    assert len(fams["hkvd_engine_stored_bytes"].samples) == 3
