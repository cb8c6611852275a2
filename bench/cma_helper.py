"""Raw process_vm_readv / process_vm_writev reference, run as a child of the bench process.

The child maps a pool of the same kind as the daemon's (``HugePagePool``, pre-faulted) and moves
the bench process's engine pages with the bare syscall: one iovec per page, IOV_MAX per call,
iovecs built before the clock starts, nothing else timed. The daemon does the same copy behind a
descriptor, so the ratio daemon / raw is what the daemon costs on top of the kernel's copy.

Pool side, like the daemon: every read (the store's direction) moves into the next unused
stretch of the pool (a cursor that wraps only if the pool is too small), as each store of fresh
keys lands in pool pages nothing has written since the pre-fault; the bench sizes the pool so it
never wraps. Writing into pages written moments ago is 4-8% faster on a 2-core VM than into
such pages (measured with 16-128 MiB copies), so a reference that recycled a small pool would be
measuring a different copy. Every write (the retrieve's direction) reads the stretch the last
read filled, as the daemon's retrieves read the entries its last store wrote.

``read_par``/``write_par`` are the same copy cut by bytes into the parts the daemon's host copy
engine uses for that size (``hkvd.daemon.engines.host_engine.split_count``/``split_rows``: one part below 8 MiB),
moved by that many threads at once (the calling one and a pool's): the reference for the
daemon's split copies.

Protocol: JSON lines. First line ``{"pid", "pool_bytes", "hugepages"}``, answered by
``{"ready": true, "prefault_gbps", "kind", "parts"}``; then ``{"op": "read"|"write"|"read_par"|
"write_par", "pages": [[addr, len], ...], "repeats": n}`` answered by ``{"times": [s, ...]}``;
EOF ends it.
"""

from __future__ import annotations

import array
import ctypes
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.engines.host_engine import (
    IOV_MAX,
    SPLIT_MIN_BYTES,
    _Iovec,
    _libc,
    default_split_parts,
    split_count,
    split_rows,
)


class _Cursor:
    """Where in the pool the next copy goes (see the module docstring)."""

    def __init__(self, pool: HugePagePool) -> None:
        self.pool = pool
        self.off = 0
        self.last = (pool.base_addr, 0)  # (base, bytes) of the last read

    def take(self, nbytes: int) -> int:
        """A read: the next unused stretch of ``nbytes``, wrapping at the end."""
        if self.off + nbytes > self.pool.size:
            self.off = 0
        base = self.pool.base_addr + self.off
        self.off += nbytes
        self.last = (base, nbytes)
        return base

    def written(self, nbytes: int) -> int:
        """A write: the stretch the last read filled (a fresh one if that read was smaller)."""
        base, n = self.last
        return base if n >= nbytes else self.take(nbytes)


def _parallel_calls(base: int, pages: list[tuple[int, int]], parts: int) -> list[tuple]:
    """One (local, remote, count, total) call per part, the pool side from ``base``; parts as the daemon cuts them."""
    local: list[int] = []
    remote: list[int] = []
    off = 0
    for addr, n in pages:
        local += (base + off, n)
        remote += (addr, n)
        off += n
    out = []
    parts = split_count(off, parts, SPLIT_MIN_BYTES)
    for lo, re in split_rows(local, remote, parts):
        count = len(lo) // 2
        assert count <= IOV_MAX
        out.append(((_Iovec * count).from_buffer(array.array("Q", lo)),
                    (_Iovec * count).from_buffer(array.array("Q", re)), count, sum(lo[1::2])))
    return out


def _calls(base: int, pages: list[tuple[int, int]]) -> list[tuple]:
    """(local, remote, count, total) per IOV_MAX pages, the pool side from ``base``."""
    calls = []
    local_off = 0
    for i in range(0, len(pages), IOV_MAX):
        batch = pages[i:i + IOV_MAX]
        local = (_Iovec * len(batch))()
        remote = (_Iovec * len(batch))()
        for j, (addr, n) in enumerate(batch):
            local[j].iov_base, local[j].iov_len = base + local_off, n
            remote[j].iov_base, remote[j].iov_len = addr, n
            local_off += n
        calls.append((local, remote, len(batch), sum(n for _, n in batch)))
    return calls


def main() -> int:
    init = json.loads(sys.stdin.readline())
    pid = int(init["pid"])
    pool = HugePagePool(int(init["pool_bytes"]), init.get("hugepages", "auto"))
    rate = pool.prefault()
    parts = default_split_parts()
    threads = ThreadPoolExecutor(max_workers=max(1, parts - 1))
    cursor = _Cursor(pool)
    print(json.dumps({"ready": True, "prefault_gbps": rate, "kind": pool.kind, "parts": parts}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pages = [(int(a), int(n)) for a, n in req["pages"]]
        syscall = _libc.process_vm_readv if req["op"].startswith("read") else _libc.process_vm_writev
        nbytes = sum(n for _, n in pages)
        if nbytes > pool.size:
            print(json.dumps({"error": f"{nbytes} bytes do not fit the helper's {pool.size}-byte pool"}), flush=True)
            return 1
        if req["op"].endswith("_par"):

            def one(call: tuple, syscall=syscall) -> int:  # type: ignore[no-untyped-def]
                lo, re, count, total = call
                got = syscall(pid, lo, count, re, count, 0)
                if got != total:
                    raise OSError(ctypes.get_errno(), f"moved {got} of {total} bytes")
                return got

            times = []
            try:
                for _ in range(int(req.get("repeats", 1))):
                    base = cursor.take(nbytes) if req["op"] == "read_par" else cursor.written(nbytes)
                    par = _parallel_calls(base, pages, parts)
                    t0 = time.perf_counter()
                    futs = [threads.submit(one, c) for c in par[1:]]
                    one(par[0])
                    for f in futs:
                        f.result()
                    times.append(time.perf_counter() - t0)
            except OSError as e:
                print(json.dumps({"error": f"{req['op']}: {e}"}), flush=True)
                return 1
            print(json.dumps({"times": times}), flush=True)
            continue
        times = []
        for _ in range(int(req.get("repeats", 1))):
            calls = _calls(cursor.take(nbytes) if req["op"] == "read" else cursor.written(nbytes), pages)
            t0 = time.perf_counter()
            for local, remote, count, total in calls:
                got = syscall(pid, local, count, remote, count, 0)
                if got != total:
                    err = ctypes.get_errno()
                    print(json.dumps({"error": f"{req['op']} moved {got} of {total} bytes (errno {err})"}),
                          flush=True)
                    return 1
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times}), flush=True)
    threads.shutdown()
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
