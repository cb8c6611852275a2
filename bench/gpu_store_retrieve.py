"""GPU store/retrieve through a whole daemon: ``hkvd serve --copy-engine cuda`` against pinned cudaMemcpy.

Usage: ``python bench/gpu_store_retrieve.py [--page-kib 1024,2048,4096,8192] [--batches 1,8,64]
[--inflight 1,8,64] [--methods memcpy,kernel] [--no-hybrid] [--reps 7] [--log]``

An engine process (spawned) owns one CUDA buffer, exports it over CUDA IPC as the shim does, and
records a step-end IPC event when asked (as the shim does at the end of a step). For each copy
method (``--cuda-copy-method``, one daemon each, side by side in the table) and page size,
``hkvd serve --copy-engine cuda`` registers it (one group, one block per chunk, so an entry is one
page of ``--page-kib``), and this process, the engine's worker connection, times from submit to
the daemon's answer:
- batches: one request of ``batch`` fresh pages (a descriptor over the socket, the daemon copies
  device -> pinned pool and answers), then a lookup with a lease and one retrieve of them into
  other blocks (pool -> device);
- in flight: ``n`` requests of one page each, all submitted before the first answer, each way.
Then the shape of one prefill step of a hybrid model (``hybrid_shape``: 12 KV tensors, each
shared by one layer of the attention group and of the 3 GDN groups, blocks of N = 544 tokens,
16 chunks): the attention pages as one store, the three Mamba states as one step event, both
ordered after the engine's step-end event, then the retrieve of all of them under a lease.

The reference is the raw primitive on the same engine buffer, in the same run: this process opens
the engine's IPC handle itself and times one ``cudaMemcpy`` of the same bytes between it and a
pinned host buffer, each way. Ratio = daemon GB/s / raw GB/s, medians over ``--reps``. Target,
printed beside: >= 0.90 of pinned cudaMemcpy in every shape. The fixed cost of a request is stated
from the 1-page requests: daemon time minus the raw copy time of that page.
``--log`` also writes the output to ``bench/results/gpu_store_retrieve_<gpu>_<date>.log``.

Without CuPy or a GPU it prints why and exits 0 (1 with HKVD_REQUIRE_GPU=1).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import mmap
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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

METHODS = ("memcpy", "kernel", "auto")
TARGET = 0.90
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---- pure parts (tested on CPU) -------------------------------------------------------------------

def _ints(text: str, what: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{what} takes comma-separated positive integers, got {text!r}")
    if not out or min(out) <= 0:
        ap.error(f"{what} takes comma-separated positive integers, got {text!r}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-kib", default="1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,8,64", help="pages in one request")
    ap.add_argument("--inflight", default="1,8,64", help="requests of one page each, in flight at once")
    ap.add_argument("--methods", default="memcpy,kernel", help="--cuda-copy-method values, one daemon each")
    ap.add_argument("--no-hybrid", action="store_true", help="leave out the hybrid prefill step's shape")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--log", action="store_true", help="also write the output under bench/results/")
    args = ap.parse_args(argv)
    args.pages = [k << 10 for k in _ints(args.page_kib, "--page-kib", ap)]
    args.batches = _ints(args.batches, "--batches", ap)
    args.inflight = _ints(args.inflight, "--inflight", ap)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        ap.error(f"--methods takes a comma-separated list of {', '.join(METHODS)}; got {args.methods!r}")
    args.methods = methods
    if args.reps <= 0:
        ap.error("--reps must be positive")
    return args


@dataclass(frozen=True)
class HybridShape:
    """One prefill step of a hybrid model shaped like Qwen3-Next at TP 1 (48 layers: 12 attention with
    2 KV heads of 256 in bf16, 36 Gated DeltaNet), as vLLM lays it out: 12 KV tensors, each shared by
    one layer of every group (1 attention + 3 GDN groups), pages padded to the attention page."""

    layers_per_group: int = 12
    mamba_groups: int = 3
    tokens_per_block: int = 544  # N: vLLM raises the attention block until its page holds a GDN state
    chunks: int = 16  # one chunk per block: a prefill step of 16 * 544 = 8704 tokens
    kv_heads: int = 2
    head_dim: int = 256
    # A GDN layer's state: conv (3 x 8192 bf16) + recurrent (32 heads x 128 x 128 bf16)
    mamba_state_bytes: int = 3 * 8192 * 2 + 32 * 128 * 128 * 2

    @property
    def page_bytes(self) -> int:
        """One attention layer's block: K and V, N tokens, in bf16; GDN pages are padded to it."""
        return 2 * self.tokens_per_block * self.kv_heads * self.head_dim * 2

    @property
    def tensors(self) -> list[list[str]]:
        """Per KV tensor, the group kinds whose layers share it."""
        return [["full"] + ["mamba"] * self.mamba_groups for _ in range(self.layers_per_group)]

    @property
    def attention_bytes(self) -> int:
        return self.chunks * self.layers_per_group * self.page_bytes

    @property
    def mamba_bytes(self) -> int:
        """One state per GDN group for the step (its last chunk), every layer."""
        return self.mamba_groups * self.layers_per_group * self.mamba_state_bytes

    @property
    def step_bytes(self) -> int:
        return self.attention_bytes + self.mamba_bytes


