"""Tensor-parallel engines against a real daemon: every rank hits, or none does.

Two synthetic engine ranks (world size 2, same format) stand for one TP=2 engine's workers. A lookup
answers the hit that every rank can serve and leases every rank's entries under one lease, which
serves one retrieve per rank.
"""

from __future__ import annotations

import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import LeaseExpired, OutOfRange
from hkvd.transport.keys import chunk_keys

SHAPES = [GroupShape("full", 2, 4096), GroupShape("mamba", 1, 8192)]


def ranks(daemon, world: int = 2) -> list[SyntheticEngine]:
    return [SyntheticEngine(daemon.socket_path, SHAPES, world_size=world, rank=r) for r in range(world)]


def store(eng: SyntheticEngine, keys: list[bytes], chunks: list[int], seed: int) -> None:
    attn = eng.items(0, keys, first_block=1, chunks=chunks)
    states = eng.items(1, keys, first_block=1, chunks=chunks)
    eng.fill_random(0, [b for it in attn for b in it.block_ids], seed=seed)
    eng.fill_random(1, [b for it in states for b in it.block_ids], seed=seed + 1)
    eng.store(attn + states)


def test_the_hit_is_the_minimum_over_ranks_and_one_lease_serves_each_rank(daemon):
    r0, r1 = ranks(daemon)
    assert r0.fingerprint != r1.fingerprint  # each rank's shards are its own entries
    keys = chunk_keys(prompt_tokens(r0.chunk_size * 4, seed=3), r0.chunk_size)
    store(r0, keys, [0, 1, 2, 3], seed=10)
    store(r1, keys, [0, 1], seed=20)
    assert r0.lookup(keys, lease=False)[0] == 2  # rank 1 holds only two chunks (and their states)
    assert r1.lookup(keys, lease=False)[0] == 2  # the same answer from either rank
    store(r1, keys, [2, 3], seed=30)

    hit, lease = r0.lookup(keys)
    assert hit == 4
    expect = {}
    for r in (r0, r1):
        items = r.items(0, keys, first_block=1) + r.items(1, keys, first_block=1, chunks=[3])
        expect[r.spec.rank] = [r.block_bytes(it.group_id, b) for it in items for b in it.block_ids]
        for it in items:
            r.zero(it.group_id, it.block_ids)
    for r in (r0, r1):  # each rank loads its own entries with the one lease
        items = r.items(0, keys, first_block=1) + r.items(1, keys, first_block=1, chunks=[3])
        r.retrieve(items, lease)
        assert [r.block_bytes(it.group_id, b) for it in items for b in it.block_ids] == expect[r.spec.rank]
    with pytest.raises(LeaseExpired):  # one use per rank: spent
        r0.retrieve(r0.items(0, keys, first_block=1, chunks=[0]), lease)
    for r in (r0, r1):
        r.close()


def test_a_rank_that_never_stored_makes_no_hit(daemon):
    r0, r1 = ranks(daemon)
    keys = chunk_keys(prompt_tokens(r0.chunk_size * 3, seed=4), r0.chunk_size)
    store(r0, keys, [0, 1, 2], seed=1)
    r1.close()  # rank 1 died before its stores: no chunk is visible with rank 0's entries alone
    assert r0.lookup(keys, lease=False)[0] == 0
    r0.close()


def test_a_rank_cut_off_mid_store_never_leaves_a_one_rank_chunk_visible(daemon):
    r0, r1 = ranks(daemon)
    keys = chunk_keys(prompt_tokens(r0.chunk_size * 4, seed=12), r0.chunk_size)
    store(r0, keys, [0, 1, 2, 3], seed=1)
    store(r1, keys, [0, 1], seed=2)
    late = r1.items(0, keys, first_block=1, chunks=[2, 3]) + r1.items(1, keys, first_block=1, chunks=[2, 3])
    r1.client.submit_store(late)
    r1.close()  # its connection goes while that store may still be running
    hit, lease = r0.lookup(keys)
    assert hit in (2, 4)  # what rank 1 finished, never rank 0's chunks alone
    again = SyntheticEngine(daemon.socket_path, SHAPES, world_size=2, rank=1)  # rank 1 restarted
    items = again.items(0, keys, first_block=1, chunks=list(range(hit))) + again.items(1, keys, first_block=1,
                                                                                       chunks=[hit - 1])
    again.retrieve(items, lease)  # every chunk of the hit is there for rank 1, byte-exact
    assert all(again.block_bytes(it.group_id, b) == r1.block_bytes(it.group_id, b)
               for it in items for b in it.block_ids)
    for r in (r0, again):
        r.close()


def test_a_lease_serves_only_the_entries_it_was_granted_for(daemon):
    r0, r1 = ranks(daemon)
    keys = chunk_keys(prompt_tokens(r0.chunk_size * 3, seed=5), r0.chunk_size)
    other = chunk_keys(prompt_tokens(r0.chunk_size * 3, seed=6), r0.chunk_size)
    for r in (r0, r1):
        store(r, keys, [0, 1, 2], seed=7)
        store(r, other, [0, 1, 2], seed=8)
    hit, lease = r0.lookup(keys[:2])
    assert hit == 2
    with pytest.raises(OutOfRange, match="does not cover"):
        r1.retrieve(r1.items(0, other, first_block=1, chunks=[0]), lease)
    with pytest.raises(OutOfRange, match="does not cover"):
        r1.retrieve(r1.items(0, keys, first_block=1, chunks=[2]), lease)  # a chunk past the hit
    r1.retrieve(r1.items(0, keys, first_block=1, chunks=[0, 1]), lease)  # the lease still serves
    for r in (r0, r1):
        r.close()


def test_lease_ids_are_not_sequential(daemon):
    (r0,) = ranks(daemon, world=1)
    keys = chunk_keys(prompt_tokens(r0.chunk_size, seed=9), r0.chunk_size)
    store(r0, keys, [0], seed=1)
    ids = {r0.lookup(keys)[1] for _ in range(8)}
    assert len(ids) == 8 and all(i > 1 << 20 for i in ids)  # random 63-bit ids, not 1, 2, 3...
    r0.close()
