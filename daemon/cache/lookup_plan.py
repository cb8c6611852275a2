"""What a lookup gets: the whole chunks, a partial-chunk tail, the turn ends past the hit, what to read.

Role
    ``plan`` is the hit rule applied to a lookup, wherever the lookup comes from: an engine's
    ``Lookup`` (over the pool, then over the pool and what the lower tiers hold, ``daemon/tiers/promotion.py``),
    a router's usable-prefix question (``daemon/routing/usable_prefix.py``), a peer's lookup and a pull's
    local answer (``daemon/peers/``). ``Cache.plan_lookup`` (``daemon/cache/core.py``) is its one caller:
    it builds the presence test (the pool's READY entries, the lower tiers', less what is withheld) and
    names the turn ends. The hybrid rule itself is ``daemon/cache/hybrid.py``.

Tails (docs/design.md, "Hit granularity")
    A partial chunk is chunk j's entries stored under a partial key (``hkvd.transport.keys.partial_key``).
    Tails are offered longest first; the first whose every group's entry is present (for every rank) and
    whose plan over the first j whole chunks and the tail serves all j + 1 chunks ends the hit. A tail at a
    chunk j >= n (n: the whole chunks' hit) may: the whole chunks may stop at n for want of a Mamba state,
    which a partial chunk carries itself. Tails below n are passed over.

Threading
    Pure over the presence test it is given, which must not change during the call (event loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hkvd.daemon.cache.entry import EntryKey
from hkvd.daemon.cache.hybrid import GroupRule, HitPlan, plan_hit
from hkvd.transport.keys import ROOT_KEY
from hkvd.transport.turn_ends import TurnEnds
from hkvd.transport.wire.kv import MAX_ENDS

#: ``has(entry_key)``: is that entry available where the plan may take it from?
HasFn = Callable[[EntryKey], bool]

#: A tail: (chunk index j, the partial key of chunk j).
Tail = tuple[int, bytes]

#: Tails given as a function of the whole chunks' hit n (a router's candidates inside chunk n).
TailSource = Callable[[int], Iterable[Tail]]


class Shape(Protocol):
    """What the hit rule needs of an engine format: its groups' rules and its chunk size."""

    @property
    def rules(self) -> Sequence[GroupRule]: ...

    @property
    def chunk_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LookupPlan:
    """The hit a lookup gets (``Cache.plan_lookup``).

    ``hit_chunks``: chunks of the hit, the tail's chunk included; ``needed``: per group, the chunk indices a
    retrieve loads (as ``HitPlan``); ``keys``: the chunk keys the hit covers (the lookup's, or its first j and
    the tail's key); ``fingerprints``: the ranks served; ``tail``: 1 + the index of the tail that ends the hit
    in the order given (0: none); ``ends``: ``[chunk, offset]`` of turn ends past the hit, when asked;
    ``promote``: (entry, parent chunk key) of the entries the hit needs that only the lower tiers hold, when
    planned with them; ``withheld``: entries found present but withheld (quarantined); ``missing``: entries
    found absent, by group kind, when counted; ``complete``: whether no plan over more tiers could serve more
    (every whole chunk hits, and no longer tail was offered)."""

    hit_chunks: int
    needed: dict[int, list[int]]
    keys: Sequence[bytes]
    fingerprints: tuple[bytes, ...]
    tail: int = 0
    ends: list[list[int]] = field(default_factory=list)
    promote: list[tuple[EntryKey, bytes]] = field(default_factory=list)
    withheld: int = 0
    missing: dict[str, int] = field(default_factory=dict)
    complete: bool = True
    # Retrieves the lease serves: 0, one per rank of ``fingerprints``; else the reader world's ranks, where
    # ``fingerprints`` is another TP size's world whose entries are re-sharded on read (transport/reshard.py).
    readers: int = 0

    @property
    def whole_chunks(self) -> int:
        """The hit's whole chunks (the tail's chunk not counted)."""
        return self.hit_chunks - (self.tail > 0)

    def entries(self) -> list[EntryKey]:
        """Every rank's entry keys that a retrieve of the hit loads, rank by rank (once each: the ranks of a
        replicated world share one fingerprint, so one entry per group and chunk)."""
        keys = self.keys
        return [(fp, gid, keys[c]) for fp in distinct(self.fingerprints) for gid, chunks in self.needed.items()
                for c in chunks]


