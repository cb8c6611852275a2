"""LMCache 0.5.6 multiprocess server: ping and lookup round trips over its ZMQ protocol.

Run with the LMCache venv's python (``make bench-peers`` makes ``.bench-lmcache``); imports the
standard library, torch and lmcache, never hkvd. Prints one JSON line last.

What it does, against the real ``lmcache server`` (``lmcache.cli``, FastAPI + the ZMQ request
server, ``lmcache.v1.multiprocess``) on this machine, without a GPU:

1. starts ``lmcache server`` on free loopback ports (ZMQ ROUTER on TCP: the server binds
   ``tcp://host:port`` only), 1 GB L1, LRU, ``--supported-transfer-mode engine_driven`` (the
   non-CUDA path: its CUDA copy path cannot load here), its log at WARNING;
2. connects one client made by LMCache's own ``RequestClientFactory`` (DEALER socket, one
   polling thread) and registers an engine-driven KV context: one layer, chunk of 16 tokens,
   2 x 16 x 64 bfloat16 = 4 KiB per chunk, the size of the hkvd control-plane fixture;
3. stores 4 chunks (``prepare_store`` + ``commit_store``, pickled CPU tensors), so lookups hit;
4. **ping**: ``ping(None)`` (the scheduler's health probe) closed loop for ``--duration-s``;
5. **lookup**: what a vLLM scheduler needs to learn the hit: ``lookup(key)`` acknowledged, then
   ``query_prefetch_status(request_id)`` polled until it answers (LMCache's connector polls it
   once per scheduler step; this polls back to back, its best case). Each hit must be 4 chunks.
   ``free_lookup_locks`` and ``end_session`` follow each lookup outside the timed span, so the
   server's state does not grow.

One-shot (default): ``{"version", "transport", "ping": {...}, "lookup": {...}}`` with ``p50_us``,
``p99_us``, ``ops_s`` (operations / elapsed, closed loop) and ``n`` per op. ``--serve``: the server
stays up and the parent (``bench.control_plane``) asks for one op at a time on stdin, so it can
alternate LMCache's rounds with hkvd's and noise lands on both alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

CHUNK = 16
HIDDEN = 64
CHUNKS = 4
MODEL = "bench-cp"
RPC_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))]


def _summary(lat: list[float], elapsed: float) -> dict[str, Any]:
    return {"n": len(lat), "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99), "ops_s": len(lat) / elapsed}


def _wait_healthy(server: subprocess.Popen[bytes], http_port: int, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{http_port}/healthcheck"
    while True:
        if server.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"lmcache server exited with rc {server.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"lmcache server not healthy at {url} within {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.25)


def _closed_loop(fn: Any, duration_s: float, warmup: int) -> tuple[list[float], float]:
    for _ in range(warmup):
        fn()
    lat: list[float] = []
    start = time.perf_counter()
    end = start + duration_s
    while True:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        fn()
        lat.append((time.perf_counter() - t0) * 1e6)
    return lat, time.perf_counter() - start


class Bench:
    """One connected, registered client with 4 stored chunks; ``run(op, duration_s)`` measures an op."""

    def __init__(self, port: int) -> None:
        import torch
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey, RegisterEngineDrivenContextPayload
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self._key_cls = IPCCacheServerKey
        self.client: Any = RequestClientFactory.create(f"tcp://127.0.0.1:{port}")
        self.client.noop().result(timeout=RPC_TIMEOUT_S)
        self.instance_id = os.getpid()
        self.client.register_kv_cache_engine_driven_context(RegisterEngineDrivenContextPayload(
            instance_id=self.instance_id, model_name=MODEL, world_size=1, block_size=CHUNK, num_layers=1,
            hidden_dim_size=HIDDEN, dtype_str="bfloat16", use_mla=False, num_physical_slots=CHUNK,
        )).result(timeout=RPC_TIMEOUT_S)
        self.tokens = tuple(int(t) for t in torch.randint(4, 30000, (CHUNKS * CHUNK,)))
        store_key = self._key("bench-store", 0)
        self.client.prepare_store(store_key, self.instance_id).result(timeout=RPC_TIMEOUT_S)
        chunks = [torch.randn(2, 1, CHUNK, HIDDEN, dtype=torch.bfloat16) for _ in range(CHUNKS)]
        if not self.client.commit_store(store_key, self.instance_id, pickle.dumps(chunks)).result(
                timeout=RPC_TIMEOUT_S):
            raise RuntimeError("lmcache commit_store returned False: the 4 fixture chunks were not stored")
        self.client.end_session("bench-store").result(timeout=RPC_TIMEOUT_S)
        self._ids = iter(range(1 << 62))
        self.polls = 0
        self.lookups = 0

    def _key(self, request_id: str, worker_id: int | None) -> Any:
        return self._key_cls(model_name=MODEL, world_size=1, worker_id=worker_id, token_ids=self.tokens,
                             start=0, end=len(self.tokens), request_id=request_id, num_kv_readers=1)

    def ping(self) -> None:
        if self.client.ping(None).result(timeout=RPC_TIMEOUT_S) is not True:
            raise RuntimeError("lmcache ping did not answer True")

    def lookup(self) -> Any:
        rid = f"bench-lookup-{next(self._ids)}"
        k = self._key(rid, None)
        self.client.lookup(k, 1).result(timeout=RPC_TIMEOUT_S)
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while True:
            self.polls += 1
            hit = self.client.query_prefetch_status(rid).result(timeout=RPC_TIMEOUT_S)
            if hit is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"lmcache prefetch status of {rid} not ready within {RPC_TIMEOUT_S} s")
        self.lookups += 1
        if hit != CHUNKS:
            raise RuntimeError(f"lmcache lookup hit {hit} of {CHUNKS} stored chunks")
        return k

    def cleanup(self, k: Any) -> None:
        """Release the lookup's read locks and end its session (as vLLM's connector does, untimed)."""
        self.client.free_lookup_locks(k, 1).result(timeout=RPC_TIMEOUT_S)
        self.client.end_session(k.request_id).result(timeout=RPC_TIMEOUT_S)

    def run(self, op: str, duration_s: float, warmup: int) -> dict[str, Any]:
        if op == "ping":
            lat, elapsed = _closed_loop(self.ping, duration_s, warmup)
            return _summary(lat, elapsed)
        if op != "lookup":
            raise ValueError(f"unknown op {op!r}: use ping or lookup")
        for _ in range(warmup):
            self.cleanup(self.lookup())
        lat: list[float] = []
        end = time.perf_counter() + duration_s
        timed = 0.0
        polls0, n0 = self.polls, self.lookups
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            k = self.lookup()
            dt = time.perf_counter() - t0
            timed += dt
            lat.append(dt * 1e6)
            self.cleanup(k)
        return {**_summary(lat, timed), "polls_per_lookup": (self.polls - polls0) / max(1, self.lookups - n0),
                "hit_chunks": CHUNKS}

    def close(self) -> None:
        try:
            self.client.unregister_kv_cache_engine_driven_context(self.instance_id).result(timeout=RPC_TIMEOUT_S)
        finally:
            self.client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=5.0, help="closed-loop time per op (one-shot mode)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--start-timeout-s", type=float, default=180.0)
    ap.add_argument("--serve", action="store_true",
                    help="JSON lines on stdin/stdout: answers {\"ready\"} once set up, then one line per "
                         "{\"op\": \"ping\"|\"lookup\", \"duration_s\", \"warmup\"}; EOF ends it")
    a = ap.parse_args()
    import lmcache

    exe = shutil.which("lmcache", path=os.path.dirname(sys.executable))
    if exe is None:
        raise SystemExit(f"no `lmcache` entry point beside {sys.executable}: install lmcache==0.5.6 into this venv "
                         "(make bench-peers)")
    port, http_port, prom_port = _free_port(), _free_port(), _free_port()
    cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "1",
           "--eviction-policy", "LRU", "--chunk-size", str(CHUNK), "--supported-transfer-mode", "engine_driven",
           "--http-host", "127.0.0.1", "--http-port", str(http_port), "--prometheus-port", str(prom_port)]
    env = {**os.environ, "DO_NOT_TRACK": "1", "LMCACHE_LOG_LEVEL": "WARNING"}
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"lmcache-bench-server-{os.getpid()}.log")
    with open(log_path, "wb") as logf:
        server = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    info = {"version": getattr(lmcache, "__version__", "?"), "transport": "zmq tcp loopback",
            "server_cmd": " ".join(cmd[1:])}
    bench: Bench | None = None
    try:
        t0 = time.perf_counter()
        _wait_healthy(server, http_port, a.start_timeout_s, log_path)
        bench = Bench(port)
        info["start_s"] = time.perf_counter() - t0
        if a.serve:
            print(json.dumps({"ready": True, **info}), flush=True)
            for line in sys.stdin:
                req = json.loads(line)
                try:
                    out: dict[str, Any] = bench.run(req["op"], float(req["duration_s"]), int(req.get("warmup", 0)))
                except Exception as e:  # reported to the parent, which fails the comparison
                    out = {"error": f"{type(e).__name__}: {e}"}
                print(json.dumps(out), flush=True)
        else:
            res = {op: bench.run(op, a.duration_s, a.warmup) for op in ("ping", "lookup")}
            print(json.dumps({**info, **res}), flush=True)
    finally:
        if bench is not None:
            bench.close()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # LMCache's client polling thread is not a daemon thread
