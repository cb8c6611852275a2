"""Soak with a peer: an engine stores on the serving daemon while another engine's daemon pulls
every prompt over NIXL and retrieves it, for ``HKVD_SOAK_SECONDS / 2`` (default 30 s). Both pools
are smaller than what passes through them, so both daemons evict as they go.

Every retrieved byte is compared with the stored one. Both daemons' RSS is sampled from /proc; after
a warm-up the median of the last third of the samples may exceed the first third's by at most
``RSS_DRIFT_LIMIT_MIB``. At the end neither daemon holds a lease, a pin or a half-written entry.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys

SOAK_S = float(os.environ.get("HKVD_SOAK_SECONDS", "60")) / 2
RSS_DRIFT_LIMIT_MIB = 4.0
FULL = [GroupShape("full", 2, 8192)]
CHUNKS = 8


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _drift(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
    warm = max(5.0, SOAK_S / 10)
    steady = [rss for t, rss in samples if t >= warm]
    assert len(steady) >= 9, f"too few RSS samples after the warm-up: {len(steady)}"
    third = len(steady) // 3
    first, last = statistics.median(steady[:third]), statistics.median(steady[-third:])
    return first, last, last - first


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_S) + 240)
def test_peer_soak_keeps_both_daemons_flat_and_exact(pair_factory: Any, lib: Any) -> None:
    prefill, decode = pair_factory(pool_gb="0.0625")  # 64 MiB each; ~256 KiB per prompt
    assert prefill.proc is not None and decode.proc is not None
    producer = SyntheticEngine(prefill.socket_path, FULL, num_blocks=64)
    consumer = SyntheticEngine(decode.socket_path, FULL, num_blocks=64)
    samples: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
    done = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not done.wait(0.5):
            for name, d in (("prefill", prefill), ("decode", decode)):
                samples[name].append((time.monotonic() - t0, _rss_mib(d.proc.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    prompts = pulled = wrong = 0
    try:
        end = time.monotonic() + SOAK_S
        while time.monotonic() < end:
            keys = chunk_keys(prompt_tokens(CHUNKS * producer.chunk_size, seed=prompts), producer.chunk_size)
            stored = producer.items(0, keys, first_block=1)
            producer.fill_random(0, [b for it in stored for b in it.block_ids], seed=prompts)
            producer.store(stored)
            rid = consumer.client.submit_pull(prefill.peer_address, keys)
            res = consumer.client.wait([rid], 60)[rid]
            assert res.error is None, res.error
            assert res.result.hit_chunks == CHUNKS
            loaded = consumer.items(0, keys, first_block=30)
            consumer.retrieve(loaded, res.result.lease_id)  # the retrieve ends the local lease
            for src, dst in zip(stored, loaded, strict=True):
                for b_src, b_dst in zip(src.block_ids, dst.block_ids, strict=True):
                    wrong += consumer.block_bytes(0, b_dst) != producer.block_bytes(0, b_src)
            prompts += 1
            pulled += res.result.pulled
    finally:
        done.set()
        sampler.join(10)
        producer.close()
        consumer.close()

    assert wrong == 0, f"{wrong} blocks came back wrong"
    assert prefill.proc.poll() is None and decode.proc.poll() is None, "a daemon died"
    drifts = {name: _drift(s) for name, s in samples.items()}
    for name, (first, last, drift) in drifts.items():
        assert drift <= RSS_DRIFT_LIMIT_MIB, f"{name} RSS grew {drift:.1f} MiB ({first:.1f} -> {last:.1f})"
    for d in (prefill, decode):
        s = d.wait_status(lambda st: st["index"]["leases"] == 0 and st["index"]["writing"] == 0
                            and st["index"]["pinned_entries"] == 0, 15)
        assert s["engines"] == []
    d_status = decode.status()
    assert d_status["index"]["evictions"] > 0, "the decode pool never turned over: make the soak longer"
    print(f"\nRELIABILITY peer soak: {SOAK_S:.0f} s, {prompts} prompts pulled ({pulled} chunks), "
          f"{prompts * CHUNKS * 2} blocks compared, 0 wrong, decode evictions {d_status['index']['evictions']}, "
          + ", ".join(f"{n} RSS {f:.1f}->{la:.1f} MiB ({dr:+.1f})" for n, (f, la, dr) in drifts.items()))
