"""GPU store/retrieve through a whole daemon: ``hkvd serve --copy-engine cuda`` against pinned cudaMemcpy.

Usage: ``python bench/gpu_store_retrieve.py [--page-kib 1024,2048,4096,8192] [--batches 1,8,64] [--reps 7]``

An engine process (spawned) owns one CUDA buffer, exports it over CUDA IPC as the shim does and
stays idle. ``hkvd serve --copy-engine cuda`` registers it (one group, one block per chunk, so an
entry is one page of ``--page-kib``). This process is the engine's worker connection: for each page
size and batch, it stores ``batch`` fresh pages (a descriptor over the socket, the daemon copies
device -> pinned pool and answers), then looks them up with a lease and retrieves them into other
blocks (pool -> device). Each is timed from submit to the daemon's answer.

The reference is the raw primitive on the same engine buffer, in the same run: this process opens
the engine's IPC handle itself and times one ``cudaMemcpy`` of the batch's bytes between it and a
pinned host buffer, each way. Ratio = daemon GB/s / raw GB/s, medians over ``--reps``.

Without CuPy or a GPU it prints why and exits 0 (1 with HKVD_REQUIRE_GPU=1).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

if __package__:
    from bench.gpu_copy import median_time, require_gpu
else:  # run as a script (also under python -P, where bench/ is not on sys.path): load it beside us
    import importlib.util

    _spec = importlib.util.spec_from_file_location("gpu_copy", os.path.join(os.path.dirname(__file__), "gpu_copy.py"))
    assert _spec is not None and _spec.loader is not None
    _gpu_copy = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_gpu_copy)
    median_time, require_gpu = _gpu_copy.median_time, _gpu_copy.require_gpu


def _engine(conn: Any, nbytes: int) -> None:
    """The engine: a CUDA buffer exported once, kept alive until told to exit."""
    import torch

    from hkvd.cuda.export import export_tensor

    t = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    r = export_tensor(1, t)
    conn.send((r.region_id, r.size, r.handle, r.device_uuid, r.offset))
    conn.recv()  # exit


def _measure(client: Any, rt: Any, dev_ptr: int, host: int, page: int, top: int, batch: int, reps: int,
             seq: Any) -> dict[str, Any]:
    """One page size and batch: stores of fresh keys from blocks 1..batch, then lookups with a lease
    and retrieves into blocks top+1.., each timed submit -> answer; the raw copies between the
    engine's buffer (opened here through its IPC handle) and a pinned host buffer."""
    from hkvd.transport.keys import chunk_keys
    from hkvd.transport.wire.kv import Item

    n = batch * page

    def raw_d2h() -> None:
        rt.memcpy(host, dev_ptr + page, n, rt.memcpyDeviceToHost)

    def raw_h2d() -> None:
        rt.memcpy(dev_ptr + (top + 1) * page, host, n, rt.memcpyHostToDevice)

    stored: list[list[bytes]] = []
    # Keys and items are made before the clock starts: the engine has them before it asks.
    ready = []
    for _ in range(reps + 1):
        keys = chunk_keys([(next(seq) << 16) + i for i in range(16 * batch)], 16)  # unique below 2**32
        ready.append((keys, [Item(0, i, keys[i], [1 + i]) for i in range(batch)]))

    def store() -> None:
        keys, items = ready.pop()
        (c,) = client.wait([client.submit_store(items)], 120).values()
        if not c.ok:
            raise RuntimeError(f"store failed: {c.error}")
        stored.append(keys)

    t_raw_d2h = median_time(raw_d2h, reps)  # each after one untimed warm-up call
    t_store = median_time(store, reps)
    t_raw_h2d = median_time(raw_h2d, reps)
    retrieves = []
    for keys in stored:
        (hit,) = client.wait([client.submit_lookup(keys)], 120).values()
        if hit.result.hit_chunks != batch:
            raise RuntimeError(f"lookup found {hit.result.hit_chunks} of {batch} chunks just stored")
        items = [Item(0, i, keys[i], [top + 1 + i]) for i in range(batch)]
        t0 = time.perf_counter()
        (c,) = client.wait([client.submit_retrieve(items, hit.result.lease_id)], 120).values()
        retrieves.append(time.perf_counter() - t0)
        if not c.ok:
            raise RuntimeError(f"retrieve failed: {c.error}")
        client.release(int(hit.result.lease_id))
    row: dict[str, Any] = {"page_kib": page >> 10, "batch": batch, "store_gbps": n / t_store / 1e9,
                           "raw_d2h_gbps": n / t_raw_d2h / 1e9, "retrieve_gbps": n / statistics.median(retrieves) / 1e9,
                           "raw_h2d_gbps": n / t_raw_h2d / 1e9}
    row["store_vs_raw"] = row["store_gbps"] / row["raw_d2h_gbps"]
    row["retrieve_vs_raw"] = row["retrieve_gbps"] / row["raw_h2d_gbps"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-kib", default="1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    pages = [int(x) << 10 for x in args.page_kib.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    require_gpu("gpu_store_retrieve")
    from hkvd.cuda._cupy import cupy
    from hkvd.cuda.hostreg import PinnedRegistration
    from hkvd.shim.client import DaemonClient
    from hkvd.transport.copy_engine import Region
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire.control import EngineSpec

    cp = cupy()
    rt = cp.cuda.runtime
    top = max(batches)
    nblocks = 2 * top + 1  # block 0 unused; stores read 1..top, retrieves write top+1..2*top
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for page in pages:
            nbytes = nblocks * page
            conn, child = ctx.Pipe()
            eng = ctx.Process(target=_engine, args=(child, nbytes), daemon=True)
            eng.start()
            if not conn.poll(120):
                raise RuntimeError("the engine process did not export its CUDA buffer within 120 s")
            rid, size, handle, uuid, offset = conn.recv()
            region = Region(rid, "cuda", size, handle=handle, device_uuid=uuid, offset=offset)
            sock = os.path.join(tmp, f"hkvd-{page}.sock")
            pool_gb = max(1.0, 2 * (args.reps + 1) * top * page / (1 << 30))
            daemon = subprocess.Popen([sys.executable, "-m", "hkvd.daemon", "serve", "--copy-engine", "cuda",
                                       "--socket", sock, "--l1-size-gb", f"{pool_gb:.2f}", "--chunk-size", "16",
                                       "--hugepages", "off", "--log-level", "warning"], cwd=tmp)
            try:
                deadline = time.monotonic() + 180
                while not os.path.exists(sock):
                    if daemon.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("hkvd serve --copy-engine cuda did not start")
                    time.sleep(0.1)
                group = GroupSpec(0, "full", 16, 0, nblocks, "bfloat16", (View(1, 0, 1, nbytes, page, page),))
                client = DaemonClient(sock, client_name="gpu-bench", role="worker", timeout_s=120)
                client.connect()
                client.register(EngineSpec("gpu-bench", 1, 0, "cuda/LBHNC", 16, 16, 8192, "align", [region], [group]))
                # The raw primitive on the same engine memory: open its IPC handle here too.
                dev_ptr = int(rt.ipcOpenMemHandle(handle)) + offset
                mm = mmap.mmap(-1, top * page)
                host = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                np.frombuffer(mm, dtype=np.uint8)[:] = 1
                reg = PinnedRegistration(host, top * page, device=0)
                seq = iter(range(1, 1 << 30))
                pings = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    client.ping()
                    pings.append(time.perf_counter() - t0)
                print(f"  descriptor round trip (ping) p50 {statistics.median(pings) * 1e6:.0f} us", flush=True)
                for batch in batches:
                    row = _measure(client, rt, dev_ptr, host, page, top, batch, args.reps, seq)
                    rows.append(row)
                    print(f"  {page >> 10:>5} KiB x {batch:>2}: store {row['store_gbps']:6.1f} GB/s (raw D2H "
                          f"{row['raw_d2h_gbps']:5.1f}, {row['store_vs_raw']:.2f}), retrieve "
                          f"{row['retrieve_gbps']:6.1f} GB/s (raw H2D {row['raw_h2d_gbps']:5.1f}, "
                          f"{row['retrieve_vs_raw']:.2f})", flush=True)
                client.close()
                reg.close()
                rt.ipcCloseMemHandle(dev_ptr - offset)
            finally:
                daemon.terminate()
                daemon.wait(60)
                conn.send("exit")
                eng.join(30)
    print("\n| page | batch | store GB/s | raw D2H GB/s | store / raw | retrieve GB/s | raw H2D GB/s "
          "| retrieve / raw |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['page_kib']} KiB | {r['batch']} | {r['store_gbps']:.1f} | {r['raw_d2h_gbps']:.1f} | "
              f"{r['store_vs_raw']:.2f} | {r['retrieve_gbps']:.1f} | {r['raw_h2d_gbps']:.1f} | "
              f"{r['retrieve_vs_raw']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
