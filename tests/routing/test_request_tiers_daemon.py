"""A request's load and store tiers on a real daemon with a disk tier (docs/hints.md, "Load and store tiers").

A synthetic engine stores one prompt with every tier and another with its store tiers limited to the pool;
the daemon is stopped and a second one starts on the same disk directory, so its pool is empty and the first
prompt is on disk only. A lookup whose load tiers are the pool alone misses that prompt, which a default lookup
hits (read back from the disk); the pool-only store was never written to the disk. The counts show on
``hkvd status`` and ``/metrics``.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys
from hkvd.transport.tier_matchers import CLUSTER, DISK
from hkvd.transport.wire.kv import LookupReply, StoreResult

C = 16
CHUNKS = 6
SHAPES = [GroupShape("full", 2, 64 << 10)]
KW = {"num_blocks": 2 * CHUNKS + 2, "tokens_per_block": C, "chunk_size": C, "model": "/models/tiny-tiers"}
POOL_ONLY = DISK | CLUSTER  # kv_*_tiers [{"medium": "cpu", "locality": "local"}]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lookup(eng: SyntheticEngine, keys: list[bytes], skip: int = 0) -> int:
    reply = eng.run(eng.client.submit_lookup(keys, lease=False, skip_tiers=skip)).get(LookupReply)
    return reply.hit_chunks


def test_pool_only_loads_miss_the_disk_and_pool_only_stores_skip_it(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    l2 = tmp_path / "l2"
    args = ("--l1-size-gb", "0.0625", "--chunk-size", str(C), "--l2-path", str(l2), "--l2-size-gb", "1")
    first = daemon_factory(*args, name="first")
    eng = SyntheticEngine(first.socket_path, SHAPES, **KW)
    on_disk = chunk_keys(prompt_tokens(CHUNKS * C + 1, seed=11), C)
    pool_only = chunk_keys(prompt_tokens(CHUNKS * C + 1, seed=12), C)
    try:
        stored = eng.store(eng.items(0, on_disk, first_block=1)).get(StoreResult)
        assert stored.stored == CHUNKS
        items = eng.items(0, pool_only, first_block=1)
        kept = eng.run(eng.client.submit_store(items, skip_tiers=POOL_ONLY)).get(StoreResult)
        assert kept.stored == CHUNKS  # in the pool, as asked
        assert lookup(eng, pool_only) == CHUNKS
        deadline = time.monotonic() + 30
        while (status := eng.client.status())["l2"]["queued"] or status["l2"]["entries"] < CHUNKS:
            assert time.monotonic() < deadline, "the disk tier did not write the first prompt"
            time.sleep(0.02)
        assert status["l2"]["entries"] == CHUNKS  # the first prompt's chunks only
        assert status["keeping"]["tiers_left_out"] == {"l2": CHUNKS}
        assert status["keeping"]["stores"] == {"stored": 2 * CHUNKS}
    finally:
        eng.close()
    first.stop()  # SIGTERM: the disk tier's queue is flushed

    port = free_port()
    second = daemon_factory(*args, "--metrics-port", str(port), name="second")
    eng = SyntheticEngine(second.socket_path, SHAPES, **KW)
    try:
        assert lookup(eng, on_disk, skip=POOL_ONLY) == 0  # on disk only: a miss for a pool-only request
        assert eng.client.status()["counters"].get("l2_hits", 0) == 0  # and nothing was read for it
        assert lookup(eng, on_disk) == CHUNKS  # a default request hits it, read back from the disk
        assert lookup(eng, pool_only) == 0  # never written to the disk
        status = eng.client.status()
        assert status["counters"]["l2_hits"] == CHUNKS
        assert status["counters"]["lookup_tiers_left_out"] == 2  # the pool-only lookup left disk and cluster out
    finally:
        eng.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'hkvd_lookup_tiers_left_out_total{tier="disk"} 1.0' in text
    assert 'hkvd_lookup_tiers_left_out_total{tier="cluster"} 1.0' in text
    assert "hkvd_pool_hits_per_byte 0.0" in text  # nothing retrieved yet
