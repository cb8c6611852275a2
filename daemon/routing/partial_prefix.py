"""Usable-prefix answers past the last whole chunk: partial chunks (docs/design.md, "Hit granularity").

Role
    An engine whose vLLM hashes below its block size (``prefix_match_unit``) stores the Mamba state vLLM
    checkpoints inside a block as a partial chunk: chunk n's entries under ``partial_key(key(n - 1),
    tokens [nC, L))`` (``hkvd.shim.partial``). A usable-prefix answer of n whole chunks is then extended
    to the longest L inside chunk n whose partial chunk the hybrid rule serves. The daemon does not know
    the engine's hash unit, and vLLM accepts a hit at any position, so every position of chunk n is a
    candidate, longest first; a candidate is planned only once its Mamba states are held (one lookup per
    group and rank), so a chunk without partial entries costs its partial keys' hashes only.

    Only layouts a partial chunk can serve (``servable``: Mamba groups and full attention, nothing else)
    and prompts without extra keys (partial keys carry none) are extended.

Threading
    Event loop (the endpoint's), like ``hkvd.daemon.routing.usable_prefix``.

Failure handling
    None of its own: it reads membership through the ``has`` it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from hkvd.daemon.cache import EntryKey, plan_ranks
from hkvd.transport.keys import ROOT_KEY, partial_key

if TYPE_CHECKING:  # for annotations only: usable_prefix imports this module
    from hkvd.daemon.routing.usable_prefix import Format


def servable(fmt: Format) -> bool:
    """Whether partial chunks can serve hits of this layout."""
    kinds = {r.kind for r in fmt.rules}
    return "mamba" in kinds and kinds <= {"full", "mamba"}


class PartialKeys:
    """The partial keys of one prompt, hashed once each (several tiers probe the same positions)."""

    def __init__(self, tokens: bytes, chunk_size: int) -> None:
        self._ids = np.frombuffer(tokens, dtype="<u4")
        self._C = chunk_size
        self._memo: dict[int, bytes] = {}

    def at(self, keys: Sequence[bytes], end: int) -> bytes:
        key = self._memo.get(end)
        if key is None:
            n = end // self._C
            key = partial_key(keys[n - 1] if n else ROOT_KEY, self._ids[n * self._C:end])
            self._memo[end] = key
        return key


def extend(fmt: Format, keys: Sequence[bytes], pkeys: PartialKeys, hit: int, limit: int,
           has: Callable[[EntryKey], bool]) -> int:
    """``hit`` (tokens, a whole-chunk multiple) extended to the longest partial chunk ending at most at
    ``limit`` that the hybrid rule serves through ``has``; ``hit`` when none does."""
    C = fmt.chunk_size
    n = hit // C
    if n > len(keys):
        return hit
    mamba = [r.group_id for r in fmt.rules if r.kind == "mamba"]
    fps = fmt.rank_fingerprints
    for end in range(min((n + 1) * C - 1, limit), n * C, -1):
        key = pkeys.at(keys, end)
        if not all(has((fp, g, key)) for g in mamba for fp in fps):
            continue
        if plan_ranks(fmt, [*keys[:n], key], fps, has, n + 1).hit_chunks == n + 1:
            return end
    return hit
