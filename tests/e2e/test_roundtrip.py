"""Walking skeleton, end to end: a real daemon process and real engine processes with host memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import LeaseExpired, NotFound, OutOfRange, RegistrationError
from hkvd.transport.keys import chunk_keys


def engine(daemon, **kw) -> SyntheticEngine:
    shapes = kw.pop("shapes", [GroupShape("full", 2, 4096)])
    return SyntheticEngine(daemon.socket_path, shapes, **kw)


def test_store_retrieve_round_trip_is_byte_exact(daemon):
    eng = engine(daemon, num_blocks=64)
    keys = chunk_keys(prompt_tokens(32 * 6, seed=1), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    blocks = [b for it in items for b in it.block_ids]
    eng.fill_random(0, blocks, seed=7)
    before = [eng.block_bytes(0, b) for b in blocks]

    done = eng.store(items)
    assert done.result.stored == len(items)
    # Store again: deduplicated, nothing copied twice.
    assert eng.store(items).result.skipped == len(items)

    hit, lease = eng.lookup(keys)
    assert hit == len(keys) and lease > 0
    target = eng.items(0, keys, first_block=30)  # fresh blocks elsewhere
    tblocks = [b for it in target for b in it.block_ids]
    eng.zero(0, tblocks)
    eng.retrieve(target, lease)
    assert [eng.block_bytes(0, b) for b in tblocks] == before
    eng.close()


def test_second_process_same_layout_hits_and_other_layout_misses(daemon, engine_proc):
    stored = engine_proc(daemon.socket_path, "store", "--tokens", "256", "--seed", "3")
    assert stored["stored"] == 256 // 32
    same = engine_proc(daemon.socket_path, "fetch", "--tokens", "256", "--seed", "3")
    assert same["hit_chunks"] == 8
    assert same["digest"] == stored["digest"]  # bytes came back exactly, in another process
    other_layout = engine_proc(daemon.socket_path, "fetch", "--tokens", "256", "--seed", "3",
                               "--page-bytes", "8192")
    assert other_layout["hit_chunks"] == 0
    other_model = engine_proc(daemon.socket_path, "fetch", "--tokens", "256", "--seed", "3", "--model", "m2")
    assert other_model["hit_chunks"] == 0
    other_prompt = engine_proc(daemon.socket_path, "fetch", "--tokens", "256", "--seed", "4")
    assert other_prompt["hit_chunks"] == 0


def test_prefix_hit_stops_at_first_missing_chunk(daemon):
    eng = engine(daemon)
    keys = chunk_keys(prompt_tokens(32 * 5, seed=2), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    eng.store([items[0], items[1], items[3]])  # chunk 2 missing
    assert eng.lookup(keys, lease=False)[0] == 2
    eng.close()


def test_eviction_under_pressure_keeps_leased_entries(daemon_factory):
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", "32")  # 64 MiB pool
    # 2 layers x 64 KiB pages x 2 blocks per chunk = 256 KiB per entry -> ~256 entries fit.
    eng = SyntheticEngine(d.socket_path, [GroupShape("full", 2, 64 << 10)], num_blocks=32)
    keys = chunk_keys(prompt_tokens(32 * 4, seed=5), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    blocks = [b for it in items for b in it.block_ids]
    eng.fill_random(0, blocks, seed=9)
    before = [eng.block_bytes(0, b) for b in blocks]
    eng.store(items)
    hit, lease = eng.lookup(keys)  # the lease protects these 4 entries
    assert hit == 4
    # Store far more than the pool holds: ~4x capacity of other prefixes.
    for seed in range(100, 100 + 256):
        other = chunk_keys(prompt_tokens(32 * 4, seed=seed), eng.chunk_size)
        eng.store(eng.items(0, other, first_block=1))
    st = d.status()
    assert st["index"]["evictions"] > 0
    eng.zero(0, blocks)
    eng.retrieve(items, lease)  # still all there, byte-exact
    assert [eng.block_bytes(0, b) for b in blocks] == before
    eng.close()


def test_retrieve_of_missing_entry_is_a_typed_error_and_changes_nothing(daemon):
    eng = engine(daemon)
    keys = chunk_keys(prompt_tokens(64, seed=11), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    eng.fill_random(0, [b for it in items for b in it.block_ids], seed=1)
    snapshot = eng.buffer.copy()
    with pytest.raises(NotFound):
        eng.retrieve(items)
    assert np.array_equal(snapshot, eng.buffer)
    eng.close()


def test_out_of_range_and_null_blocks_are_refused(daemon):
    eng = engine(daemon, num_blocks=16)
    keys = chunk_keys(prompt_tokens(32, seed=1), eng.chunk_size)
    from hkvd.transport.wire.kv import Item

    for bad in ([0, 1], [15, 16], [1, 99999]):
        with pytest.raises(OutOfRange):
            eng.store([Item(0, 0, keys[0], bad)])
    with pytest.raises(OutOfRange):
        eng.store([Item(7, 0, keys[0], [1, 2])])  # unregistered group
    with pytest.raises(OutOfRange):
        eng.store([Item(0, 0, keys[0], [1])])  # wrong number of blocks for a chunk
    assert daemon.status()["index"]["entries"] == 0
    eng.close()


def test_views_outside_the_region_are_refused_at_registration(daemon):
    from hkvd.shim.client import DaemonClient
    from hkvd.transport.copy_engine import Region
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire.control import EngineSpec

    buf = np.zeros(1 << 16, dtype=np.int8)
    view = View(0, 0, 2, 1 << 15, 4096, 4096)  # 2 layers x 16 blocks x 4 KiB = 128 KiB > 64 KiB
    spec = EngineSpec("m", 1, 0, "t", 0, 16, 8192, "align", [Region(0, "host", buf.nbytes, addr=buf.ctypes.data)],
                      [GroupSpec(0, "full", 16, 0, 16, "bfloat16", (view,))])
    with DaemonClient(daemon.socket_path, client_name="t", role="worker") as c, pytest.raises(RegistrationError):
        c.register(spec)


def test_expired_lease_is_refused(daemon_factory):
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", "32", "--lease-ttl-s", "0.2")
    eng = SyntheticEngine(d.socket_path, [GroupShape("full", 1, 4096)])
    keys = chunk_keys(prompt_tokens(32, seed=1), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    eng.store(items)
    _, lease = eng.lookup(keys)
    deadline = time.monotonic() + 10
    while d.status()["index"]["leases"] and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(LeaseExpired):
        eng.retrieve(items, lease)
    eng.close()


def test_engine_killed_mid_store_leaves_no_pins_or_leases(daemon):
    proc = subprocess.Popen([sys.executable, "-m", "hkvd.shim.testing.synthetic", "--socket", daemon.socket_path,
                             "store-forever", "--tokens", "1024", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["ready"]
    deadline = time.monotonic() + 20
    while not daemon.status()["engines"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # let stores be in flight
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    st = daemon.status()
    while (st["engines"] or st["index"]["pinned_entries"] or st["index"]["writing"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        st = daemon.status()
    assert st["engines"] == []
    assert st["index"]["pinned_entries"] == 0
    assert st["index"]["writing"] == 0
    assert st["index"]["leases"] == 0


def test_sigterm_exits_zero_and_removes_the_socket(daemon):
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket_path)


def test_a_client_that_half_closes_still_gets_its_replies(daemon):
    """EOF from the client ends its requests, not its replies: jobs in flight answer, then the daemon closes."""
    import socket

    eng = engine(daemon, shapes=[GroupShape("full", 1, 1 << 20)], num_blocks=24)  # 16 MiB: a threaded copy
    keys = chunk_keys(prompt_tokens(32 * 8, seed=5), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    eng.fill_random(0, [b for it in items for b in it.block_ids], seed=2)
    req = eng.client.submit_store(items)
    assert eng.client._conn.sock is not None
    eng.client._conn.sock.shutdown(socket.SHUT_WR)
    done = eng.client.wait([req], 30.0)[req]
    assert done.ok and done.result.stored == len(items)
    deadline = time.monotonic() + 10.0
    while eng.client.connected and time.monotonic() < deadline:  # then the daemon closes its side
        eng.client.poll(0.5)
    assert not eng.client.connected
    other = engine(daemon, shapes=[GroupShape("full", 1, 1 << 20)], num_blocks=24)
    assert other.lookup(keys)[0] == len(keys)
