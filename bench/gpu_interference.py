"""GPU interference bench: a compute engine's step times while ``hkvd serve --copy-engine cuda`` copies.

Usage: ``python bench/gpu_interference.py [--seconds 6] [--step-ms 10] [--requests 16] [--page-mib 8]
[--methods memcpy,kernel,auto] [--log]``

Two engine processes share one GPU, as two vLLM engines would:
- the compute engine runs steady bf16 matmul steps (about ``--step-ms`` each, sized at start) on its
  own stream, each step timed on the GPU with a pair of CUDA events and ended by a host
  synchronisation (as a serving engine's sampling does);
- the copy engine owns a CUDA buffer exported over CUDA IPC; this process is its worker connection
  to a real ``hkvd serve --copy-engine cuda --cuda-copy-method M`` (one daemon per method) and, back
  to back for the whole phase, stores ``--requests`` requests of one ``--page-mib`` page each, all in
  flight at once, looks them up with a lease, and retrieves them the same way.

Phases: compute alone ("base"); per method, the copies alone (their rate without compute) and then
the copies during compute; compute alone again ("base again", which shows the drift of the machine).
For each phase it prints the step times' p50 and p99 as ratios to the first phase, and the GB/s
the copies reached (stores and retrieves together) with its ratio to the same method's rate alone.
Targets, printed beside: with the default method (``hkvd.cuda.copy.DEFAULT_METHOD``), p50 <= 1.05x
and p99 <= 1.15x, with the copies at >= 0.6 of their rate alone. Sized to finish within 3 minutes
with the defaults (3 daemons, 8 phases of 6 s; not yet timed on a GPU). ``--log`` also writes the
output to ``bench/results/gpu_interference_<gpu>_<date>.log``.

Without CuPy, torch with CUDA, or a GPU it prints why and exits 0 (1 with HKVD_REQUIRE_GPU=1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

if __package__:
    from bench.gpu_copy import require_gpu
else:  # run as a script (also under python -P, where bench/ is not on sys.path): load it beside us
    import importlib.util

    _spec = importlib.util.spec_from_file_location("gpu_copy", os.path.join(os.path.dirname(__file__), "gpu_copy.py"))
    assert _spec is not None and _spec.loader is not None
    _gpu_copy = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_gpu_copy)
    require_gpu = _gpu_copy.require_gpu

METHODS = ("memcpy", "kernel", "auto")
TARGET_P50 = 1.05
TARGET_P99 = 1.15
TARGET_COPY_VS_ALONE = 0.6
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ---- pure parts (tested on CPU) -------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each phase")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the compute engine's step time to aim for")
    ap.add_argument("--requests", type=int, default=16, help="requests in flight at once, each way")
    ap.add_argument("--page-mib", type=int, default=8, help="bytes of each request (one page)")
    ap.add_argument("--methods", default=",".join(METHODS), help="--cuda-copy-method values, one daemon each")
    ap.add_argument("--log", action="store_true", help="also write the output under bench/results/")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"--methods takes a comma-separated list of {', '.join(METHODS)}; got {args.methods!r}")
    if args.seconds <= 0 or args.step_ms <= 0 or args.requests <= 0 or args.page_mib <= 0:
        ap.error("--seconds, --step-ms, --requests and --page-mib must be positive")
    args.methods = methods
    return args


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between the closest ranks."""
    if not xs:
        raise ValueError("no samples: the phase recorded no step")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Phase:
    name: str
    method: str = ""  # the copy method, "" for compute alone
    steps_ms: tuple[float, ...] = ()  # empty: no compute in this phase
    copy_bytes: int = 0
    copy_s: float = 0.0

    @property
    def copy_gbps(self) -> float:
        return self.copy_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0


def ratios(phase: Phase, base: Phase) -> tuple[float, float]:
    """The phase's step p50 and p99 over the base phase's."""
    return (percentile(phase.steps_ms, 50) / percentile(base.steps_ms, 50),
            percentile(phase.steps_ms, 99) / percentile(base.steps_ms, 99))


