"""Raw process_vm_readv / process_vm_writev reference, run as a child of the bench process.

The child maps a pool of the same kind as the daemon's (``HugePagePool``, pre-faulted) and moves
the bench process's engine pages with the bare syscall: iovecs built once, one iovec per page,
IOV_MAX per call, nothing else timed. The daemon does the same copy behind a descriptor, so the
ratio daemon / raw is what the daemon costs on top of the kernel's copy.

Protocol: JSON lines. First line ``{"pid", "pool_bytes", "hugepages"}``, answered by
``{"ready": true, "prefault_gbps"}``; then ``{"op": "read"|"write", "pages": [[addr, len], ...],
"repeats": n}`` answered by ``{"times": [s, ...]}``; EOF ends it.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

from hkvd.daemon.cma import IOV_MAX, _Iovec, _libc
from hkvd.daemon.pool import HugePagePool


def main() -> int:
    init = json.loads(sys.stdin.readline())
    pid = int(init["pid"])
    pool = HugePagePool(int(init["pool_bytes"]), init.get("hugepages", "auto"))
    rate = pool.prefault()
    print(json.dumps({"ready": True, "prefault_gbps": rate, "kind": pool.kind}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pages = [(int(a), int(n)) for a, n in req["pages"]]
        syscall = _libc.process_vm_readv if req["op"] == "read" else _libc.process_vm_writev
        calls = []
        local_off = 0
        for i in range(0, len(pages), IOV_MAX):
            batch = pages[i:i + IOV_MAX]
            local = (_Iovec * len(batch))()
            remote = (_Iovec * len(batch))()
            for j, (addr, n) in enumerate(batch):
                local[j].iov_base, local[j].iov_len = pool.base_addr + local_off, n
                remote[j].iov_base, remote[j].iov_len = addr, n
                local_off += n
            calls.append((local, remote, len(batch), sum(n for _, n in batch)))
        times = []
        for _ in range(int(req.get("repeats", 1))):
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
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
