"""store_retrieve: daemon store / retrieve GB/s against memcpy and raw CMA on the same buffers.

Setup: a real ``hkvd serve`` subprocess per page size, its pool large enough that no store of
the run evicts (eviction is the index's cost, not the copy path's); in this process a synthetic
engine (one full-attention group, one layer, one block per chunk, so one entry = one page of
``page`` bytes) registered with it; a helper child (``bench.cma_helper``) that owns a pool of
the daemon's kind. For every (page size, batch size) and every repeat, interleaved so drift hits all of them alike:

- **store**: one Store descriptor of ``batch`` fresh chunks, submit to its StoreResult (the daemon reads the
  engine pages into its pool with process_vm_readv);
- **raw read**: the helper's bare process_vm_readv of the same engine pages into its pool, one
  syscall thread (the primitive); each repeat into the next unused stretch of its pool, as each
  daemon store lands in newly allocated pool pages (a helper per page size, its pool as large as
  that page size's reads, so no stretch is written twice; see ``bench.cma_helper``);
- **raw read, parallel**: the same, cut into the parts the daemon's host copy engine cuts a copy
  of that size into (8 MiB and up: half the usable CPUs, at most 4), one thread each; only where
  the daemon splits (more than 3 CPUs), else it is the raw read;
- **memcpy**: numpy copies, page by page, of the same engine pages into a pre-faulted pool-kind
  buffer in this process;
- and the same three the other way (retrieve / raw process_vm_writev / memcpy back), the raw
  write reading the stretch the last raw read filled, as each retrieve reads the last store's entries;
- **mapped**: the copy of an in-step load (``in_step_loads``, shim/pool_reads.py), in the same retrieve
  loop: the engine maps the daemon's pool read-only at start as a worker does (``PoolMaps.map``, its populator
  left to finish first, as it does long before an engine's first hit), a leased lookup with places (untimed: the
  scheduler side's, and every hit pays one) names where the last store's entries lie, and the worker's part is
  timed: ``copy_in_step`` from the map into the same engine pages a retrieve writes. **fresh map**: the same copy
  from a new map of the pool that nothing populated, so every first read of a page faults (what every load from
  a part of the pool not read before cost until maps were populated: 0.54-0.58 of memcpy at 64 x 2 MiB);
- **checksums**: after each store, untimed, the wait until the daemon has taken its entries'
  checksums, so that hashing, which the daemon runs after the StoreResult on a thread of its own, does not
  slow the references that follow (measured before the wait: 64 x 2 MiB stores at 1.09-1.30 of the
  raw read that followed them, the daemon's hashing slowing the raw read);
- **ping**: the engine's descriptor round trip with no work (median of 50), which every store and
  retrieve pays on top of its copy: ``+us`` minus ``ping us`` is what the daemon adds beyond it.

Reported: medians of the repeats as GB/s, and the ratios daemon / raw, daemon / raw parallel and
daemon / memcpy, mapped / memcpy (with the range of the repeats' own ratios: each mapped copy against the
memcpy of its repeat; target >= 0.9 at 64 x 2 MiB), fresh map / memcpy, and raw / memcpy
(``raw_*_vs_memcpy``: what the kernel's cross-memory copy itself reaches, the ceiling of daemon / memcpy);
and the ratio of the best repeats (``*_best``: fastest store against fastest raw read), which leaves out
what other tenants of a shared machine cost either side (on a 2-core VM the same copy ranges 15-90 ms
within a minute). Target: >= 0.9 of the raw primitive at
pages >= 2 MiB; the summary gives it against both raw references, by medians and by best repeats.

The two directions of the kernel copy differ. On the 2-vCPU development VM (Linux 6.18, 2026-12-02,
other work sharing the machine), copying 64 x 2 MiB in one process between a 4 KiB-page shm pool and
a THP-backed buffer, process_vm_readv ran at 0.91-0.96 of numpy memcpy and process_vm_writev at
0.57-0.71 (perf: the time is the kernel's ``_copy_from_iter``, the user-to-kernel copy a write takes,
against ``_copy_to_iter`` for a read); into a buffer of 4 KiB pages both ran at 0.41-0.51. The host
copy engine's own path adds nothing measurable to the syscall (0.95-1.04 of it), so a retrieve, which
writes the engine's memory, stays near ``raw_write_vs_memcpy`` whatever the daemon does around it.
``engine_thp`` records what backs the engine's buffer, which sets that ceiling.

Those figures were taken with the engine's buffer 16 bytes past 64-byte alignment (numpy's allocation), where the
kernel's ``rep movsb`` into it is slow. The synthetic engine now aligns it to 64 bytes, as torch aligns a vLLM
engine's KV caches; measured in one daemon, alternating the two (32 x 2 MiB, 3 rows each, 2026-12-03, busy: load
7-17), the raw process_vm_writev ran at 1.31 of memcpy aligned against 0.75 misaligned, and the retrieve at 1.07
(0.97-1.40) against 0.57 (0.47-0.94).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench.common import Daemon, MiB, gbps, human_bytes, median, readline_timeout, stop_process
from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.engines.host_engine import default_split_parts
from hkvd.shim.pool_reads import PoolMap, PoolMaps, copy_in_step
from hkvd.shim.ptrace import PR_SET_PTRACER, PR_SET_PTRACER_ANY, _libc
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine
from hkvd.transport.copy_engine import Region
from hkvd.transport.wire.kv import Item, LookupReply

FULL = {"pages": [64 << 10, 256 << 10, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB], "batches": [1, 8, 64],
        "cap": 256 * MiB, "repeats": 9}
QUICK = {"pages": [64 << 10, 1 * MiB, 2 * MiB, 8 * MiB], "batches": [1, 8, 32], "cap": 64 * MiB, "repeats": 7}
TARGET = 0.9
MIN_POOL_BYTES = 64 * MiB  # the smallest helper or scratch pool (32 superblocks of 2 MiB)
TIMEOUT_S = 60.0


class Helper:
    def __init__(self, pool_bytes: int, hugepages: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.cma_helper"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._send({"pid": os.getpid(), "pool_bytes": pool_bytes, "hugepages": hugepages})
        self.info = json.loads(readline_timeout(self.proc, TIMEOUT_S, "cma helper start"))

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def run(self, op: str, pages: list[tuple[int, int]], repeats: int = 1) -> list[float]:
        self._send({"op": op, "pages": pages, "repeats": repeats})
        reply = json.loads(readline_timeout(self.proc, TIMEOUT_S, f"cma helper {op}"))
        if "error" in reply:
            raise RuntimeError(f"cma helper: {reply['error']}")
        return reply["times"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)


def _allow_any_ptracer() -> None:
    """Under Yama, let both the daemon and the helper (a child: not our ancestor) read us."""
    _libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)  # EINVAL without Yama: nothing to do


def _thp_fraction(addr: int, nbytes: int, smaps: str = "/proc/self/smaps") -> float:
    """The share of the resident bytes of the mappings over ``[addr, addr + nbytes)`` that transparent
    huge pages back (a large numpy buffer spans several: its first page is a mapping of its own)."""
    rss = huge = 0
    inside = False
    with open(smaps) as f:
        for line in f:
            key, sep, rest = line.partition(":")
            if not sep or " " in key:  # a mapping's header: "start-end perms offset dev inode path"
                start, _, end = line.split(" ", 1)[0].partition("-")
                inside = int(start, 16) < addr + nbytes and addr < int(end, 16)
            elif inside and key == "Rss":
                rss += int(rest.split()[0]) * 1024
            elif inside and key == "AnonHugePages":
                huge += int(rest.split()[0]) * 1024
    return huge / rss if rss else 0.0


def _await_checksums(eng: SyntheticEngine, want: int, poll_s: float = 0.002) -> int:
    """Wait until the daemon has taken ``want`` entry checksums in all (at once for 0); the count then.

    The daemon hashes a store's entries on a thread of its own after the store's reply: on a 2-CPU
    machine that work lands on whatever runs next. Waiting for it after each store keeps it out of the
    raw and memcpy references (a status round trip takes ~5 ms here, too coarse to time the hashing)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        got = int(eng.client.status().get("integrity", {}).get("checksums_taken", 0))
        if got >= want or not want:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon took {got} entry checksums of {want} within {TIMEOUT_S:g} s")
        time.sleep(poll_s)


