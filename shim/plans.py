# SPDX-License-Identifier: Apache-2.0
"""Block tables into items: which blocks of which group a load fills and a store copies out.

Role
    Pure functions for the scheduler side (``hkvd.shim.scheduler``): given vLLM's block table of a
    request, its chunk keys and its KV-cache groups (``hkvd.shim.spec.GroupInfo``), name the wire
    ``Item`` of each chunk and group. No state, no I/O.

Contracts
    - A chunk spans ``chunk_size // group.block_size`` blocks of an attention group; a Mamba group's
      chunk is the one block holding the state after the chunk's last token.
    - Block id 0 is vLLM's null block (out of a sliding window, or never allocated): a store skips
      such a chunk; a load that would name it is refused whole (``load_items`` says so).
"""

from __future__ import annotations

from collections.abc import Sequence

from hkvd.shim.spec import GroupInfo
from hkvd.transport.wire.kv import Item


def parent(keys: list[bytes], i: int) -> bytes:
    """The parent key the daemon's chain tracker uses (chunk 0 has none)."""
    return keys[i - 1] if i else b""


def store_items(groups: list[GroupInfo], keys: list[bytes], table: Sequence[Sequence[int]], lo: int, hi: int,
                chunk_size: int) -> list[Item]:
    """Store items for chunks [lo, hi) of every attention group that has a key, from block table ``table``."""
    items: list[Item] = []
    for i in range(lo, min(hi, len(keys))):
        for g in groups:
            if g.kind == "mamba":
                continue
            bpe = chunk_size // g.block_size
            ids = list(table[g.group_id][i * bpe:(i + 1) * bpe])
            # Sliding-window blocks out of the window are already null: nothing to store.
            if len(ids) == bpe and 0 not in ids:
                items.append(Item(g.group_id, i, keys[i], ids, parent(keys, i)))
    return items


def load_items(groups: list[GroupInfo], keys: list[bytes], n: int, local_tokens: int,
               block_ids: Sequence[Sequence[int]], chunk_size: int) -> tuple[list[Item], bool]:
    """(items, refused) to load chunks [0, n) past the ``local_tokens`` vLLM's own cache holds.

    A chunk partly covered by the local hit is loaded whole: vLLM's local hit is block-aligned, not
    chunk-aligned, and an item names every block of its chunk (the overwritten local blocks receive
    the same prefix's bytes before any forward reads them). Sliding-window groups load only the
    chunks the window still needs; a Mamba group the state after chunk ``n - 1``. ``refused`` is True
    when an item would name the null block."""
    C = chunk_size
    hit = n * C
    first = local_tokens // C
    items: list[Item] = []
    bad = False
    for g in groups:
        ids = block_ids[g.group_id]
        if g.kind == "mamba":
            idx = hit // g.block_size - 1
            blk = ids[idx] if idx < len(ids) else 0
            bad |= blk == 0
            items.append(Item(g.group_id, n - 1, keys[n - 1], [blk]))
            continue
        bpe = C // g.block_size
        lo = first
        if g.kind == "swa":
            lo = max(lo, max(0, hit - g.window_tokens) // C)
        for i in range(lo, n):
            chunk_ids = list(ids[i * bpe:(i + 1) * bpe])
            if len(chunk_ids) != bpe or 0 in chunk_ids:
                bad = True
            items.append(Item(g.group_id, i, keys[i], chunk_ids))
    return items, bad


def split_verified(items: list[Item], verify_upto: int) -> tuple[list[Item], list[Item]]:
    """(to store, to verify): a sampled hit's chunks below ``verify_upto`` are in the daemon already, so
    the engine's recomputed copies are compared with them instead of stored (``hkvd.shim.verify``)."""
    return ([it for it in items if it.chunk_index >= verify_upto],
            [it for it in items if it.chunk_index < verify_upto])
