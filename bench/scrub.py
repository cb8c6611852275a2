"""The scrubber's cost: ``python -m bench.scrub [--rate-mb N] [--seconds S] [--pool-mib M] [--entry-kib K]``.

Fills an in-process pool (``HugePagePool``, the daemon's own index and ``Checksums``) with entries of
random bytes, lets their checksums be taken, then runs the scrubber (``daemon/integrity/scrub.py``) at
the rate given (default: the daemon's ``--scrub-rate-mb`` default) for a while, and prints what it
re-hashed and the CPU time its thread used: the share of one core it cost. A pool smaller than five
seconds of the rate is re-scanned only every five seconds, so the cost at the full rate is given too
(CPU per byte times the rate). One core's XXH3 speed over the same pool bounds the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from hkvd.daemon.cache import Cache, Entry, HugePagePool, make_policy
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.integrity.checksums import Checksums, checksum
from hkvd.daemon.integrity.scrub import Scrubber

FP = b"b" * 16


def _fill(cache: Cache, entry_bytes: int) -> list[Entry]:
    """As many READY entries of random bytes as the pool holds."""
    out: list[Entry] = []
    noise = os.urandom(1 << 20)
    i = 0
    while True:
        (got,) = cache.begin_store([((FP, 0, i.to_bytes(16, "little")), entry_bytes, "full", b"")], job_id=1)
        if not isinstance(got, Entry):
            return out
        for off, length in got.alloc.extents:
            for at in range(0, length, len(noise)):
                n = min(len(noise), length - at)
                cache.pool.buffer[off + at:off + at + n] = noise[:n]
        cache.complete_store([got], pending=False)
        out.append(got)
        i += 1
        if len(out) * entry_bytes >= cache.pool.size * 7 // 8:
            return out


async def run(rate_mb: int, seconds: float, pool_mib: int, entry_kib: int) -> dict[str, float]:
    pool = HugePagePool(pool_mib << 20, "auto")
    try:
        cache = Cache(pool, make_policy("lru"))
        checks = Checksums(cache, pool.buffer)
        checks.start(asyncio.get_running_loop())
        entries = _fill(cache, entry_kib << 10)
        deadline = time.monotonic() + 60
        while checks.taken < len(entries) and time.monotonic() < deadline:  # noqa: ASYNC110 (a worker's count)
            await asyncio.sleep(0.01)
        held = sum(e.nbytes for e in entries)
        t0 = time.perf_counter()
        for e in entries:
            checksum(pool.buffer, e.alloc.extents)
        core_gbps = held / (time.perf_counter() - t0) / 1e9

        scrub = Scrubber(cache, checks, rate_mb)
        scrub.start(asyncio.get_running_loop())
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        wall = time.perf_counter() - t0
        stats = scrub.statistics()
        scrub.stop(5)
        checks.stop(5)
        return {"rate_mb": rate_mb, "pool_mib": pool_mib, "entry_kib": entry_kib, "entries": len(entries),
                "seconds": round(wall, 2), "scrubbed_mb_s": round(stats.scrub_bytes / wall / 1e6, 1),
                "passes": stats.scrub_passes, "cpu_s": stats.scrub_cpu_s,
                "cpu_share_of_one_core": round(stats.scrub_cpu_s / wall, 4),
                # A pool that keeps it busy (one pass per MIN_PASS_S or longer) hashes at the full rate:
                "cpu_share_at_full_rate": round(stats.scrub_cpu_s / max(stats.scrub_bytes, 1) * rate_mb * 1e6, 4),
                "xxh3_one_core_gbps": round(core_gbps, 2),
                "mismatches": sum(stats.mismatches.values())}
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scrub", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mb", type=int, default=DaemonConfig().scrub_rate_mb, help="the scrub rate (MB/s)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the scrubber runs")
    ap.add_argument("--pool-mib", type=int, default=1024, help="pool size")
    ap.add_argument("--entry-kib", type=int, default=1024, help="entry size")
    args = ap.parse_args(argv)
    if args.rate_mb <= 0:
        ap.error("--rate-mb must be > 0 (0 is the scrubber off: it costs nothing)")
    r = asyncio.run(run(args.rate_mb, args.seconds, args.pool_mib, args.entry_kib))
    print("| " + " | ".join(r) + " |")
    print("|" + "---|" * len(r))
    print("| " + " | ".join(str(v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