def _fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def run(quick: bool, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    pages_list: list[int] = cfg["pages"]
    batches: list[int] = cfg["batches"]
    cap: int = cfg["cap"]
    repeats: int = cfg["repeats"]
    max_bytes = max(p * b for p in pages_list for b in batches if p * b <= cap)
    rows: list[dict[str, Any]] = []
    helper_parts = default_split_parts()  # the daemon's split; the helper child reports its own
    pools: dict[int, float] = {}
    _allow_any_ptracer()
    scratch_pool = HugePagePool(max(max_bytes, MIN_POOL_BYTES), hugepages)  # type: ignore[arg-type]
    try:
        scratch_pool.prefault()
        scratch = np.frombuffer(scratch_pool.buffer, dtype=np.int8)
        for page in pages_list:
            fits = [b for b in batches if page * b <= cap]
            if not fits:
                continue
            # A daemon per page size, its pool holding every entry this page size stores (a warm-up
            # and ``repeats`` fresh stores per batch): no store here pays for an eviction, and every
            # store lands in pages not written since the pre-fault. The helper's pool holds as many
            # raw reads, so its reads land in such pages too (see bench.cma_helper).
            stored = sum(fits) * page * (repeats + 1)
            pool_gb = pools[page] = round((stored * 1.1 + 64 * MiB) / (1 << 30), 3)
            helper = Helper(max(stored * (2 if helper_parts > 1 else 1) + page, MIN_POOL_BYTES), hugepages)
            try:
                helper_parts = int(helper.info.get("parts", helper_parts))
                with Daemon("--chunk-size", "16", pool_gb=pool_gb, hugepages=hugepages) as daemon:
                    if not rows:
                        kind = daemon.status().get("pool", {})
                        log(f"  daemon pool {kind.get('kind', '?') if isinstance(kind, dict) else '?'}, helper "
                            f"pool {helper.info.get('kind')}, scratch pool {scratch_pool.kind}, copy parts "
                            f"{helper_parts} (daemon's default split for copies >= 8 MiB)")
                    rows += _run_page(daemon.socket_path, helper, scratch, page, fits, repeats, log,
                                      par=helper_parts > 1)
            finally:
                helper.close()
            _allow_any_ptracer()
    finally:
        del scratch
        scratch_pool.close()
    big = [r for r in rows if r["page_bytes"] >= 2 * MiB]
    summary = {
        "min_store_vs_raw_ge_2MiB": min((r["store_vs_raw"] for r in big), default=float("nan")),
        "min_retrieve_vs_raw_ge_2MiB": min((r["retrieve_vs_raw"] for r in big), default=float("nan")),
        "rows_meeting_target_ge_2MiB": sum(r["store_vs_raw"] >= TARGET and r["retrieve_vs_raw"] >= TARGET
                                           for r in big),
        "min_store_vs_raw_par_ge_2MiB": min((r["store_vs_raw_par"] for r in big), default=float("nan")),
        "min_retrieve_vs_raw_par_ge_2MiB": min((r["retrieve_vs_raw_par"] for r in big), default=float("nan")),
        "rows_meeting_target_vs_raw_par_ge_2MiB": sum(
            r["store_vs_raw_par"] >= TARGET and r["retrieve_vs_raw_par"] >= TARGET for r in big),
        "rows_meeting_target_best_ge_2MiB": sum(r["store_vs_raw_best"] >= TARGET
                                                and r["retrieve_vs_raw_best"] >= TARGET for r in big),
        "rows_ge_2MiB": len(big),
        # In-step loads' copy against memcpy (the issue's target: >= 0.9 at 64 x 2 MiB; the largest 2 MiB batch
        # a run has, 32 in quick mode).
        "min_mapped_vs_memcpy_ge_2MiB": min((r["mapped_vs_memcpy"] for r in big), default=float("nan")),
        "rows_mapped_meeting_target_ge_2MiB": sum(r["mapped_vs_memcpy"] >= TARGET for r in big),
        "mapped_vs_memcpy_2MiB_largest": _largest(rows, 2 * MiB, "mapped_vs_memcpy"),
        "mapped_vs_memcpy_2MiB_largest_range": [_largest(rows, 2 * MiB, "mapped_vs_memcpy_lo"),
                                                _largest(rows, 2 * MiB, "mapped_vs_memcpy_hi")],
        "mapped_fresh_vs_memcpy_2MiB_largest": _largest(rows, 2 * MiB, "mapped_fresh_vs_memcpy"),
        "retrieve_vs_memcpy_2MiB_largest": _largest(rows, 2 * MiB, "retrieve_vs_memcpy"),
        "target": TARGET,
        "split_parts": helper_parts,
    }
    log(f"  2 MiB pages, largest batch: mapped copy {summary['mapped_vs_memcpy_2MiB_largest']:.2f} of memcpy "
        f"(repeats {summary['mapped_vs_memcpy_2MiB_largest_range'][0]:.2f}-"
        f"{summary['mapped_vs_memcpy_2MiB_largest_range'][1]:.2f}; fresh map "
        f"{summary['mapped_fresh_vs_memcpy_2MiB_largest']:.2f}), retrieve "
        f"{summary['retrieve_vs_memcpy_2MiB_largest']:.2f}; target {TARGET}")
    log(f"  >= 2 MiB pages: {summary['rows_meeting_target_ge_2MiB']}/{len(big)} rows at >= {TARGET} of raw "
        f"(1 thread) both ways, {summary['rows_meeting_target_vs_raw_par_ge_2MiB']}/{len(big)} against raw in "
        f"{helper_parts} parallel parts; {summary['rows_meeting_target_best_ge_2MiB']}/{len(big)} by best repeats")
    return {"config": {**cfg, "hugepages": hugepages, "pool_gb_by_page": pools}, "rows": rows, "summary": summary}


def _largest(rows: list[dict[str, Any]], page: int, key: str) -> float:
    """``key`` of the row of ``page``-byte pages with the largest batch (nan when absent)."""
    at = [r for r in rows if r["page_bytes"] == page]
    return max(at, key=lambda r: r["batch"]).get(key, float("nan")) if at else float("nan")


def _run_page(socket_path: str, helper: Helper, scratch: np.ndarray, page: int, batches: list[int],
              repeats: int, log: Any, *, par: bool = False) -> list[dict[str, Any]]:
    """Rows for one page size; ``par``: also time the raw copies in the daemon's split parts."""
    nb = max(batches) + 1  # block 0 is the null block
    maps = PoolMaps()  # the engine maps the daemon's pool as a worker with in-step loads does
    eng = SyntheticEngine(socket_path, [GroupShape("full", 1, page)], num_blocks=nb, tokens_per_block=16,
                          chunk_size=16, model=f"bench-{page}", timeout_s=TIMEOUT_S, pool_maps=maps)
    _allow_any_ptracer()  # the engine's constructor narrowed the ptracer to the daemon
    rows = []
    pool = maps.get(eng.client.server_id) if eng.ack.in_step else None
    populated = float("nan")
    if pool is None:
        log("  the daemon's pool is not mapped here (not offered, or not mappable): no mapped-copy column")
    elif pool.populator is not None:
        pool.populator.wait(TIMEOUT_S)  # an engine maps at start, long before its first hit
        populated = pool.populator.populated_bytes / pool.size
    groups = {g.group_id: g for g in eng.groups}
    regions = {0: Region(0, "host", eng.buffer.nbytes, addr=int(eng.buffer.ctypes.data))}
    try:
        eng.buffer[:] = np.resize(np.random.default_rng(page).integers(-128, 128, 1 << 20, dtype=np.int8),
                                  eng.buffer.size)
        engine_thp = _thp_fraction(int(eng.buffer.ctypes.data), eng.buffer.nbytes)
        for batch in batches:
            blocks = list(range(1, batch + 1))
            nbytes = batch * page
            pages = [(int(eng.page(0, 0, b).ctypes.data), page) for b in blocks]
            src = [eng.page(0, 0, b) for b in blocks]
            dst = [scratch[i * page:(i + 1) * page] for i in range(batch)]

            def items(keys: list[bytes], blocks: list[int] = blocks) -> list[Item]:
                return [Item(0, i, k, [b]) for i, (k, b) in enumerate(zip(keys, blocks, strict=True))]

            def memcpy_to(src: list[np.ndarray] = src, dst: list[np.ndarray] = dst) -> float:
                t0 = time.perf_counter()
                for s, d in zip(src, dst, strict=True):
                    np.copyto(d, s)
                return time.perf_counter() - t0

            def memcpy_from(src: list[np.ndarray] = src, dst: list[np.ndarray] = dst) -> float:
                t0 = time.perf_counter()
                for s, d in zip(src, dst, strict=True):
                    np.copyto(s, d)
                return time.perf_counter() - t0

            def timed(fn: Any, *args: Any) -> float:
                t0 = time.perf_counter()
                fn(*args)
                return time.perf_counter() - t0

            def mapped(stored: list[Item], pool: PoolMap, fresh: bool = False, nbytes: int = nbytes) -> float:
                """An in-step load's copy of ``stored``: a leased lookup with places (untimed: the scheduler side's),
                then the worker's part, timed: the places by entry and ``copy_in_step`` from the pool map. ``fresh``:
                from a new map of the same pool that nothing populated (every first read of a page faults)."""
                reply = eng.run(eng.client.submit_lookup([it.key for it in stored], lease=True, places=True))
                found = reply.get(LookupReply)
                if found.hit_chunks != len(stored) or not found.places:
                    raise RuntimeError(f"a leased lookup of {len(stored)} stored chunks hit {found.hit_chunks} with "
                                       f"{'' if found.places else 'no '}places")
                cold = PoolMaps(populate=False) if fresh else None
                try:
                    src = pool
                    if cold is not None:
                        cold.map(int(eng.client.daemon_pid), eng.client.server_id, eng.client.pool)
                        src = cold.get(eng.client.server_id) or pool
                    t0 = time.perf_counter()
                    places = {(int(g), int(c)): ext for g, c, ext in found.places[0]}
                    moved = copy_in_step(src, stored, places, groups, regions)
                    dt = time.perf_counter() - t0
                finally:
                    eng.client.release(found.lease_id)
                    if cold is not None:
                        cold.close()
                if moved != nbytes:
                    raise RuntimeError(f"the mapped copy moved {moved} bytes, expected {nbytes}")
                return dt

            # Warm up every path once (first-touch, code paths, the daemon's thread pool).
            stored = items(_fresh_keys(batch))
            eng.store(stored)
            helper.run("read", pages)
            if par:
                helper.run("read_par", pages)
            memcpy_to()
            expect = eng.buffer[page:(batch + 1) * page].copy()
            eng.buffer[page:(batch + 1) * page] = 0
            done = eng.retrieve(stored)
            if not np.array_equal(eng.buffer[page:(batch + 1) * page], expect):
                raise RuntimeError(f"retrieve of {batch} x {human_bytes(page)} pages was not byte-exact")
            if done.result.nbytes != nbytes:
                raise RuntimeError(f"retrieve moved {done.result.nbytes} bytes, expected {nbytes}")
            if pool is not None:
                eng.buffer[page:(batch + 1) * page] = 0
                mapped(stored, pool)
                if not np.array_equal(eng.buffer[page:(batch + 1) * page], expect):
                    raise RuntimeError(f"mapped copy of {batch} x {human_bytes(page)} pages was not byte-exact")
            helper.run("write", pages)
            if par:
                helper.run("write_par", pages)
            memcpy_from()
            del expect
            ping_s = median([eng.client.ping() for _ in range(50)])

            t: dict[str, list[float]] = {k: [] for k in ("store", "raw_read", "raw_read_par", "memcpy_to",
                                                         "retrieve", "raw_write", "raw_write_par", "memcpy_from",
                                                         "mapped", "mapped_fresh")}
            taken = _await_checksums(eng, 0)
            for _ in range(repeats):  # interleaved, so noise lands on all paths alike
                fresh = items(_fresh_keys(batch))
                t["store"].append(timed(eng.store, fresh))
                taken = _await_checksums(eng, taken + batch)
                stored = fresh
                t["raw_read"] += helper.run("read", pages)
                if par:
                    t["raw_read_par"] += helper.run("read_par", pages)
                t["memcpy_to"].append(memcpy_to())
            for _ in range(repeats):
                t["retrieve"].append(timed(eng.retrieve, stored))
                t["raw_write"] += helper.run("write", pages)
                if par:
                    t["raw_write_par"] += helper.run("write_par", pages)
                t["memcpy_from"].append(memcpy_from())
                if pool is not None:
                    t["mapped"].append(mapped(stored, pool))
                    t["mapped_fresh"].append(mapped(stored, pool, fresh=True))
            if pool is None:
                t["mapped"] = t["mapped_fresh"] = [float("nan")] * repeats
            if not par:  # the daemon does not split: its parallel reference is the raw copy itself
                t["raw_read_par"], t["raw_write_par"] = t["raw_read"], t["raw_write"]
            g = {k: gbps(nbytes, median(v)) for k, v in t.items()}
            row = {
                "page_bytes": page, "batch": batch, "request_bytes": nbytes, "repeats": repeats,
                "store_gbps": g["store"], "raw_read_gbps": g["raw_read"], "raw_read_par_gbps": g["raw_read_par"],
                "memcpy_to_gbps": g["memcpy_to"],
                "retrieve_gbps": g["retrieve"], "raw_write_gbps": g["raw_write"],
                "raw_write_par_gbps": g["raw_write_par"], "memcpy_from_gbps": g["memcpy_from"],
                "store_vs_raw": g["store"] / g["raw_read"], "store_vs_memcpy": g["store"] / g["memcpy_to"],
                "store_vs_raw_par": g["store"] / g["raw_read_par"],
                "retrieve_vs_raw": g["retrieve"] / g["raw_write"],
                "retrieve_vs_raw_par": g["retrieve"] / g["raw_write_par"],
                "retrieve_vs_memcpy": g["retrieve"] / g["memcpy_from"],
                # In-step loads' copy (the engine's own, from its map of the pool), against the same memcpy; the
                # range is that of the repeats' own ratios (each mapped copy against the memcpy of its repeat).
                "mapped_gbps": g["mapped"], "mapped_fresh_gbps": g["mapped_fresh"],
                "mapped_vs_memcpy": g["mapped"] / g["memcpy_from"],
                "mapped_vs_memcpy_lo": min(m / c for m, c in zip(t["memcpy_from"], t["mapped"], strict=True)),
                "mapped_vs_memcpy_hi": max(m / c for m, c in zip(t["memcpy_from"], t["mapped"], strict=True)),
                "mapped_fresh_vs_memcpy": g["mapped_fresh"] / g["memcpy_from"],
                "mapped_vs_retrieve": g["mapped"] / g["retrieve"],
                "mapped_populated": populated,  # the share of the pool the map's populator had mapped
                # The kernel copy's own ceiling under daemon / memcpy (module docstring).
                "raw_read_vs_memcpy": g["raw_read"] / g["memcpy_to"],
                "raw_write_vs_memcpy": g["raw_write"] / g["memcpy_from"],
                "engine_thp": engine_thp,
                # What one descriptor round trip adds to the kernel's copy, in microseconds.
                "store_overhead_us": (median(t["store"]) - median(t["raw_read"])) * 1e6,
                "retrieve_overhead_us": (median(t["retrieve"]) - median(t["raw_write"])) * 1e6,
                "ping_us": ping_s * 1e6,  # the descriptor round trip alone: part of both overheads
                "store_vs_raw_best": min(t["raw_read"]) / min(t["store"]),
                "retrieve_vs_raw_best": min(t["raw_write"]) / min(t["retrieve"]),
                "median_s": {k: median(v) for k, v in t.items()},
                "best_s": {k: min(v) for k, v in t.items()},
            }
            rows.append(row)
            log(f"  {human_bytes(page):>7} x {batch:<3} store {row['store_gbps']:5.2f} GB/s "
                f"({row['store_vs_raw']:.2f} raw, {row['store_vs_raw_par']:.2f} raw par, "
                f"{row['store_vs_memcpy']:.2f} memcpy, best {row['store_vs_raw_best']:.2f} raw)  "
                f"retrieve {row['retrieve_gbps']:5.2f} GB/s ({row['retrieve_vs_raw']:.2f} raw, "
                f"{row['retrieve_vs_raw_par']:.2f} raw par, {row['retrieve_vs_memcpy']:.2f} memcpy, "
                f"best {row['retrieve_vs_raw_best']:.2f} raw)  raw/memcpy {row['raw_read_vs_memcpy']:.2f} read, "
                f"{row['raw_write_vs_memcpy']:.2f} write (engine buffer {engine_thp:.0%} THP)  mapped "
                f"{row['mapped_gbps']:5.2f} GB/s ({row['mapped_vs_memcpy']:.2f} memcpy, "
                f"{row['mapped_vs_memcpy_lo']:.2f}-{row['mapped_vs_memcpy_hi']:.2f}; fresh map "
                f"{row['mapped_fresh_vs_memcpy']:.2f})")
    finally:
        eng.close()
        maps.close()
    return rows


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    par = result.get("summary", {}).get("split_parts", 1) > 1  # raw par == raw when the daemon does not split
    mapped = any("mapped_gbps" in r for r in result["rows"])  # results from before the mapped copy was measured
    nan = float("nan")
    headers = ["page", "batch", "store GB/s", "raw readv GB/s", "store/raw", *(["store/raw par"] * par),
               "store/raw best", "store/memcpy", "retrieve GB/s", "raw writev GB/s", "retrieve/raw",
               *(["retrieve/raw par"] * par), "retrieve/raw best", "retrieve/memcpy",
               *(["mapped GB/s", "mapped/memcpy", "mapped/memcpy range", "fresh map/memcpy"] * mapped),
               "store +us", "retrieve +us", "ping us"]
    rows = [[human_bytes(r["page_bytes"]), r["batch"], r["store_gbps"], r["raw_read_gbps"], r["store_vs_raw"],
             *([r["store_vs_raw_par"]] * par), r.get("store_vs_raw_best", nan), r["store_vs_memcpy"],
             r["retrieve_gbps"], r["raw_write_gbps"], r["retrieve_vs_raw"], *([r["retrieve_vs_raw_par"]] * par),
             r.get("retrieve_vs_raw_best", nan), r["retrieve_vs_memcpy"],
             *([r.get("mapped_gbps", nan), r.get("mapped_vs_memcpy", nan),
                f"{r.get('mapped_vs_memcpy_lo', nan):.2f}-{r.get('mapped_vs_memcpy_hi', nan):.2f}",
                r.get("mapped_fresh_vs_memcpy", nan)] if mapped else []), r["store_overhead_us"],
             r["retrieve_overhead_us"], r.get("ping_us", nan)]
            for r in result["rows"]]
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Any) -> list[str]:
    """GB/s against page size, ours and the references, at the largest batch each page size ran."""
    rows = result["rows"]
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["page_bytes"] not in best or r["request_bytes"] > best[r["page_bytes"]]["request_bytes"]:
            best[r["page_bytes"]] = r
    pts = [best[p] for p in sorted(best)]
    xs = [r["page_bytes"] / 1024 for r in pts]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (what, raw, mem) in zip(axes, (("store", "raw_read", "memcpy_to"),
                                           ("retrieve", "raw_write", "memcpy_from")), strict=True):
        ax.plot(xs, [r[f"{what}_gbps"] for r in pts], marker="o", lw=2, label=f"hkvd {what}")
        ax.plot(xs, [r[f"{raw}_gbps"] for r in pts], marker="s", ls="--", label=f"raw {raw.replace('raw_', '')}v")
        if result.get("summary", {}).get("split_parts", 1) > 1:
            ax.plot(xs, [r[f"{raw}_par_gbps"] for r in pts], marker="s", ls=":",
                    label=f"raw {raw.replace('raw_', '')}v, daemon's parts")
        ax.plot(xs, [r[f"{mem}_gbps"] for r in pts], marker="^", ls="-.", label="numpy memcpy")
        if what == "retrieve" and all("mapped_gbps" in r for r in pts):
            ax.plot(xs, [r["mapped_gbps"] for r in pts], marker="D", lw=2, label="engine's mapped copy (in-step)")
        for x, r in zip(xs, pts, strict=True):
            ax.annotate(f"x{r['batch']}", (x, r[f"{what}_gbps"]), textcoords="offset points", xytext=(0, 6),
                        fontsize=7, ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page KiB (label: pages per request)")
        ax.set_title(f"{what}: GB/s vs page size (same run, same buffers)")
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("GB/s")
    path = out_dir / "store_retrieve.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
