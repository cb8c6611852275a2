# SPDX-License-Identifier: Apache-2.0
"""Partial chunks: hits inside a block, where vLLM checkpoints a Mamba state (docs/design.md, "Hit granularity").

Role
    With vLLM's ``prefix_match_unit`` h below its block size N (``KVCacheConfig.hash_block_size``), a Mamba
    model in align mode checkpoints the state at the h-aligned end of each prompt's last block and offers
    it to the connector (a ``boundary_state_offloads`` boundary L that is not a multiple of N). The
    scheduler side stores it as a *partial chunk*: chunk ``j = L // C``'s entries (the attention blocks of
    chunk j, whole pages, and the state after L) under ``partial_key(key(j - 1), tokens [jC, L))``. The
    daemon sees an ordinary chunk j: its hit rule is unchanged. A lookup of m whole chunks carries the
    partial chunks that may end its hit as tails (``Lookup.tails``, longest first): the daemon extends a
    hit of n whole chunks by the first tail at a chunk j >= n it serves (after chunks [0, j)), which then
    serves L tokens. Positions inside
    chunk n that went with no tail (h multiples, where n < m) are probed once the answer is in
    (``Probes``); so is every position against a daemon that takes no tails. The page past L holds bytes
    of the storing request; the loading request's own forward writes those slots before anything reads them.

    On only where it can serve (``enabled``): C == N, a Mamba group, every other group full attention
    (sliding-window tails are not kept per partial chunk); and per request, only without extra keys
    (LoRA, multimodal, salt, embeddings: partial keys carry none). vLLM's checkpoints inside a block
    need h < N dividing N (``checkpoints``); turn ends need no h.

    Turn ends (the shim's ``turn_end_states``): a finished request's state after its last computed token
    (prompt + answer less the last sampled token) is stored the same way, at any position, with its offset
    inside its chunk (``Store.turn_end``). The scheduler side remembers where such turns ended, by the key
    of the whole chunk before them (``hkvd.transport.turn_ends.TurnEnds``), and a later lookup sends those
    positions as tails: one more per remembered position, no scan of the chunk. The daemon remembers the
    turn ends every engine stored; a lookup's reply names those the tails missed (``LookupReply.ends``:
    another engine's, or this one's before it restarted), and the lookup goes again with them as tails,
    once.

Threading
    vLLM's scheduler thread (the scheduler side's hooks), like ``hkvd.shim.scheduler``.

Failure handling
    A probe that fails is a miss for its position; the whole-chunk hit stands. Leases of probes that do
    not win, and of the whole-chunk lookup a probe replaces, are handed back to the caller to release.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hkvd.shim.request_state import Probe, RequestRecord
from hkvd.shim.spec import GroupInfo
from hkvd.transport.keys import ROOT_KEY, partial_key


def enabled(groups: Sequence[GroupInfo], block_size: int, chunk_size: int) -> bool:
    """Whether this engine can store and serve partial chunks at all (turn ends; see the module doc): C == N, a
    Mamba group, every other group full attention."""
    kinds = {g.kind for g in groups}
    return chunk_size == block_size and "mamba" in kinds and kinds <= {"full", "mamba"}


def checkpoints(block_size: int, hash_block_size: int) -> bool:
    """Whether vLLM also checkpoints states inside a block (``prefix_match_unit`` h below N, dividing it), which
    lookups then probe at every h multiple (``candidates``)."""
    return 0 < hash_block_size < block_size and block_size % hash_block_size == 0


def candidates(hit_chunks: int, num_tokens: int, chunk_size: int, unit: int) -> list[int]:
    """The positions inside chunk ``hit_chunks`` a probe may serve, longest first: multiples of ``unit``
    past the chunk's start that leave the prompt's last token to compute."""
    lo = hit_chunks * chunk_size
    top = min(lo + chunk_size - 1, num_tokens - 1)
    return list(range(top // unit * unit, lo, -unit))


def before(keys: Sequence[bytes], j: int) -> bytes:
    """The key a partial chunk inside chunk ``j`` hangs from: the whole chunk ``j - 1``'s, ``ROOT_KEY`` for chunk 0."""
    return keys[j - 1] if j else ROOT_KEY


def key_at(keys: Sequence[bytes], tokens: Sequence[int], end: int, chunk_size: int) -> bytes | None:
    """The partial key of the chunk holding token ``end - 1``, over ``tokens`` up to ``end``; None when the
    whole chunks before it have no keys yet."""
    j = end // chunk_size
    if j > len(keys) or end <= j * chunk_size or len(tokens) < end:
        return None
    return partial_key(before(keys, j), tokens[j * chunk_size:end])


def merge(positions: Sequence[int], more: Sequence[int]) -> list[int]:
    """Probe positions from both lists, each once, longest first."""
    return sorted({*positions, *more}, reverse=True)


@dataclass
class Choice:
    """A request's answer after its probes: ``hit_chunks`` and lease for the daemon, and, for a partial hit,
    the tokens it serves and the key of its last chunk."""

    hit_chunks: int
    lease_id: int
    tokens: int = 0
    key: bytes = b""
    release: list[int] = field(default_factory=list)


class Probes:
    """Probes in flight by lookup id; each request's progress is on its record (``RequestRecord.probe``)."""

    def __init__(self) -> None:
        self._by_id: dict[int, RequestRecord] = {}

    def __contains__(self, lookup_id: int) -> bool:
        return lookup_id in self._by_id

    def begin(self, st: RequestRecord, submitted: dict[int, tuple[int, bytes]]) -> None:
        """Probes ``submitted`` (lookup id -> (position, key)) extend the record's whole-chunk answer."""
        self.drop(st)
        st.probe = Probe(st.hit_chunks, st.lease_id, dict(submitted))
        for rid in submitted:
            self._by_id[rid] = st

    def reply(self, lookup_id: int, hit_chunks: int, lease_id: int) -> tuple[RequestRecord, Choice | None, list[int]]:
        """Take one probe's reply (``hit_chunks`` 0 for a failed one). Returns (its record, the record's choice
        once every probe answered else None, leases to release now)."""
        st = self._by_id.pop(lookup_id)
        p = st.probe
        assert p is not None  # an id is indexed only while its record's probes run
        pos, key = p.waiting.pop(lookup_id)
        release: list[int] = []
        if hit_chunks == p.hit_chunks + 1 and (p.best is None or pos > p.best[0]):
            if p.best is not None:
                release.append(p.best[1])
            p.best = (pos, lease_id, key)
        elif lease_id:
            release.append(lease_id)
        if p.waiting:
            return st, None, release
        st.probe = None
        if p.best is None:
            return st, Choice(p.hit_chunks, p.lease_id), release
        pos, lease, key = p.best
        if p.lease_id:
            release.append(p.lease_id)
        return st, Choice(p.hit_chunks + 1, lease, pos, key), release

    def drop(self, st: RequestRecord) -> list[int]:
        """Forget a record's probes (finished, answered otherwise); the probe leases to release (the whole-chunk
        lookup's lease is the request's own, released with it)."""
        p, st.probe = st.probe, None
        if p is None:
            return []
        for rid in p.waiting:
            self._by_id.pop(rid, None)
        return [p.best[1]] if p.best is not None and p.best[1] else []

    def clear(self) -> None:
        """The connection was lost: no probe will be answered, and its leases ended with it."""
        for st in self._by_id.values():
            st.probe = None
        self._by_id.clear()
