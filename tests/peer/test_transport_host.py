"""The transport host (``hkvd.transport.nixl.hosted``): a crash of the NIXL agent's process, on either side
of a pull, never takes a daemon down. A SIGSEGV is delivered to the host in the middle of a READ (the
serving host is frozen with SIGSTOP first, which holds a READ over TCP mid-way): the pull fails
within its timeout and the engine recomputes, nothing half-read becomes visible, every page is
freed, the daemon keeps serving its engines, the host restarts, and the next pull over the same
link is byte-exact (the link reloads the restarted agent's metadata by itself).

The misrouted peer that crashed UCX for real is in tests/peer/test_netns.py (three namespaces)."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import CopyFailedError, DaemonUnavailable
from hkvd.transport.keys import chunk_keys

BIG = [GroupShape("full", 2, 64 << 10)]  # 256 KiB per chunk
CHUNKS = 256  # 64 MiB: long enough to freeze mid-way
NUM_BLOCKS = 2 * CHUNKS + 2


def _store(daemon: Any, seed: int) -> tuple[SyntheticEngine, list[bytes]]:
    eng = SyntheticEngine(daemon.socket_path, BIG, num_blocks=NUM_BLOCKS, timeout_s=60)
    eng.buffer[:] = np.random.default_rng(seed).integers(-128, 128, eng.buffer.size, dtype=np.int8)
    keys = chunk_keys(prompt_tokens(32 * CHUNKS, seed=seed), eng.chunk_size)
    assert eng.store(eng.items(0, keys, first_block=1)).result.stored == CHUNKS
    return eng, keys


def _host(daemon: Any) -> int:
    pid = daemon.wait_status(lambda s: s["peer"]["transport"]["host_pid"] != 0, 60, poll_s=0.05)["peer"]
    return int(pid["transport"]["host_pid"])


def _pull_exact(consumer: SyntheticEngine, producer: SyntheticEngine, peer: str, keys: list[bytes]) -> None:
    rid = consumer.client.submit_pull(peer, keys)
    c = consumer.client.wait([rid], 60)[rid]
    assert c.ok, c.error
    hit, lease = consumer.lookup(keys)
    assert hit == len(keys)
    items = consumer.items(0, keys, first_block=1)
    consumer.retrieve(items, lease)
    for it in items:
        for b in it.block_ids:
            assert consumer.block_bytes(0, b) == producer.block_bytes(0, b)


def _crash_mid_read(prefill: Any, decode: Any, consumer: SyntheticEngine, keys: list[bytes], victim: Any) -> Any:
    """Pull, freeze the serving host once the READ runs, SIGSEGV ``victim``'s host; the completion."""
    serving_host, victim_host = _host(prefill), _host(victim)
    rid = consumer.client.submit_pull(prefill.peer_address, keys)
    decode.wait_status(lambda s: s["peer"]["transport"]["in_flight"] >= 1, 30, poll_s=0.002)
    os.kill(serving_host, signal.SIGSTOP)
    try:
        assert decode.status()["peer"]["transport"]["in_flight"] >= 1, "the READ finished before SIGSTOP"
        os.kill(victim_host, signal.SIGSEGV)
    finally:
        os.kill(serving_host, signal.SIGCONT)
    return consumer.client.wait([rid], 30)[rid]


def _check_recovered(prefill: Any, decode: Any, victim: Any, producer: SyntheticEngine,
                     consumer: SyntheticEngine, keys: list[bytes]) -> None:
    assert prefill.proc.poll() is None and decode.proc.poll() is None
    s = decode.wait_status(lambda s: s["index"]["entries"] == 0, 30)
    assert s["index"]["writing"] == 0 and s["pool"]["used_bytes"] == 0 and s["peer"]["quarantined_entries"] == 0
    assert consumer.lookup(keys)[0] == 0  # nothing half-read is visible: the engine recomputed
    # The victim counted and logged the crash, and restarted its host.
    v = victim.wait_status(lambda s: s["peer"]["transport"]["host_restarts"] == 1
                           and s["peer"]["transport"]["host_pid"] != 0, 60)
    assert v["counters"].get("peer_transport_crashes") == 1
    assert "died with signal SIGSEGV" in victim.log_path.read_text()
    # The serving daemon still serves its own engine ...
    hit, lease = producer.lookup(keys)
    assert hit == CHUNKS
    producer.retrieve(producer.items(0, keys, first_block=1), lease)
    # ... and the next pull over the same link is byte-exact.
    _host(prefill)
    _pull_exact(consumer, producer, prefill.peer_address, keys)


def test_serving_host_crash_mid_read(pair_factory: Any) -> None:
    prefill, decode = pair_factory(pull_args=("--peer-pull-timeout-s", "10"))
    producer, keys = _store(prefill, seed=1)
    consumer = SyntheticEngine(decode.socket_path, BIG, num_blocks=NUM_BLOCKS, timeout_s=60)
    c = _crash_mid_read(prefill, decode, consumer, keys, victim=prefill)
    assert isinstance(c.error, CopyFailedError | DaemonUnavailable), c.error
    _check_recovered(prefill, decode, prefill, producer, consumer, keys)


def test_pulling_host_crash_mid_read(pair_factory: Any) -> None:
    prefill, decode = pair_factory(pull_args=("--peer-pull-timeout-s", "10"))
    producer, keys = _store(prefill, seed=2)
    consumer = SyntheticEngine(decode.socket_path, BIG, num_blocks=NUM_BLOCKS, timeout_s=60)
    c = _crash_mid_read(prefill, decode, consumer, keys, victim=decode)
    assert isinstance(c.error, CopyFailedError), c.error
    assert "transport host died (signal SIGSEGV)" in c.error.message
    _check_recovered(prefill, decode, decode, producer, consumer, keys)
