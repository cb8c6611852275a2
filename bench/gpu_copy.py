"""GPU copy bench: store/retrieve GB/s of the kernel and memcpy paths vs one pinned cudaMemcpy.

Usage: ``python bench/gpu_copy.py [--total-mib 1024] [--iters 5] [--page-kib 64,256,1024,4096,8192]``

For each page size the engine-side buffer holds pages at a stride of twice the page (K/V-like
interleave, so nothing coalesces) and the pool holds them back to back in pinned (registered)
memory, exactly as ``CudaCopyEngine`` sees them. Each path runs through ``BatchCopier.run``
(descriptor upload, launch or memcpy loop, event record, host wait), the whole data path of a
copy. The baseline is one ``cudaMemcpyAsync`` of the same total bytes between the same two
buffers, measured in the same run. The table's ratio columns are path / baseline: the choice
of ``hkvd.cuda.copy.DEFAULT_METHOD`` follows them.

Without CuPy or a GPU it prints why and exits 0 (1 with HKVD_REQUIRE_GPU=1).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np


def require_gpu(tool: str) -> None:
    """Exit with the reason where CuPy or a device is missing: 0, or 1 with HKVD_REQUIRE_GPU=1 (so a
    GPU job cannot pass by skipping). Shared by the GPU benches."""
    from hkvd.cuda._cupy import cupy_available, device_count

    reason = ("cupy is not installed (pip install -e '.[gpu]')" if not cupy_available()
              else "no CUDA device" if device_count() == 0 else "")
    if reason:
        print(f"{tool}: {reason}; run it on a GPU node (make test-gpu)", file=sys.stderr)
        sys.exit(1 if os.environ.get("HKVD_REQUIRE_GPU") == "1" else 0)


def median_time(fn: Callable[[], None], iters: int) -> float:
    fn()  # warm-up (kernel load, first-touch of the mappings)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes moved per copy")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--page-kib", default="64,256,1024,4096,8192")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)

    require_gpu("gpu_copy")

    from hkvd.cuda._cupy import cupy
    from hkvd.cuda.copy import BatchCopier
    from hkvd.cuda.descriptors import DST, LEN, SRC
    from hkvd.cuda.hostreg import PinnedRegistration

    cp = cupy()
    rt = cp.cuda.runtime
    total = args.total_mib << 20
    dev_id = args.device
    with cp.cuda.Device(dev_id):
        name = rt.getDeviceProperties(dev_id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        gpu = cp.empty(2 * total, dtype=cp.uint8)  # pages at stride 2*page
        gpu.fill(7)
        gpu_base = int(gpu.data.ptr)
        mm = mmap.mmap(-1, total)
        anchor = ctypes.c_char.from_buffer(mm)
        host_base = ctypes.addressof(anchor)
        np.frombuffer(mm, dtype=np.uint8)[:] = 1  # fault every page in before pinning
        reg = PinnedRegistration(host_base, total, device=dev_id)
        copier = BatchCopier(dev_id)
        stream = copier.stream

        def contiguous(src: int, dst: int) -> Callable[[], None]:
            def run() -> None:
                rt.memcpyAsync(dst, src, total, rt.memcpyDefault, stream.ptr)
                stream.synchronize()

            return run

        base_store = total / median_time(contiguous(gpu_base, host_base), args.iters) / 1e9
        base_retr = total / median_time(contiguous(host_base, gpu_base), args.iters) / 1e9
        print(f"# {name}: pinned cudaMemcpy of one {args.total_mib} MiB buffer: "
              f"D2H {base_store:.1f} GB/s, H2D {base_retr:.1f} GB/s")
        header = ("page", "rows", "store kern", "store memcpy", "retr kern", "retr memcpy",
                  "sk/base", "sm/base", "rk/base", "rm/base")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for kib in (int(x) for x in args.page_kib.split(",")):
            page = kib << 10
            rows = total // page
            desc = np.empty((rows, 3), dtype=np.int64)
            desc[:, SRC] = gpu_base + np.arange(rows, dtype=np.int64) * (2 * page)
            desc[:, DST] = host_base + np.arange(rows, dtype=np.int64) * page
            desc[:, LEN] = page
            back = desc[:, [DST, SRC, LEN]].copy()
            res = {}
            for label, d in (("store", desc), ("retr", back)):
                for method in ("kernel", "memcpy"):
                    t = median_time(lambda d=d, m=method: copier.run(d, m), args.iters)
                    res[(label, method)] = rows * page / t / 1e9
            sk, sm = res[("store", "kernel")], res[("store", "memcpy")]
            rk, rm = res[("retr", "kernel")], res[("retr", "memcpy")]
            ratios = (sk / base_store, sm / base_store, rk / base_retr, rm / base_retr)
            print(f"| {kib} KiB | {rows} | {sk:.1f} | {sm:.1f} | {rk:.1f} | {rm:.1f} | "
                  + " | ".join(f"{r:.2f}" for r in ratios) + " |")
        copier.events.close()
        reg.close()
        del anchor
        mm.close()


if __name__ == "__main__":
    main()
