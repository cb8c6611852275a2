"""Block tables into items (``hkvd.shim.plans``): full, sliding-window and Mamba groups, loads and stores."""

from __future__ import annotations

from hkvd.shim.plans import load_items, parent, store_items
from hkvd.shim.spec import GroupInfo
from hkvd.transport.wire.kv import Item

C = 32  # chunk: two 16-token blocks
KEYS = [bytes([i]) * 16 for i in range(4)]
FULL = GroupInfo(0, "full", 16, 0)
SWA = GroupInfo(1, "swa", 16, 40)  # a 40-token window
MAMBA = GroupInfo(2, "mamba", 32, 0)  # one block per chunk


def test_parents_chain_the_keys() -> None:
    assert [parent(KEYS, i) for i in range(3)] == [b"", KEYS[0], KEYS[1]]


def test_a_load_names_every_block_of_each_chunk_past_the_local_hit_and_the_mamba_state_at_its_end() -> None:
    table = ([1, 2, 3, 4, 5, 6], [0, 0, 13, 14, 15, 16], [21, 22, 23])
    items, refused = load_items([FULL, SWA, MAMBA], KEYS, 3, 16, table, C)  # vLLM holds the first 16 tokens
    assert not refused
    assert items == [
        Item(0, 0, KEYS[0], [1, 2]), Item(0, 1, KEYS[1], [3, 4]), Item(0, 2, KEYS[2], [5, 6]),  # chunk 0 whole
        Item(1, 1, KEYS[1], [13, 14]), Item(1, 2, KEYS[2], [15, 16]),  # the window needs tokens 56..96 only
        Item(2, 2, KEYS[2], [23]),  # the state after chunk 2
    ]


def test_a_load_that_would_name_the_null_block_is_refused() -> None:
    _, refused = load_items([FULL], KEYS, 2, 0, ([1, 2, 0, 4],), C)
    assert refused
    _, refused = load_items([FULL, MAMBA], KEYS, 2, 0, ([1, 2, 3, 4], [], [21]), C)  # no block for the state
    assert refused


def test_a_store_covers_the_chunks_asked_with_a_key_skipping_null_blocks_and_mamba() -> None:
    table = ([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24])
    items = store_items([FULL, SWA, MAMBA], KEYS[:3], table, 1, 4, C)  # chunk 3 has no key yet
    assert items == [
        Item(0, 1, KEYS[1], [3, 4], KEYS[0]), Item(1, 1, KEYS[1], [13, 14], KEYS[0]),
        Item(0, 2, KEYS[2], [5, 6], KEYS[1]), Item(1, 2, KEYS[2], [15, 16], KEYS[1]),
    ]
    assert store_items([SWA], KEYS, table, 0, 1, C) == []  # out of the window: nothing to store
