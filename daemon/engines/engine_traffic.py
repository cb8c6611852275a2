"""Per-engine traffic: lookup hits and misses in tokens, bytes stored and retrieved, by (model, rank).

Role
    The service counts each served Lookup, Store and Retrieve here under the identity its engine
    registered with: ``model`` and ``rank`` (``EngineSpec``; a scheduler connection looks up as rank 0,
    each worker stores and retrieves as its own tensor-parallel rank). A lookup of n chunks that hits h
    counts h * chunk_size hit tokens and (n - h) * chunk_size missed ones (lookups send whole chunks only);
    bytes are the entries' bytes, as ``hkvd_stored_bytes`` and ``hkvd_retrieved_bytes`` count them.

Contracts
    - Counters never go back: an engine that leaves keeps its label set, and one that registers again
      with the same model and rank counts on under it (Prometheus counters must not reset while the
      daemon runs).
    - At most ``MAX_LABEL_SETS`` label sets, the fold's included: once ``MAX_LABEL_SETS - 1`` (model,
      rank) pairs have their own, every new pair counts under ``model="other", rank="other"``, so a
      daemon serving many models over its lifetime keeps a bounded /metrics.

``statistics()`` is an ``EngineTrafficStats``: /metrics exports ``hkvd_engine_lookup_hit_tokens_total``,
``hkvd_engine_lookup_miss_tokens_total``, ``hkvd_engine_stored_bytes_total`` and
``hkvd_engine_retrieved_bytes_total``, each labelled ``model`` and ``rank``; ``hkvd status --json`` shows
them as ``engine_traffic.engines``. Event loop only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hkvd.transport.stat_fields import Metric, Sample, metrics, status_only

MAX_LABEL_SETS = 256
OTHER = ("other", "other")


@dataclass(frozen=True, slots=True)
class EngineCountsStats:
    """One (model, rank)'s counters (``hkvd status``: an item of ``engine_traffic.engines``)."""

    model: str = status_only()
    rank: str = status_only()  # the registered rank, or "other" (folded; module docstring)
    lookup_hit_tokens: int = status_only()
    lookup_miss_tokens: int = status_only()
    stored_bytes: int = status_only()
    retrieved_bytes: int = status_only()


def _by_engine(name: str) -> Callable[[tuple[EngineCountsStats, ...], object], list[Sample]]:
    def samples(engines: tuple[EngineCountsStats, ...], _owner: object) -> list[Sample]:
        return [({"model": e.model, "rank": e.rank}, float(getattr(e, name))) for e in engines]
    return samples


@dataclass(frozen=True, slots=True)
class EngineTrafficStats:
    """Every (model, rank) counted so far, in the order each was first seen."""

    engines: tuple[EngineCountsStats, ...] = metrics(
        Metric("hkvd_engine_lookup_hit_tokens", "Tokens that lookups found, by engine (model, rank)", "counter",
               samples=_by_engine("lookup_hit_tokens")),
        Metric("hkvd_engine_lookup_miss_tokens", "Tokens that lookups did not find, by engine (model, rank)",
               "counter", samples=_by_engine("lookup_miss_tokens")),
        Metric("hkvd_engine_stored_bytes", "Bytes stored into the pool, by engine (model, rank)", "counter",
               samples=_by_engine("stored_bytes")),
        Metric("hkvd_engine_retrieved_bytes", "Bytes retrieved from the pool, by engine (model, rank)", "counter",
               samples=_by_engine("retrieved_bytes")),
        default=())


class EngineTraffic:
    """The counters, by (model, rank); see the module docstring."""

    def __init__(self, max_label_sets: int = MAX_LABEL_SETS) -> None:
        self.max_label_sets = max_label_sets
        self._counts: dict[tuple[str, str], list[int]] = {}  # hit tokens, miss tokens, stored, retrieved

    def _row(self, model: str, rank: int) -> list[int]:
        key = (model, str(rank))
        row = self._counts.get(key)
        if row is None:
            if len(self._counts) >= self.max_label_sets - (OTHER not in self._counts):
                key = OTHER  # the last label set is kept for the fold
            row = self._counts.setdefault(key, [0, 0, 0, 0])
        return row

    def lookup(self, model: str, rank: int, hit_tokens: int, miss_tokens: int) -> None:
        row = self._row(model, rank)
        row[0] += hit_tokens
        row[1] += miss_tokens

    def stored(self, model: str, rank: int, nbytes: int) -> None:
        self._row(model, rank)[2] += nbytes

    def retrieved(self, model: str, rank: int, nbytes: int) -> None:
        self._row(model, rank)[3] += nbytes

    def statistics(self) -> EngineTrafficStats:
        return EngineTrafficStats(tuple(EngineCountsStats(model, rank, *row)
                                        for (model, rank), row in self._counts.items()))