def report(phases: list[Phase], default_method: str) -> list[str]:
    """The table and the verdicts, as lines. The first phase with steps is the base."""
    base = next(p for p in phases if p.steps_ms)
    alone = {p.method: p.copy_gbps for p in phases if p.method and not p.steps_ms}
    lines = [f"base: {len(base.steps_ms)} steps, p50 {percentile(base.steps_ms, 50):.2f} ms, "
             f"p99 {percentile(base.steps_ms, 99):.2f} ms", "",
             "| phase | steps | p50 / base | p99 / base | copies GB/s | copies / alone |",
             "|---|---|---|---|---|---|"]
    for p in phases:
        if p.steps_ms:
            r50, r99 = ratios(p, base)
            steps, c50, c99 = str(len(p.steps_ms)), f"{r50:.3f}", f"{r99:.3f}"
        else:
            steps = c50 = c99 = "-"
        gbps = f"{p.copy_gbps:.1f}" if p.copy_s else "-"
        vs = f"{p.copy_gbps / alone[p.method]:.2f}" if p.steps_ms and p.method and alone.get(p.method) else "-"
        lines.append(f"| {p.name} | {steps} | {c50} | {c99} | {gbps} | {vs} |")
    lines.append("")
    for p in phases:
        if not (p.steps_ms and p.method):
            continue
        r50, r99 = ratios(p, base)
        share = p.copy_gbps / alone[p.method] if alone.get(p.method) else 0.0
        ok = r50 <= TARGET_P50 and r99 <= TARGET_P99 and share >= TARGET_COPY_VS_ALONE
        tag = " (default)" if p.method == default_method else ""
        lines.append(f"{p.method}{tag}: p50 {r50:.3f}x (target <= {TARGET_P50}), p99 {r99:.3f}x (target <= "
                     f"{TARGET_P99}), copies at {share:.2f} of their rate alone (target >= {TARGET_COPY_VS_ALONE})"
                     f": {'met' if ok else 'NOT met'}")
    return lines


def log_path(gpu_name: str, day: datetime.date) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") or "gpu"
    return os.path.join(RESULTS, f"gpu_interference_{slug}_{day.isoformat()}.log")


# ---- the compute engine (spawned) -----------------------------------------------------------------

def _compute(conn: Any) -> None:
    """bf16 matmul steps on a stream of its own; ("size", ms) -> matmuls per step, ("run", s) -> step ms."""
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    n = 4096
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    per_step = 1

    def step() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(per_step):
                torch.matmul(a, b, out=out)
            end.record(stream)
        end.synchronize()  # the engine's host waits for its step, as sampling does
        return float(start.elapsed_time(end))

    while True:
        cmd, arg = conn.recv()
        if cmd == "size":
            per_step = 1
            for _ in range(5):
                step()  # warm-up
            one = sorted(step() for _ in range(20))[10]
            per_step = max(1, round(arg / one))
            conn.send(per_step)
        elif cmd == "run":
            times: list[float] = []
            t_end = time.monotonic() + arg
            while time.monotonic() < t_end:
                times.append(step())
            conn.send(times)
        else:
            conn.send(None)
            return


# ---- the copy engine's buffer (spawned) and its worker connection (here) ---------------------------

def _buffer(conn: Any, nbytes: int) -> None:
    """The copy engine: a CUDA buffer exported once, kept alive until told to exit."""
    import torch

    from hkvd.cuda.export import export_tensor

    t = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    r = export_tensor(1, t)
    conn.send((r.region_id, r.size, r.handle, r.device_uuid, r.offset))
    conn.recv()


