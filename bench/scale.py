"""scale: the daemon's Index at 10^4, 10^5 and 10^6 entries, and the pool's pre-fault rate.

Index: built in-process (``hkvd.daemon.cache.index.Index`` over a ``HugePagePool`` that is mapped but
never touched, so the 4 KiB-entry pool costs address space only), through the daemon's own write
path (``begin_write`` -> ``finish_write``, LRU policy). At each size: Python heap bytes per entry
(tracemalloc, everything the index, the policy and the allocator hold), and the time of a lookup
probe (``is_ready``, the call the hit planner makes per chunk) for existing and missing keys.
The reference for lookups is a plain ``dict`` membership test on the same keys in the same run:
the ratio stays flat if the index adds O(1) work per probe.

Collector pauses: the same build to 10^6 entries twice, once with CPython's collector as it is and
once under the daemon's heap policy (``hkvd.daemon.heap``: freeze after start-up and every 10 000
entries written); for each, during the build, the longest pause of the cyclic collector (the event
loop stands still that long), the number of full collections and their total time.

Pre-fault: ``HugePagePool.prefault`` GB/s against memset (numpy fill) GB/s on the same pool once
faulted, in the same run.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
from typing import Any

import numpy as np

from bench.common import GiB, MiB, median
from hkvd.daemon.cache.eviction import LRUPolicy
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.pool import PAGE, HugePagePool
from hkvd.daemon.heap import DEFAULT_FREEZE_EVERY, HeapPolicy
from hkvd.daemon.metrics import Metrics

SIZES = (10_000, 100_000, 1_000_000)
ENTRY = PAGE  # the smallest slot: one 4 KiB page per entry
PROBES = 20_000


def _probe(fn: Any, keys: list[Any], repeats: int = 5) -> float:
    """Median ns per call of ``fn(key)`` over ``keys``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for k in keys:
            fn(k)
        times.append((time.perf_counter_ns() - t0) / len(keys))
    return median(times)


def _fill(index: Index, fp: bytes, chunk_keys: list[bytes], start: int, stop: int) -> None:
    for i in range(start, stop):  # the daemon's store path, minus the copy
        e = index.begin_write((fp, 0, chunk_keys[i]), ENTRY, "full", i)
        assert e is not None
        index.finish_write(e, pending=False)


def _heap_per_entry(pool: HugePagePool, fp: bytes, chunk_keys: list[bytes], sizes: list[int]) -> dict[int, float]:
    """Traced heap bytes per entry of an index grown to each of ``sizes`` (a throwaway index)."""
    out: dict[int, float] = {}
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = Index(pool, LRUPolicy())
        n = 0
        for size in sizes:
            _fill(index, fp, chunk_keys, n, size)
            n = size
            out[n] = (tracemalloc.get_traced_memory()[0] - base) / n
    finally:
        tracemalloc.stop()
    for key in list(index._entries):  # give the pool back for the untraced build
        e = index.get(key)
        assert e is not None
        index.drop(e)
    del index
    gc.collect()
    return out


def index_growth(sizes: tuple[int, ...] = SIZES, log: Any = print, trace_upto: int = 0) -> list[dict[str, Any]]:
    """``trace_upto``: measure heap bytes up to this many entries only (tracemalloc doubles the build
    time); 0 = all sizes. Past it, bytes per entry is reported as NaN."""
    top = max(sizes)
    pool = HugePagePool(top * ENTRY + 64 * MiB, "off")  # mapped, never faulted: no RAM used
    fp = os.urandom(16)
    rows = []
    try:
        # Keys are made up front so their own bytes (the engine's hashes) don't count; the index's
        # key tuple, entry, allocation, LRU node and dict slots do.
        chunk_keys = [os.urandom(16) for _ in range(top)]
        heap = _heap_per_entry(pool, fp, chunk_keys, [s for s in sizes if not trace_upto or s <= trace_upto])
        index = Index(pool, LRUPolicy())  # untraced build: tracemalloc would skew the probes
        n = 0
        rng = np.random.default_rng(0)
        t_build = time.perf_counter()
        for size in sizes:
            _fill(index, fp, chunk_keys, n, size)
            n = size
            pick = rng.integers(0, n, PROBES)
            hits = [(fp, 0, chunk_keys[int(j)]) for j in pick]
            misses = [(fp, 0, os.urandom(16)) for _ in range(PROBES)]
            plain = dict.fromkeys(hits)  # reference: a dict of the same keys
            hit_ns = _probe(index.is_ready, hits)
            miss_ns = _probe(index.is_ready, misses)
            ref_ns = _probe(plain.__contains__, hits)
            del plain, hits, misses
            row = {"entries": n, "bytes_per_entry": heap.get(n, float("nan")), "lookup_hit_ns": hit_ns,
                   "lookup_miss_ns": miss_ns, "dict_ref_ns": ref_ns, "hit_vs_dict": hit_ns / ref_ns,
                   "build_s": time.perf_counter() - t_build}
            rows.append(row)
            log(f"  index {n:>9,} entries: {row['bytes_per_entry']:.0f} B/entry (heap), lookup hit {hit_ns:.0f} ns, "
                f"miss {miss_ns:.0f} ns ({row['hit_vs_dict']:.1f}x a dict probe)")
        del index
    finally:
        gc.collect()
        pool.close()
    return rows


