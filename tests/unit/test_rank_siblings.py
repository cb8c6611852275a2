"""Tensor-parallel siblings in the index: evicting one rank's entry of a chunk takes the other ranks'
entries of that chunk (and the Mamba states at its boundary) with it, since no hit can use them alone.
A Mamba state still pending confirmation goes with its chunk too."""

from __future__ import annotations

import pytest

from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.pool import HugePagePool

SB = 32 << 20
ENTRY = 4 << 20  # 16 entries fill the two-superblock pool
R0, R1, OTHER = b"0" * 16, b"1" * 16, b"x" * 16
CHUNK = b"c" * 16


@pytest.fixture
def pool():
    p = HugePagePool(2 * SB, "off", superblock_bytes=SB)
    yield p
    p.close()


def _write(index: Index, key: tuple[bytes, int, bytes], kind: str) -> None:
    e = index.begin_write(key, ENTRY, kind, 1)
    assert e is not None
    index.finish_write(e, pending=False)


def _fill(index: Index) -> list[tuple[bytes, int, bytes]]:
    """Both ranks' attention entry and Mamba state of CHUNK first (oldest), then another layout's entries."""
    for fp in (R0, R1):
        index.set_groups(fp, {0: "full", 1: "mamba"})
    chunk = [(R0, 0, CHUNK), (R1, 0, CHUNK), (R0, 1, CHUNK), (R1, 1, CHUNK)]
    for k in chunk:
        _write(index, k, "full" if k[1] == 0 else "mamba")
    for i in range(12):
        _write(index, (OTHER, 0, i.to_bytes(16, "little")), "full")
    return chunk


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_evicting_one_rank_takes_the_chunk_on_every_rank(pool, policy):
    index = Index(pool, make_policy(policy))
    index.set_ranks((R0, R1))
    chunk = _fill(index)
    _write(index, (OTHER, 0, b"n" * 16), "full")  # the pool is full: LRU evicts rank 0's chunk entry
    assert all(index.get(k) is None for k in chunk)  # its sibling and both boundary states went with it
    for i in range(3):  # the room of all four is free: no other entry had to go
        _write(index, (OTHER, 0, (100 + i).to_bytes(16, "little")), "full")
    assert all(index.get((OTHER, 0, i.to_bytes(16, "little"))) is not None for i in range(12))


def test_a_leased_sibling_stays_until_released(pool):
    index = Index(pool, make_policy("hybrid"))
    index.set_ranks((R0, R1))
    chunk = _fill(index)
    lease = index.leases.take([(R1, 0, CHUNK)], owner=1, ttl_s=60)
    _write(index, (OTHER, 0, b"n" * 16), "full")
    assert index.get((R0, 0, CHUNK)) is None
    assert index.get((R1, 0, CHUNK)) is not None  # leased: kept (a retrieve may be reading it)
    assert index.get(chunk[2]) is None and index.get(chunk[3]) is None
    index.leases.release(lease)


def test_without_ranks_other_layouts_are_untouched(pool):
    index = Index(pool, make_policy("lru"))
    chunk = _fill(index)  # R0 and R1 are two unrelated layouts here
    _write(index, (OTHER, 0, b"n" * 16), "full")
    assert index.get(chunk[0]) is None and index.get(chunk[1]) is not None


def test_a_pending_state_goes_with_its_evicted_chunk_and_is_never_confirmed_after(pool):
    index = Index(pool, make_policy("hybrid"))
    index.set_groups(R0, {0: "full", 1: "mamba"})
    attn = index.begin_write((R0, 0, CHUNK), ENTRY, "full", 1)
    state = index.begin_write((R0, 1, CHUNK), ENTRY, "mamba", 2)
    assert attn is not None and state is not None
    index.finish_write(attn, pending=False)
    index.finish_write(state, pending=True)  # copied, not yet confirmed by its engine
    for i in range(14):
        _write(index, (OTHER, 0, i.to_bytes(16, "little")), "full")
    free_before = pool.statistics().free_bytes
    _write(index, (OTHER, 0, b"n" * 16), "full")  # evicts the attention chunk, the oldest READY entry
    assert index.get((R0, 0, CHUNK)) is None and index.get((R0, 1, CHUNK)) is None
    assert pool.statistics().free_bytes == free_before + ENTRY  # both freed, one taken by the new entry
    assert not index.confirm(state)  # a late confirmation changes nothing
    assert index.get((R0, 1, CHUNK)) is None