class _Copier:
    """One daemon with one copy method, and the worker connection that drives it."""

    def __init__(self, tmp: str, method: str, region: Any, page: int, requests: int) -> None:
        from hkvd.shim.client import DaemonClient
        from hkvd.transport.layout import GroupSpec, View
        from hkvd.transport.wire.control import EngineSpec

        self.page, self.requests = page, requests
        nblocks = 2 * requests + 1  # block 0 unused; stores read 1..r, retrieves write r+1..2r
        nbytes = nblocks * page
        self.sock = os.path.join(tmp, f"hkvd-{method}.sock")
        pool_gb = max(1.0, 8 * requests * page / (1 << 30))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hkvd.daemon", "serve", "--copy-engine", "cuda", "--cuda-copy-method", method,
             "--socket", self.sock, "--l1-size-gb", f"{pool_gb:.2f}", "--chunk-size", "16", "--hugepages", "off",
             "--log-level", "warning"], cwd=tmp)
        deadline = time.monotonic() + 180
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"hkvd serve --copy-engine cuda --cuda-copy-method {method} did not start")
            time.sleep(0.1)
        group = GroupSpec(0, "full", 16, 0, nblocks, "bfloat16", (View(1, 0, 1, nbytes, page, page),))
        self.client = DaemonClient(self.sock, client_name="gpu-interference", role="worker", timeout_s=120)
        self.client.connect()
        self.client.register(EngineSpec("gpu-interference", 1, 0, "cuda/LBHNC", 16, 16, 8192, "align", [region],
                                        [group]))
        self.seq = 1

    def round(self) -> int:
        """Store ``requests`` fresh pages (all in flight), look them up, retrieve them (all in flight)."""
        from hkvd.transport.keys import chunk_keys
        from hkvd.transport.wire.kv import Item

        c = self.client
        r = self.requests
        keys = chunk_keys([(self.seq << 16) + i for i in range(16 * r)], 16)
        self.seq += 1
        done = c.wait([c.submit_store([Item(0, i, keys[i], [1 + i])]) for i in range(r)], 120)
        failed = [x.error for x in done.values() if not x.ok]
        if failed:
            raise RuntimeError(f"a store failed: {failed[0]}")
        (hit,) = c.wait([c.submit_lookup(keys)], 120).values()
        n = int(hit.result.hit_chunks)
        c.release(int(hit.result.lease_id))  # a lease serves one retrieve: the requests in flight go without
        done = c.wait([c.submit_retrieve([Item(0, i, keys[i], [r + 1 + i])]) for i in range(n)], 120)
        failed = [x.error for x in done.values() if not x.ok]
        if failed:
            raise RuntimeError(f"a retrieve failed: {failed[0]}")
        return (r + n) * self.page

    def run(self, until: Callable[[], bool]) -> tuple[int, float]:
        """Rounds back to back until ``until()``; bytes moved and seconds taken."""
        moved = 0
        t0 = time.perf_counter()
        while not until():
            moved += self.round()
        return moved, time.perf_counter() - t0

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        self.proc.terminate()
        self.proc.wait(60)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    require_gpu("gpu_interference")
    try:
        import torch

        torch_ok = bool(torch.cuda.is_available())
    except ImportError:
        torch_ok = False
    if not torch_ok:
        print("gpu_interference: torch with CUDA is needed for the compute engine; run it on a GPU node "
              "(make test-gpu)", file=sys.stderr)
        return 1 if os.environ.get("HKVD_REQUIRE_GPU") == "1" else 0
    from hkvd.cuda._cupy import cupy
    from hkvd.cuda.copy import DEFAULT_METHOD
    from hkvd.transport.copy_engine import Region

    raw_name = cupy().cuda.runtime.getDeviceProperties(0)["name"]
    name = raw_name.decode("utf-8", "replace") if isinstance(raw_name, bytes) else str(raw_name)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"gpu_interference on {name}: {args.requests} x {args.page_mib} MiB each way, {args.seconds:g} s a phase, "
        f"methods {', '.join(args.methods)} (default {DEFAULT_METHOD})")
    page = args.page_mib << 20
    ctx = mp.get_context("spawn")
    comp_conn, comp_child = ctx.Pipe()
    comp = ctx.Process(target=_compute, args=(comp_child,), daemon=True)
    buf_conn, buf_child = ctx.Pipe()
    buf = ctx.Process(target=_buffer, args=(buf_child, (2 * args.requests + 1) * page), daemon=True)
    comp.start()
    buf.start()
    phases: list[Phase] = []
    try:
        comp_conn.send(("size", args.step_ms))
        if not comp_conn.poll(180):
            raise RuntimeError("the compute engine did not start within 180 s")
        say(f"compute engine: {comp_conn.recv()} bf16 4096^3 matmuls a step")
        if not buf_conn.poll(120):
            raise RuntimeError("the copy engine did not export its CUDA buffer within 120 s")
        rid, size, handle, uuid, offset = buf_conn.recv()
        region = Region(rid, "cuda", size, handle=handle, device_uuid=uuid, offset=offset)

        def compute(seconds: float) -> None:
            comp_conn.send(("run", seconds))

        def steps() -> tuple[float, ...]:
            if not comp_conn.poll(args.seconds + 120):
                raise RuntimeError("the compute engine stopped answering")
            return tuple(comp_conn.recv())

        compute(args.seconds)
        phases.append(Phase("base", steps_ms=steps()))
        with tempfile.TemporaryDirectory() as tmp:
            for method in args.methods:
                copier = _Copier(tmp, method, region, page, args.requests)
                try:
                    copier.round()  # warm-up: kernel load, first touch of the mappings
                    t_end = time.monotonic() + args.seconds
                    moved, took = copier.run(lambda t_end=t_end: time.monotonic() >= t_end)
                    phases.append(Phase(f"{method}, copies alone", method, copy_bytes=moved, copy_s=took))
                    compute(args.seconds)
                    moved, took = copier.run(lambda: comp_conn.poll())
                    phases.append(Phase(f"{method}, copies during compute", method, steps(), moved, took))
                finally:
                    copier.close()
                say(f"  {phases[-2].name}: {phases[-2].copy_gbps:.1f} GB/s; {phases[-1].name}: "
                    f"{phases[-1].copy_gbps:.1f} GB/s")
        compute(args.seconds)
        phases.append(Phase("base again", steps_ms=steps()))
    finally:
        for conn, msg in ((comp_conn, ("exit", 0)), (buf_conn, "exit")):
            with contextlib.suppress(OSError):  # it is gone already
                conn.send(msg)
        for proc in (comp, buf):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    for line in report(phases, DEFAULT_METHOD):
        say(line)
    if args.log:
        path = log_path(name, datetime.date.today())
        os.makedirs(RESULTS, exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
