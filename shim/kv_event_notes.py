# SPDX-License-Identifier: Apache-2.0
"""vLLM's names of the chunks the shim stores: the notes KV events are published from (docs/routing.md).

Role
    Routers learn what a node holds from vLLM's KV events, which name blocks by vLLM's block
    hashes (``request.block_hashes``), not by hkvd's chunk keys. With each chunk it stores, the
    scheduler side sends the daemon a ``BlockNote`` (``hkvd.transport.wire.block_notes``) holding
    what vLLM's own ``BlockStored`` for those blocks holds: the hash of each block of the chunk (at
    the group's block size, as vLLM resolves it from the hash block size), the parent block's hash,
    the token ids, the extra keys of each block and the LoRA adapter. Hashes are converted exactly as
    vLLM converts them for its events (``maybe_convert_block_hash``: the low 64 bits as an integer
    under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its default, else the bytes), in this process, so
    they follow the engine's own setting.

Tenants
    vLLM's own events list a request's ``cache_salt`` among the first block's extra keys. A note
    never does: the daemon announces chunks node-wide, to every subscriber, so a salted chunk is
    named only by the hashes vLLM computed with the salt, which nobody without the salt can match.

Partial chunks
    A partial chunk (``hkvd.shim.partial``) ending at a multiple of vLLM's ``prefix_match_unit`` h < N
    gets the note vLLM's own partial entry there gets: one block of h tokens ending at the position,
    under vLLM's hash of that prefix (``partial_note``). A turn that ended between two multiples has no
    vLLM hash, and so no note: no event names it.

Threading
    vLLM's scheduler thread (the scheduler side's hooks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hkvd.transport.wire.block_notes import BlockNote, ExtraKey

if TYPE_CHECKING:  # vLLM's type, for annotations only
    from vllm.v1.request import Request

SALT_TAG = "cache_salt"


def _may_have_extras(request: Request) -> bool:
    return bool(getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None)


class NoteMaker:
    """Notes for the chunks of requests; ``hash_block_size`` is vLLM's (the size ``block_hashes`` use)."""

    def __init__(self, block_size: int, hash_block_size: int | None = None) -> None:
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        self.skipped = 0  # chunks with no note (hashes not computed yet, or a block size vLLM does not hash at)
        self.partial_skipped = 0  # partial chunks with no note (no vLLM hash ends where they end)

    def note(self, request: Request, key: bytes, chunk: int, chunk_size: int) -> BlockNote | None:
        """The note of chunk ``chunk`` (``chunk_size`` tokens, key ``key``) of ``request``; None when vLLM
        has not hashed all of its blocks."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        n, h = self.block_size, self.hash_block_size
        if n % h or chunk_size % n:
            self.skipped += 1
            return None
        scale, per_chunk = n // h, chunk_size // n
        first = chunk * per_chunk  # the chunk's first block, at the group block size
        raw = request.block_hashes
        tokens = request.all_token_ids[chunk * chunk_size:(chunk + 1) * chunk_size]
        if len(raw) < (first + per_chunk) * scale or len(tokens) != chunk_size:
            self.skipped += 1
            return None
        # vLLM's hash of block b at the group block size is the last hash-block's hash within it.
        hashes = [maybe_convert_block_hash(raw[(b + 1) * scale - 1]) for b in range(first, first + per_chunk)]
        parent = maybe_convert_block_hash(raw[first * scale - 1]) if first else None
        lora = getattr(request, "lora_request", None)
        return BlockNote(
            key=key, hashes=hashes, parent=parent,
            tokens=np.asarray(tokens, dtype="<u4").tobytes(),
            extra_keys=self._extra_keys(request, first, per_chunk) if _may_have_extras(request) else None,
            lora_id=int(lora.adapter_id) if lora is not None else None,
            lora_name=str(lora.name) if lora is not None else None,
        )

    def partial_note(self, request: Request, key: bytes, end: int) -> BlockNote | None:
        """The note of a partial chunk ending at token ``end`` (key ``key``): vLLM's own partial entry there,
        one block of ``hash_block_size`` tokens ending at ``end`` under the hash of that prefix (what vLLM
        publishes when it caches a block from a position inside it). None where vLLM has no such hash: no
        ``prefix_match_unit`` below the block size, ``end`` not a multiple of it (a turn that ended between
        two), or the hashes not computed yet. Partial chunks are kept only for requests without extra keys, so
        the note has none."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        h = self.hash_block_size
        k = end // h
        raw = request.block_hashes
        if not 0 < h < self.block_size or end % h or end <= 0 or len(raw) < k:
            self.partial_skipped += 1
            return None
        tokens = request.all_token_ids[end - h:end]
        return BlockNote(
            key=key, hashes=[maybe_convert_block_hash(raw[k - 1])],
            parent=maybe_convert_block_hash(raw[k - 2]) if k > 1 else None,
            tokens=np.asarray(tokens, dtype="<u4").tobytes(), extra_keys=None, lora_id=None, lora_name=None,
        )

    def _extra_keys(self, request: Request, first: int, count: int) -> list[list[ExtraKey] | None] | None:
        """Each block's extra keys as vLLM publishes them, the salt left out; None when no block has any."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        n = self.block_size
        per_block: list[tuple[Any, ...] | None] = []
        mm_idx = 0
        for b in range(first, first + count):
            keys, mm_idx = generate_block_hash_extra_keys(request, b * n, (b + 1) * n, mm_idx)
            kept = tuple(k for k in keys or () if not (isinstance(k, tuple) and k and k[0] == SALT_TAG))
            per_block.append(kept or None)
        if not any(per_block):
            return None
        published = to_event_extra_keys(per_block) or []
        return [None if k is None else [list(v) if isinstance(v, tuple) else v for v in k] for k in published]