def gc_pauses(top: int, log: Any = print) -> list[dict[str, Any]]:
    """Grow an index to ``top`` entries with CPython's collector as it is, then under the daemon's
    heap policy (its housekeeping tick stood in for by a check every 1 000 writes)."""
    fp = os.urandom(16)
    chunk_keys = [os.urandom(16) for _ in range(top)]
    rows = []
    for mode, every in (("python", 0), ("hkvd", DEFAULT_FREEZE_EVERY)):
        pool = HugePagePool(top * ENTRY + 64 * MiB, "off")  # mapped, never faulted
        metrics = Metrics()
        heap = HeapPolicy(every, metrics)
        gc.collect()
        heap.install()
        try:
            index = Index(pool, LRUPolicy())
            heap.start(index.writes)
            # The start-up collection is the daemon's, once, before it serves: only the build counts.
            heap.max_pause_s = 0.0
            metrics = heap.metrics = Metrics()
            t0 = time.perf_counter()
            for start in range(0, top, 1000):
                _fill(index, fp, chunk_keys, start, min(start + 1000, top))
                heap.maybe_freeze(index.writes)
            build = time.perf_counter() - t0
        finally:
            heap.uninstall()  # also unfreezes
        row = {"mode": mode, "entries": top, "freeze_every": every, "longest_pause_ms": heap.max_pause_s * 1e3,
               "full_collections": int(metrics.get("gc_collections", generation="2")),
               "full_collection_s": metrics.get("gc_pause_seconds", generation="2"),
               "gc_s": metrics.total("gc_pause_seconds"), "build_s": build, "freezes": heap.freezes}
        rows.append(row)
        how = f"freeze every {every} writes" if every else "as CPython ships"
        log(f"  collector, {mode:6} ({how}): longest "
            f"pause {row['longest_pause_ms']:.1f} ms, {row['full_collections']} full collections "
            f"({row['full_collection_s']:.2f} s), all collections {row['gc_s']:.2f} s of a {build:.1f} s build")
        del index
        gc.collect()
        pool.close()
    return rows


def prefault(size: int, hugepages: str, log: Any = print) -> dict[str, Any]:
    pool = HugePagePool(size, hugepages)  # type: ignore[arg-type]
    try:
        pf = pool.prefault()
        buf = np.frombuffer(pool.buffer, dtype=np.uint8)
        times = []
        for v in range(3):
            t0 = time.perf_counter()
            buf.fill(v)
            times.append(time.perf_counter() - t0)
        del buf
        memset = pool.size / median(times) / 1e9
        res = {"pool_bytes": pool.size, "kind": pool.kind, "prefault_gbps": pf, "memset_gbps": memset,
               "prefault_vs_memset": pf / memset}
    finally:
        pool.close()
    log(f"  pool pre-fault ({res['kind']}, {size / GiB:.2f} GiB): {pf:.2f} GB/s, memset on it {memset:.2f} GB/s "
        f"({res['prefault_vs_memset']:.2f}x)")
    return res


def run(quick: bool, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    rows = index_growth(SIZES, log, trace_upto=100_000 if quick else 0)
    flat = rows[-1]["lookup_hit_ns"] / rows[0]["lookup_hit_ns"]
    pauses = gc_pauses(max(SIZES), log)
    by = {r["mode"]: r for r in pauses}
    pf = prefault((512 * MiB) if quick else (4 * GiB), hugepages, log)
    return {"index": rows, "lookup_growth_1e6_vs_1e4": flat, "gc": pauses,
            "gc_longest_pause_hkvd_vs_python": by["hkvd"]["longest_pause_ms"] / by["python"]["longest_pause_ms"],
            "prefault": pf}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["entries", "B/entry", "lookup hit ns", "lookup miss ns", "dict probe ns", "hit / dict"]
    rows = [[f"{r['entries']:,}", r["bytes_per_entry"], r["lookup_hit_ns"], r["lookup_miss_ns"], r["dict_ref_ns"],
             r["hit_vs_dict"]] for r in result["index"]]
    for g in result.get("gc", []):
        rows.append([f"collector: {g['mode']}", "-", f"longest pause {g['longest_pause_ms']:.1f} ms",
                     f"{g['full_collections']} full", f"all {g['gc_s']:.2f} s / build {g['build_s']:.1f} s", "-"])
    p = result["prefault"]
    rows.append([f"pre-fault {p['pool_bytes'] >> 20} MiB {p['kind']}", "-", f"{p['prefault_gbps']:.2f} GB/s",
                 "-", f"memset {p['memset_gbps']:.2f} GB/s", p["prefault_vs_memset"]])
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Any) -> list[str]:
    rows = result["index"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["entries"] for r in rows]
    axes[0].plot(xs, [r["lookup_hit_ns"] for r in rows], marker="o", label="index hit")
    axes[0].plot(xs, [r["lookup_miss_ns"] for r in rows], marker="o", label="index miss")
    axes[0].plot(xs, [r["dict_ref_ns"] for r in rows], marker="o", label="dict probe (ref)")
    axes[0].set_ylabel("ns per lookup probe")
    axes[1].plot(xs, [r["bytes_per_entry"] for r in rows], marker="o")
    axes[1].set_ylabel("heap bytes per entry")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("entries")
        ax.set_ylim(bottom=0)
    axes[0].legend()
    path = out_dir / "scale.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