def hybrid_shape() -> HybridShape:
    return HybridShape()


def fixed_cost_us(request_s: float, nbytes: int, raw_gbps: float) -> float:
    """What a request costs beyond moving its bytes at the raw rate, in microseconds."""
    return (request_s - nbytes / (raw_gbps * 1e9)) * 1e6


def verdict(rows: list[dict[str, Any]]) -> str:
    """Whether every shape reached ``TARGET`` of pinned cudaMemcpy each way, per method."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        worst = min(min(r["store_vs_raw"], r["retrieve_vs_raw"]) for r in mine)
        miss = [r["shape"] for r in mine if min(r["store_vs_raw"], r["retrieve_vs_raw"]) < TARGET]
        out.append(f"{method}: worst {worst:.2f} of pinned cudaMemcpy (target >= {TARGET:.2f} in every shape): "
                   + ("met" if not miss else f"NOT met in {len(miss)} of {len(mine)} shapes ({', '.join(miss)})"))
    return "\n".join(out)


def log_path(gpu_name: str, day: datetime.date) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") or "gpu"
    return os.path.join(RESULTS, f"gpu_store_retrieve_{slug}_{day.isoformat()}.log")


# ---- the engine (spawned) -------------------------------------------------------------------------

def _engine(conn: Any, nbytes: int) -> None:
    """The engine: a CUDA buffer exported once; "step" records a step-end IPC event and returns its
    handle (nothing else runs on its stream: the event completes at once); "exit" ends it."""
    import torch

    from hkvd.cuda._cupy import cupy
    from hkvd.cuda.export import export_tensor
    from hkvd.cuda.ipc_events import IpcEventRing

    t = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    r = export_tensor(1, t)
    cp = cupy()
    with cp.cuda.Device(0):
        stream = cp.cuda.Stream(non_blocking=True)
        ring = IpcEventRing(0)
    conn.send((r.region_id, r.size, r.handle, r.device_uuid, r.offset))
    while True:
        cmd = conn.recv()
        if cmd == "step":
            _, handle = ring.record(stream.ptr)
            conn.send(handle)
        else:
            ring.close()
            return


class _Rig:
    """One engine process, one daemon with one copy method, the worker connection, and the raw reference."""

    def __init__(self, tmp: str, method: str, nbytes: int, groups: Callable[[Any], list[Any]], pool_gb: float,
                 host_bytes: int, *, chunk: int = 16, block: int = 16, batched_tokens: int = 8192) -> None:
        from hkvd.cuda._cupy import cupy
        from hkvd.cuda.hostreg import PinnedRegistration
        from hkvd.shim.client import DaemonClient
        from hkvd.transport.copy_engine import Region
        from hkvd.transport.wire.control import EngineSpec

        self.rt = cupy().cuda.runtime
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.eng = ctx.Process(target=_engine, args=(child, nbytes), daemon=True)
        self.eng.start()
        self.daemon: subprocess.Popen[bytes] | None = None
        self.client: Any = None
        self.reg: Any = None
        self.dev_ptr = 0
        try:
            if not self.conn.poll(120):
                raise RuntimeError("the engine process did not export its CUDA buffer within 120 s")
            rid, size, handle, uuid, offset = self.conn.recv()
            region = Region(rid, "cuda", size, handle=handle, device_uuid=uuid, offset=offset)
            sock = os.path.join(tmp, f"hkvd-{method}-{nbytes}.sock")
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "hkvd.daemon", "serve", "--copy-engine", "cuda", "--cuda-copy-method", method,
                 "--socket", sock, "--l1-size-gb", f"{pool_gb:.2f}", "--chunk-size", str(chunk), "--hugepages",
                 "off", "--log-level", "warning"], cwd=tmp)
            deadline = time.monotonic() + 180
            while not os.path.exists(sock):
                if self.daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hkvd serve --copy-engine cuda --cuda-copy-method {method} did not start")
                time.sleep(0.1)
            self.client = DaemonClient(sock, client_name="gpu-bench", role="worker", timeout_s=120)
            self.client.connect()
            self.client.register(EngineSpec("gpu-bench", 1, 0, "cuda/LBHNC", chunk, block, batched_tokens, "align",
                                            [region], groups(region)))
            # The raw primitive on the same engine memory: open its IPC handle here too.
            self.dev_ptr = int(self.rt.ipcOpenMemHandle(handle)) + offset
            self.offset = offset
            self.mm = mmap.mmap(-1, host_bytes)
            self.host = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
            np.frombuffer(self.mm, dtype=np.uint8)[:] = 1
            self.reg = PinnedRegistration(self.host, host_bytes, device=0)
        except BaseException:
            self.close()
            raise

    def raw(self, nbytes: int, dev_off_d2h: int, dev_off_h2d: int, reps: int) -> tuple[float, float]:
        """GB/s of one pinned cudaMemcpy of ``nbytes`` each way (D2H, H2D)."""
        rt = self.rt
        t_d2h = median_time(lambda: rt.memcpy(self.host, self.dev_ptr + dev_off_d2h, nbytes, rt.memcpyDeviceToHost),
                            reps)
        t_h2d = median_time(lambda: rt.memcpy(self.dev_ptr + dev_off_h2d, self.host, nbytes, rt.memcpyHostToDevice),
                            reps)
        return nbytes / t_d2h / 1e9, nbytes / t_h2d / 1e9

    def step_event(self) -> bytes:
        self.conn.send("step")
        if not self.conn.poll(60):
            raise RuntimeError("the engine did not record its step event within 60 s")
        handle: bytes = self.conn.recv()
        return handle

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.reg is not None:
            self.reg.close()
        if self.dev_ptr:
            self.rt.ipcCloseMemHandle(self.dev_ptr - self.offset)
        if self.daemon is not None:
            self.daemon.terminate()
            self.daemon.wait(60)
        with contextlib.suppress(OSError):  # it is gone already
            self.conn.send("exit")
        self.eng.join(30)
        if self.eng.is_alive():
            self.eng.kill()


def _ok(done: dict[int, Any], what: str) -> None:
    failed = [c.error for c in done.values() if not c.ok]
    if failed:
        raise RuntimeError(f"{what} failed: {failed[0]}")


def _fresh_keys(seq: Iterator[int], n: int, chunk: int = 16) -> list[bytes]:
    from hkvd.transport.keys import chunk_keys

    return chunk_keys([(next(seq) << 16) + i for i in range(chunk * n)], chunk)  # unique below 2**32


def _measure_batch(rig: _Rig, page: int, top: int, batch: int, reps: int, seq: Iterator[int]) -> dict[str, Any]:
    """One request of ``batch`` pages each way, timed submit -> answer, after ``reps`` stores."""
    from hkvd.transport.wire.kv import Item

    client = rig.client
    n = batch * page
    raw_d2h, raw_h2d = rig.raw(n, page, (top + 1) * page, reps)
    ready = []
    for _ in range(reps + 1):  # keys and items are made before the clock starts
        keys = _fresh_keys(seq, batch)
        ready.append((keys, [Item(0, i, keys[i], [1 + i]) for i in range(batch)]))
    stored: list[list[bytes]] = []

    def store() -> None:
        keys, items = ready.pop()
        _ok(client.wait([client.submit_store(items)], 120), "a store")
        stored.append(keys)

    t_store = median_time(store, reps)
    retrieves = []
    for keys in stored:
        (hit,) = client.wait([client.submit_lookup(keys)], 120).values()
        if hit.result.hit_chunks != batch:
            raise RuntimeError(f"lookup found {hit.result.hit_chunks} of {batch} chunks just stored")
        items = [Item(0, i, keys[i], [top + 1 + i]) for i in range(batch)]
        t0 = time.perf_counter()
        done = client.wait([client.submit_retrieve(items, hit.result.lease_id)], 120)
        retrieves.append(time.perf_counter() - t0)
        _ok(done, "a retrieve")
        client.release(int(hit.result.lease_id))
    t_retrieve = statistics.median(retrieves)
    return _row(f"{page >> 10} KiB x {batch} in 1 request", n, t_store, t_retrieve, raw_d2h, raw_h2d)


def _measure_inflight(rig: _Rig, page: int, top: int, inflight: int, reps: int,
                      seq: Iterator[int]) -> dict[str, Any]:
    """``inflight`` one-page requests submitted at once, each way, timed until the last answer."""
    from hkvd.transport.wire.kv import Item

    client = rig.client
    n = inflight * page
    raw_d2h, raw_h2d = rig.raw(n, page, (top + 1) * page, reps)
    stores, retrieves = [], []
    for rep in range(reps + 1):  # the first round is a warm-up
        keys = _fresh_keys(seq, inflight)
        items = [Item(0, i, keys[i], [1 + i], keys[i - 1] if i else b"") for i in range(inflight)]
        t0 = time.perf_counter()
        done = client.wait([client.submit_store([it]) for it in items], 120)
        t_store = time.perf_counter() - t0
        _ok(done, "a store")
        (hit,) = client.wait([client.submit_lookup(keys)], 120).values()
        if hit.result.hit_chunks != inflight:
            raise RuntimeError(f"lookup found {hit.result.hit_chunks} of {inflight} chunks just stored")
        # A lease serves one retrieve: the requests in flight go without one (nothing evicts here).
        client.release(int(hit.result.lease_id))
        back = [Item(0, i, keys[i], [top + 1 + i]) for i in range(inflight)]
        t0 = time.perf_counter()
        done = client.wait([client.submit_retrieve([it]) for it in back], 120)
        t_retrieve = time.perf_counter() - t0
        _ok(done, "a retrieve")
        if rep:
            stores.append(t_store)
            retrieves.append(t_retrieve)
    row = _row(f"{page >> 10} KiB x {inflight} requests in flight", n, statistics.median(stores),
               statistics.median(retrieves), raw_d2h, raw_h2d)
    row["inflight"] = inflight
    row["page"] = page
    return row


def _row(shape: str, n: int, t_store: float, t_retrieve: float, raw_d2h: float, raw_h2d: float) -> dict[str, Any]:
    row: dict[str, Any] = {"shape": shape, "bytes": n, "store_s": t_store, "retrieve_s": t_retrieve,
                           "store_gbps": n / t_store / 1e9, "retrieve_gbps": n / t_retrieve / 1e9,
                           "raw_d2h_gbps": raw_d2h, "raw_h2d_gbps": raw_h2d}
    row["store_vs_raw"] = row["store_gbps"] / raw_d2h
    row["retrieve_vs_raw"] = row["retrieve_gbps"] / raw_h2d
    return row


def _hybrid(tmp: str, method: str, reps: int, say: Callable[[str], None]) -> dict[str, Any]:
    """The hybrid prefill step: attention pages as one store, the Mamba states as one step event, both after
    the engine's step-end event; then one retrieve of the hit under a lease."""
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire.kv import Item

    shape = hybrid_shape()
    page = shape.page_bytes
    c = shape.chunks
    g = shape.mamba_groups
    # Blocks: one id space for every group (they alias the same tensors). 0 is vLLM's null block;
    # stores read attention 1..c and Mamba c+1..c+g; retrieves write attention c+g+1.. and Mamba after.
    store_attn, store_mamba = 1, c + 1
    back_attn, back_mamba = c + g + 1, 2 * c + g + 1
    nblocks = 2 * (c + g) + 1
    layer_stride = nblocks * page
    nbytes = shape.layers_per_group * layer_stride

    def groups(region: Any) -> list[Any]:
        views = [View(region.region_id, 0, shape.layers_per_group, layer_stride, page, page)]
        views += [View(region.region_id, 0, shape.layers_per_group, layer_stride, page, shape.mamba_state_bytes)
                  for _ in range(g)]
        return [GroupSpec(i, "full" if i == 0 else "mamba", shape.tokens_per_block, 0, nblocks, "bfloat16", (v,))
                for i, v in enumerate(views)]

    n = shape.step_bytes
    pool_gb = max(1.0, 3 * (reps + 1) * n / (1 << 30))
    rig = _Rig(tmp, method, nbytes, groups, pool_gb, n, chunk=shape.tokens_per_block, block=shape.tokens_per_block,
               batched_tokens=c * shape.tokens_per_block)
    try:
        client = rig.client
        # Raw: the step's bytes as one contiguous copy each way, from/to the same buffer.
        raw_d2h, raw_h2d = rig.raw(n, 0, 0, reps)
        seq = iter(range(1, 1 << 30))
        stores, retrieves = [], []
        step_seq = 0
        for rep in range(reps + 1):  # the first round is a warm-up
            keys = _fresh_keys(seq, c, shape.tokens_per_block)
            attn = [Item(0, i, keys[i], [store_attn + i], keys[i - 1] if i else b"") for i in range(c)]
            states = [Item(1 + j, c - 1, keys[c - 1], [store_mamba + j]) for j in range(g)]
            event = rig.step_event()
            t0 = time.perf_counter()
            reqs = [client.submit_store(attn, wait_event=event),
                    client.submit_step_event(step_seq, step_seq, states, wait_event=event)]
            done = client.wait(reqs, 120)
            t_store = time.perf_counter() - t0
            _ok(done, "the hybrid step's store")
            # The next step confirms the states (they become servable).
            _ok(client.wait([client.submit_step_event(step_seq + 1, step_seq + 1, [], [reqs[1]])], 120),
                "the confirming step event")
            step_seq += 2
            (hit,) = client.wait([client.submit_lookup(keys)], 120).values()
            if hit.result.hit_chunks != c:
                raise RuntimeError(f"lookup found {hit.result.hit_chunks} of {c} chunks just stored")
            back = [Item(0, i, keys[i], [back_attn + i]) for i in range(c)]
            back += [Item(1 + j, c - 1, keys[c - 1], [back_mamba + j]) for j in range(g)]
            t0 = time.perf_counter()
            done = client.wait([client.submit_retrieve(back, hit.result.lease_id)], 120)
            t_retrieve = time.perf_counter() - t0
            _ok(done, "the hybrid step's retrieve")
            client.release(int(hit.result.lease_id))
            if rep:
                stores.append(t_store)
                retrieves.append(t_retrieve)
        row = _row(f"hybrid prefill step ({n / 1e6:.0f} MB)", n, statistics.median(stores),
                   statistics.median(retrieves), raw_d2h, raw_h2d)
    finally:
        rig.close()
    say(f"  {row['shape']}: store {row['store_gbps']:.1f} GB/s ({row['store_vs_raw']:.2f}), retrieve "
        f"{row['retrieve_gbps']:.1f} GB/s ({row['retrieve_vs_raw']:.2f})")
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_gpu("gpu_store_retrieve")
    from hkvd.cuda._cupy import cupy
    from hkvd.transport.layout import GroupSpec, View

    raw_name = cupy().cuda.runtime.getDeviceProperties(0)["name"]
    name = raw_name.decode("utf-8", "replace") if isinstance(raw_name, bytes) else str(raw_name)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"gpu_store_retrieve on {name}: methods {', '.join(args.methods)}, reps {args.reps}")
    top = max(max(args.batches), max(args.inflight))
    nblocks = 2 * top + 1  # block 0 unused; stores read 1..top, retrieves write top+1..2*top
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            say(f"method {method}:")
            for page in args.pages:
                nbytes = nblocks * page

                def groups(region: Any, nbytes: int = nbytes, page: int = page) -> list[Any]:
                    return [GroupSpec(0, "full", 16, 0, nblocks, "bfloat16",
                                      (View(region.region_id, 0, 1, nbytes, page, page),))]

                pool_gb = max(1.0, 2 * (args.reps + 1) * top * page / (1 << 30))
                rig = _Rig(tmp, method, nbytes, groups, pool_gb, top * page)
                try:
                    seq = iter(range(1, 1 << 30))
                    pings = [rig.client.ping() for _ in range(200)]
                    say(f"  descriptor round trip (ping) p50 {statistics.median(pings) * 1e6:.0f} us")
                    for batch in args.batches:
                        rows.append(_measure_batch(rig, page, top, batch, args.reps, seq) | {"method": method})
                        _say_row(say, rows[-1])
                    for inflight in args.inflight:
                        rows.append(_measure_inflight(rig, page, top, inflight, args.reps, seq) | {"method": method})
                        _say_row(say, rows[-1])
                finally:
                    rig.close()
            if not args.no_hybrid:
                rows.append(_hybrid(tmp, method, args.reps, say) | {"method": method})
    _table(say, rows, args.methods)
    singles = [r for r in rows if r.get("inflight") == 1]
    for method in args.methods:
        costs = [fixed_cost_us(r["store_s"], r["bytes"], r["raw_d2h_gbps"]) for r in singles if r["method"] == method]
        costs += [fixed_cost_us(r["retrieve_s"], r["bytes"], r["raw_h2d_gbps"])
                  for r in singles if r["method"] == method]
        if costs:
            say(f"{method}: fixed cost per request (1-page requests: daemon time minus the raw copy of the page) "
                f"median {statistics.median(costs):.0f} us, range {min(costs):.0f}-{max(costs):.0f} us")
    say(verdict(rows))
    if args.log:
        path = log_path(name, datetime.date.today())
        os.makedirs(RESULTS, exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"written to {path}")
    return 0


def _say_row(say: Callable[[str], None], r: dict[str, Any]) -> None:
    say(f"  {r['shape']}: store {r['store_gbps']:6.1f} GB/s (raw D2H {r['raw_d2h_gbps']:5.1f}, "
        f"{r['store_vs_raw']:.2f}), retrieve {r['retrieve_gbps']:6.1f} GB/s (raw H2D {r['raw_h2d_gbps']:5.1f}, "
        f"{r['retrieve_vs_raw']:.2f})")


def _table(say: Callable[[str], None], rows: list[dict[str, Any]], methods: list[str]) -> None:
    """Shapes down, methods side by side: store / retrieve against pinned cudaMemcpy."""
    by = {(r["shape"], r["method"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    say("")
    say("| shape | " + " | ".join(f"{m}: store / raw | {m}: retrieve / raw" for m in methods) + " |")
    say("|---|" + "---|---|" * len(methods))
    for s in shapes:
        cells = []
        for m in methods:
            r = by.get((s, m))
            cells += [f"{r['store_vs_raw']:.2f}", f"{r['retrieve_vs_raw']:.2f}"] if r else ["-", "-"]
        say(f"| {s} | " + " | ".join(cells) + " |")
    say("")


if __name__ == "__main__":
    sys.exit(main())
