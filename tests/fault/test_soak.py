"""Soak: several engine processes hammer one daemon for a bounded time; its memory stays flat.

Three ``soak`` engines (hybrid layout: attention stores, Mamba states through step events with
confirms, leased and lease-less lookups, retrieves verified byte for byte, leases left to expire
after ``--lease-ttl-s 2``, stores aborted at once) and one ``churn`` engine (connect, register,
store, lookup, disconnect holding its lease, over and over) share a 128 MiB pool, three times
smaller than what they store, for ``HKVD_SOAK_SECONDS`` (default 60; set it higher for a long run).

The daemon's RSS is sampled from /proc/PID/status every half second. After a warm-up (the first
10% of the run, at least 5 s: the pool fills, the index reaches its steady size), the median RSS of
the last third of the samples may exceed that of the first third by at most ``RSS_DRIFT_LIMIT_MIB``
(a leak of a few hundred bytes per operation would exceed it within the default run). Afterwards,
with every engine gone: 0 engines, leases, pins, writers and pending states, and a sweep of the
pool gives the same figure as the sweep before the soak.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

SOAK_S = float(os.environ.get("HKVD_SOAK_SECONDS", "60"))
SOAK_ENGINES = 3
RSS_DRIFT_LIMIT_MIB = 4.0
SAMPLE_S = 0.5


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_S) + 240)
def test_soak_keeps_rss_flat_and_leaves_nothing_behind(daemon_factory, fault, tmp_path):
    d = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "16", "--lease-ttl-s", "2")
    assert d.proc is not None
    before = fault.sweep(d, seed=1)
    samples: list[tuple[float, dict[str, int]]] = []
    done = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not done.wait(SAMPLE_S):
            samples.append((time.monotonic() - t0, fault.rss_kib(d.proc.pid)))

    engines = [fault.spawn(d, "soak", "--seconds", str(SOAK_S), "--id", str(i), "--window", "300")
               for i in range(SOAK_ENGINES)]
    engines.append(fault.spawn(d, "churn", "--seconds", str(SOAK_S)))
    for e in engines:
        e.ready()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        results = [e.result(timeout_s=SOAK_S + 120) for e in engines]
    finally:
        done.set()
        sampler.join(10)

    assert d.proc.poll() is None, "the daemon died"
    for e, r in zip(engines, results, strict=True):
        assert r["wrong"] == 0, f"{e.role}: wrong bytes came back: {r}"
        assert set(r["errors"]) <= {"NOT_FOUND", "LEASE_EXPIRED"}, f"{e.role}: {r}"
    st = d.status()
    idx, counters = st["index"], st["counters"]
    assert (st["engines"], idx["leases"], idx["pinned_entries"], idx["writing"], idx["pending"]) == ([], 0, 0, 0, 0)
    assert counters.get("internal_errors", 0) == 0 and counters.get("copy_errors", 0) == 0
    after = fault.sweep(d, seed=2)
    assert after == before, f"pool figure after the soak {after} != before {before}: something leaked"

    warm = max(5.0, SOAK_S / 10)
    steady = [(t, s) for t, s in samples if t >= warm]
    assert len(steady) >= 9, f"too few RSS samples ({len(steady)}) for a {SOAK_S} s soak"
    third = len(steady) // 3
    first = statistics.median(s["VmRSS"] for _, s in steady[:third]) / 1024
    last = statistics.median(s["VmRSS"] for _, s in steady[-third:]) / 1024
    anon_first = statistics.median(s["RssAnon"] for _, s in steady[:third]) / 1024
    anon_last = statistics.median(s["RssAnon"] for _, s in steady[-third:]) / 1024
    drift = last - first
    assert drift <= RSS_DRIFT_LIMIT_MIB, (f"daemon RSS grew {drift:.1f} MiB over the soak (first third {first:.1f}, "
                                          f"last third {last:.1f} MiB; limit {RSS_DRIFT_LIMIT_MIB})")
    series = [round(steady[i * (len(steady) - 1) // 5][1]["VmRSS"] / 1024, 1) for i in range(6)]
    soak = [r for e, r in zip(engines, results, strict=True) if e.role == "soak"]
    ops = sum(r["stored"] + r["retrieved"] + r["misses"] + r["abandoned_leases"] + r["aborted"] for r in soak)
    cycles = results[-1]["cycles"]
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    print(f"\nRELIABILITY soak: {SOAK_S:.0f} s, {SOAK_ENGINES} engines + 1 reconnecting ({cycles} connect/register/"
          f"disconnect cycles), engine ops {ops} (retrieved+verified {sum(r['retrieved'] for r in soak)}, "
          f"stored {sum(r['stored'] for r in soak)}, leases left to expire {sum(r['abandoned_leases'] for r in soak)}, "
          f"aborted {sum(r['aborted'] for r in soak)}), typed errors {errors}, leases expired by the daemon "
          f"{int(counters.get('leases_expired', 0))}, evictions {idx['evictions']}, wrong bytes 0; daemon RSS "
          f"first/last third median {first:.1f}/{last:.1f} MiB (drift {drift:+.1f} MiB; anon {anon_first:.1f}/"
          f"{anon_last:.1f}; over the run {series}), end: 0 leases, 0 pins, 0 writers, sweep figure equal {after}")


def test_late_aborts_are_not_kept(daemon, fault):
    """An Abort that arrives after its job finished changes nothing, and the daemon keeps no record
    of it (before the fix every late abort stayed in a per-connection set: ~75 B each, for as long
    as the engine stayed connected)."""
    from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
    from hkvd.transport.keys import chunk_keys

    assert daemon.proc is not None
    eng = SyntheticEngine(daemon.socket_path, [GroupShape("full", 1, 4096)], num_blocks=8)
    items = eng.items(0, chunk_keys(prompt_tokens(32, seed=3), eng.chunk_size), first_block=1)
    eng.store(items)

    def late_aborts(n: int) -> None:
        for _ in range(n):
            rid = eng.client.submit_store(items)  # a duplicate: done at once
            eng.run(rid)
            eng.client.abort(rid)
        eng.client.ping()  # every abort has been handled

    late_aborts(5000)  # warm-up: allocator pools, metrics labels
    before = fault.rss_kib(daemon.proc.pid)["RssAnon"]
    late_aborts(40_000)
    grown = fault.rss_kib(daemon.proc.pid)["RssAnon"] - before
    assert eng.lookup([it.key for it in items], lease=False)[0] == len(items)  # the entry is unharmed
    eng.close()
    assert grown < 1024, f"daemon memory grew {grown} KiB over 40000 late aborts"