def distinct(fingerprints: Sequence[bytes]) -> Sequence[bytes]:
    """``fingerprints`` without repeats, in order: a replicated world's ranks share one (docs/design.md,
    "Replicated groups (MLA)"); any other world's are distinct and come back as given."""
    return fingerprints if len(set(fingerprints)) == len(fingerprints) else tuple(dict.fromkeys(fingerprints))


def plan_ranks(shape: Shape, keys: Sequence[bytes], fingerprints: Sequence[bytes], has: HasFn,
               max_chunks: int | None = None, missing: dict[str, int] | None = None) -> HitPlan:
    """The hybrid hit over ``keys`` that every rank of ``fingerprints`` holds, by ``has``.

    ``missing``, when given, counts the entries found absent by group kind (every rank's that was probed)."""
    if missing is None and len(fingerprints) == 1:
        fp = fingerprints[0]

        def present(group_id: int, chunk: int) -> bool:
            return has((fp, group_id, keys[chunk]))
    else:
        kinds = {r.group_id: r.kind for r in shape.rules}

        def present(group_id: int, chunk: int) -> bool:
            key = keys[chunk]
            lacking = sum(not has((fp, group_id, key)) for fp in fingerprints)
            if not lacking:
                return True
            if missing is not None:
                missing[kinds[group_id]] = missing.get(kinds[group_id], 0) + lacking
            return False

    return plan_hit(shape.rules, len(keys), shape.chunk_size, present, max_chunks)


def plan(shape: Shape, keys: Sequence[bytes], fingerprints: Sequence[bytes], has: HasFn, *,
         tails: Sequence[Tail] | TailSource = (), max_chunks: int | None = None,
         missing: dict[str, int] | None = None) -> tuple[HitPlan, Sequence[bytes], int, bool]:
    """The whole chunks' hit over ``keys`` (at most ``max_chunks``), extended by the first tail that serves
    (module docstring): (its plan, the keys it covers, 1 + the tail's index or 0, complete)."""
    fps = tuple(distinct(fingerprints))
    whole = plan_ranks(shape, keys, fps, has, max_chunks, missing)
    n = whole.hit_chunks
    offered = tails(n) if callable(tails) else tails
    groups = [r.group_id for r in shape.rules]
    first = True  # the first tail that may end a hit longer than n
    for i, (j, key) in enumerate(offered):
        if j < n or j > len(keys):
            continue
        if all(has((fp, g, key)) for g in groups for fp in fps):  # most tails are decided here
            covered = [*keys[:j], key]
            extended = plan_ranks(shape, covered, fps, has, j + 1)
            if extended.hit_chunks == j + 1:
                return extended, covered, i + 1, first and j == len(keys)
        first = False
    return whole, keys, 0, n == len(keys) and first


def turn_ends_past(turn_ends: TurnEnds, layout: bytes, keys: Sequence[bytes], n: int) -> list[list[int]]:
    """``[chunk_index, offset]`` of the turn ends engines of ``layout`` stored inside chunks n .. len(keys)
    (after the whole chunk before each), the last chunk's first: where a hit of n whole chunks may still end
    (a turn end at a chunk past n carries its own Mamba state, which the whole chunks may lack)."""
    out: list[list[int]] = []
    for j in range(len(keys), n - 1, -1):
        out.extend([j, off] for off in turn_ends.offsets(layout + (keys[j - 1] if j else ROOT_KEY)))
        if len(out) >= MAX_ENDS:
            break
    return out[:MAX_ENDS]
