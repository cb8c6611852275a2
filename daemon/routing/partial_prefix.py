"""Usable-prefix answers past the last whole chunk: partial chunks (docs/design.md, "Hit granularity").

Role
    An engine whose vLLM hashes below its block size (``prefix_match_unit``) stores the Mamba state vLLM
    checkpoints inside a block as a partial chunk: chunk n's entries under ``partial_key(key(n - 1),
    tokens [nC, L))`` (``hkvd.shim.partial``). A usable-prefix answer of n whole chunks is then extended
    to the longest L inside chunk n whose partial chunk the hybrid rule serves. The daemon does not know
    the engine's hash unit, and vLLM accepts a hit at any position, so every position of chunk n is a
    tail (``PartialTails``), longest first. Which tail serves is the cache's decision, the same as for an
    engine's lookup (``Cache.plan_lookup``): a tail is planned only once every group's entry of it is held
    (one lookup per group and rank), so a chunk without partial entries costs its partial keys' hashes only.

    Only layouts a partial chunk can serve (``servable``: Mamba groups and full attention, nothing else)
    and prompts without extra keys (partial keys carry none) are extended.

Threading
    Event loop (the endpoint's), like ``hkvd.daemon.routing.usable_prefix``.

Failure handling
    None of its own: the cache reads membership through the presence test it is given.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from hkvd.daemon.cache import LookupPlan, Tail
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


class PartialTails:
    """A router's tails for one prompt (``Cache.plan_lookup``'s ``tails``): every position inside chunk n,
    the whole chunks' hit, longest first, ending at most at ``limit``; ``tokens`` reads the hit's length
    back from the plan."""

    def __init__(self, keys: Sequence[bytes], pkeys: PartialKeys, chunk_size: int, limit: int) -> None:
        self._keys, self._pkeys, self._C, self._limit = keys, pkeys, chunk_size, limit
        self._longest = 0  # the first position offered inside the last chunk asked for

    def __call__(self, n: int) -> Iterator[Tail]:
        C = self._C
        self._longest = min((n + 1) * C - 1, self._limit)
        for end in range(self._longest, n * C, -1):
            yield n, self._pkeys.at(self._keys, end)

    def tokens(self, plan: LookupPlan) -> int:
        """The hit of ``plan`` in tokens: its whole chunks, or the position of the tail that ends it."""
        if not plan.tail:
            return plan.hit_chunks * self._C
        return self._longest - (plan.tail - 1)
