"""Control-plane load worker: ``threads`` synthetic engines (one connection each) in one process.

Protocol on stdin/stdout, JSON lines: first ``{"socket", "threads", "seed"}``, answered by
``{"ready": true}`` once every engine registered and stored its fixtures; then one
``{"op", "duration_s"}`` per measurement, answered by ``{"op", "n", "elapsed_s", "lat_us": [...]}``
(closed loop: each engine issues its next request when the previous one completed). EOF ends it.

Ops: ``lookup`` (4 stored chunk keys, no lease), ``lookup_lease`` (what a scheduler does per
request: chunk keys from the 64 prompt tokens, lookup with a lease, release it: the like-for-like
of LMCache's lookup + prefetch status + lock release), ``store`` (one fresh 4 KiB chunk),
``retrieve`` (one stored 4 KiB chunk, no lease), ``ping``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

PAGE = 4096
CHUNK = 16
MAX_SAMPLES = 20_000  # per engine and op


def _one(eng: SyntheticEngine, op: str, tokens: list[int], keys: list[bytes], stored: list[Item]) -> None:
    if op == "lookup":
        hit, _ = eng.lookup(keys, lease=False)
        if hit != len(keys):
            raise RuntimeError(f"lookup hit {hit} of {len(keys)} stored chunks")
    elif op == "lookup_lease":
        hit, lease_id = eng.lookup(chunk_keys(tokens, CHUNK), lease=True)
        if hit != len(keys) or not lease_id:
            raise RuntimeError(f"lookup hit {hit} of {len(keys)} stored chunks (lease {lease_id})")
        eng.client.release(lease_id)
    elif op == "store":
        eng.store([Item(0, 0, os.urandom(16), [2])])
    elif op == "retrieve":
        eng.retrieve(stored)
    elif op == "ping":
        eng.client.ping()
    else:
        raise ValueError(op)


def main() -> int:
    init = json.loads(sys.stdin.readline())
    n = int(init["threads"])
    engines = [SyntheticEngine(init["socket"], [GroupShape("full", 1, PAGE)], num_blocks=8, tokens_per_block=16,
                               chunk_size=CHUNK, model="bench-cp", timeout_s=30.0) for _ in range(n)]
    fixtures = []
    for i, eng in enumerate(engines):
        tokens = [int(b) + 4 for b in os.urandom(4 * CHUNK)]
        keys = chunk_keys(tokens, CHUNK)
        items = [Item(0, c, k, [c + 1]) for c, k in enumerate(keys)]
        eng.fill_random(0, [1, 2, 3, 4], seed=i)
        eng.store(items)
        fixtures.append((tokens, keys, items))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op, duration = req["op"], float(req["duration_s"])
        # The store op's fresh chunks fill the pool and LRU evicts the least recently used: the
        # fixtures, unleased, can be among them. Store them again (present ones are skipped).
        for eng, (_tokens, _keys, items) in zip(engines, fixtures, strict=True):
            eng.store(items)
        lat: list[list[float]] = [[] for _ in engines]
        counts = [0] * n
        errors: list[str] = []
        start = threading.Barrier(n + 1, timeout=30.0)

        def loop(i: int, op: str = op, duration: float = duration, lat: list[list[float]] = lat,
                 counts: list[int] = counts, errors: list[str] = errors,
                 start: threading.Barrier = start) -> None:
            eng = engines[i]
            tokens, keys, items = fixtures[i]
            stored = items[:1]
            mine = lat[i]
            try:
                start.wait()
                end = time.perf_counter() + duration
                while True:
                    t0 = time.perf_counter()
                    if t0 >= end:
                        break
                    _one(eng, op, tokens, keys, stored)
                    if len(mine) < MAX_SAMPLES:
                        mine.append((time.perf_counter() - t0) * 1e6)
                    counts[i] += 1
            except Exception as e:  # reported to the parent, which fails the run
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(duration + 30.0)
        elapsed = time.perf_counter() - t0
        out: dict[str, Any] = {"op": op, "n": sum(counts), "elapsed_s": elapsed,
                               "lat_us": [x for xs in lat for x in xs]}
        if errors:
            out["error"] = errors[0]
        print(json.dumps(out), flush=True)
    for eng in engines:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
