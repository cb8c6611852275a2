"""A serving daemon that dies or stalls in the middle of a pull: the pull ends in an error within its
timeout, nothing half-read ever becomes visible, and every local entry is freed (at once when its
READ failed, after its READ ends when it had to be abandoned while running).

The serving daemon and its transport host are frozen with SIGSTOP once the READ is in flight: over TCP
the READ is driven by the target's progress thread, so a stopped target holds it mid-way
deterministically."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import CopyFailedError, DaemonUnavailable, KVTimeout
from hkvd.transport.keys import chunk_keys

# 512 chunks of 256 KiB (2 blocks x 2 layers x 64 KiB): a 128 MiB pull, long enough to freeze mid-way.
BIG = [GroupShape("full", 2, 64 << 10)]
CHUNKS = 512
NUM_BLOCKS = 2 * CHUNKS + 2


def _producer(prefill: Any, seed: int) -> tuple[SyntheticEngine, list[bytes]]:
    eng = SyntheticEngine(prefill.socket_path, BIG, num_blocks=NUM_BLOCKS, timeout_s=60)
    eng.buffer[:] = np.random.default_rng(seed).integers(-128, 128, eng.buffer.size, dtype=np.int8)
    keys = chunk_keys(prompt_tokens(32 * CHUNKS, seed=seed), eng.chunk_size)
    assert eng.store(eng.items(0, keys, first_block=1)).result.stored == CHUNKS
    return eng, keys


def _freeze_mid_read(lib: Any, prefill: Any, decode: Any, consumer: SyntheticEngine, keys: list[bytes]) -> int:
    """Submit a pull and SIGSTOP the serving daemon (and its transport host) while its READ runs; returns
    the pull's req_id."""
    rid = consumer.client.submit_pull(prefill.peer_address, keys)
    decode.wait_status(lambda s: s["peer"]["transport"]["in_flight"] >= 1, 30, poll_s=0.002)
    lib.freeze(prefill)
    return rid


def _frozen_in_time(decode: Any) -> bool:
    return decode.status()["peer"]["transport"]["in_flight"] >= 1


def test_serving_daemon_killed_mid_read(pair_factory: Any, lib: Any) -> None:
    prefill, decode = pair_factory(pool_gb="0.25", pull_args=("--peer-pull-timeout-s", "20"))
    _, keys = _producer(prefill, seed=1)
    consumer = SyntheticEngine(decode.socket_path, BIG, num_blocks=NUM_BLOCKS, timeout_s=60)
    rid = _freeze_mid_read(lib, prefill, decode, consumer, keys)
    if not _frozen_in_time(decode):  # the READ beat the signal on a fast machine
        pytest.fail("the 128 MiB READ finished before SIGSTOP; enlarge CHUNKS for this machine")
    prefill.kill()  # SIGKILL: its sockets reset, UCX reports the peer gone

    c = consumer.client.wait([rid], 30)[rid]
    assert not c.ok
    assert isinstance(c.error, CopyFailedError | DaemonUnavailable), c.error
    # Every entry the pull allocated is gone; nothing of it is visible.
    s = decode.wait_status(lambda s: s["index"]["entries"] == 0, 20)
    assert s["index"]["writing"] == 0 and s["pool"]["used_bytes"] == 0 and s["peer"]["quarantined_entries"] == 0
    t = s["peer"]["transport"]
    # The pull READs in batches; those still running when the peer died failed (one that completed
    # before the kill was discarded with the rest: nothing was published).
    assert t["reads_failed"] >= 1 and t["in_flight"] == 0
    assert consumer.lookup(keys) == (0, 0)


def test_stalled_serving_daemon_times_out_then_the_read_is_discarded(pair_factory: Any, lib: Any) -> None:
    prefill, decode = pair_factory(pool_gb="0.25", pull_args=("--peer-pull-timeout-s", "4"))
    producer, keys = _producer(prefill, seed=2)
    consumer = SyntheticEngine(decode.socket_path, BIG, num_blocks=NUM_BLOCKS, timeout_s=60)
    rid = _freeze_mid_read(lib, prefill, decode, consumer, keys)
    try:
        if not _frozen_in_time(decode):
            pytest.fail("the 128 MiB READ finished before SIGSTOP; enlarge CHUNKS for this machine")
        c = consumer.client.wait([rid], 30)[rid]
        assert isinstance(c.error, KVTimeout), c.error
        # A READ cannot be cancelled: the destination of each batch still running stays allocated,
        # WRITING and invisible (a first batch that completed before SIGSTOP was freed at once).
        s = decode.status()
        assert 0 < s["peer"]["quarantined_entries"] == s["index"]["writing"] <= CHUNKS
        assert s["index"]["ready"] == 0 and consumer.lookup(keys)[0] == 0
    finally:
        lib.thaw(prefill)
    # The READ ends once the target runs again; its bytes are discarded, never published.
    s = decode.wait_status(lambda s: s["peer"]["quarantined_entries"] == 0 and s["index"]["entries"] == 0, 60)
    assert s["pool"]["used_bytes"] == 0 and consumer.lookup(keys)[0] == 0
    # The link serves the next pull, with exact bytes.
    rid = consumer.client.submit_pull(prefill.peer_address, keys)
    res = consumer.client.wait([rid], 60)[rid]
    assert res.ok, res.error
    assert res.result.hit_chunks == CHUNKS
    hit, lease = consumer.lookup(keys)
    consumer.retrieve(consumer.items(0, keys, first_block=1), lease)
    assert hit == CHUNKS and _loaded_blocks(consumer) == _loaded_blocks(producer)


def _loaded_blocks(eng: SyntheticEngine) -> list[bytes]:
    """Bytes of blocks 1 .. 2*CHUNKS of every layer (the blocks the items name)."""
    v = eng.groups[0].views[0]
    return [eng.buffer[v.offset + layer * v.layer_stride + v.block_stride:
                       v.offset + layer * v.layer_stride + (2 * CHUNKS + 1) * v.block_stride].tobytes()
            for layer in range(v.num_layers)]
