"""Quarantine: the (engine fingerprint, group) pairs whose entries diverged from their recomputation.

Role
    The service records here every compared entry of a sampled hit (``record``): checks, matches,
    divergences, entries missing, the largest error, per (fingerprint, group). Once ``threshold``
    divergences of one pair fall within ``window_s`` seconds, the pair is quarantined: the cache's
    hit planning holds this object as ``Cache.withheld`` and treats every entry of the pair as absent,
    so lookups miss and the engine recomputes. One error line logs the evidence. A quarantine
    never stops an engine or the daemon; it lasts until ``lift`` (``hkvd quarantine --clear``) or
    ``lift_all`` (SIGHUP), or the daemon's restart (it is not kept on disk).

Bounds
    At most ``MAX_ROWS`` pairs keep counters of their own; later pairs count under one row labelled
    ``other`` (fingerprint) and ``other`` (group), which is never quarantined, so /metrics stays bounded.

Threading
    Event-loop only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hkvd.transport.stat_fields import Metric, Sample, metric, metrics, status_only

log = logging.getLogger("hkvd.quarantine")

MAX_ROWS = 256
_OTHER = (b"", -1)
Pair = tuple[bytes, int]  # (fingerprint, group_id)


@dataclass(frozen=True, slots=True)
class VerifyGroupStats:
    """One (fingerprint, group)'s comparisons (``hkvd status``: an item of ``verify.groups``)."""

    fingerprint: str = status_only()  # hex; "other" for the fold (module docstring)
    group: str = status_only()
    kind: str = status_only()
    checks: int = status_only()  # entries compared
    matches: int = status_only()  # within tolerance
    divergences: int = status_only()
    missing: int = status_only()  # no longer held when the check came: not compared
    max_error: float = status_only()  # the largest error seen (compare.entry_error's units)
    quarantined: bool = status_only()
    since: float = status_only()  # wall-clock time the quarantine began; 0 when not quarantined


def _by_pair(name: str) -> Callable[[tuple[VerifyGroupStats, ...], object], list[Sample]]:
    def samples(rows: tuple[VerifyGroupStats, ...], _owner: object) -> list[Sample]:
        return [({"fingerprint": r.fingerprint, "group": r.group, "kind": r.kind}, float(getattr(r, name)))
                for r in rows]
    return samples


_PAIR = "by engine fingerprint and group"


@dataclass(frozen=True, slots=True)
class VerifyStats:
    """Sampled hits compared with their recomputation, and the quarantines they caused."""

    groups: tuple[VerifyGroupStats, ...] = metrics(
        Metric("hkvd_verify_checks", f"Entries of sampled hits compared with the engine's recomputation, {_PAIR}",
               "counter", samples=_by_pair("checks")),
        Metric("hkvd_verify_matches", f"Compared entries within their tolerance, {_PAIR}", "counter",
               samples=_by_pair("matches")),
        Metric("hkvd_verify_divergences", f"Compared entries past their tolerance, {_PAIR}", "counter",
               samples=_by_pair("divergences")),
        Metric("hkvd_verify_missing", f"Entries a check named that were no longer held (not compared), {_PAIR}",
               "counter", samples=_by_pair("missing")),
        Metric("hkvd_verify_max_error", f"Largest relative error seen in a comparison, {_PAIR}",
               samples=_by_pair("max_error")),
        Metric("hkvd_quarantined", f"1 while the entries of a fingerprint and group are not served, {_PAIR}",
               samples=_by_pair("quarantined")),
        default=())
    quarantines: int = metric("hkvd_quarantines", "Quarantines begun (divergences past the threshold)", "counter",
                              default=0)
    lifted: int = metric("hkvd_quarantines_lifted", "Quarantines lifted (hkvd quarantine --clear, SIGHUP)",
                         "counter", default=0)


@dataclass(slots=True)
class _Row:
    kind: str
    counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # checks, matches, divergences, missing
    max_error: float = 0.0
    recent: deque[float] = field(default_factory=deque)  # monotonic times of divergences in the window
    since: float = 0.0  # wall-clock start of the quarantine; 0.0: not quarantined


class Quarantine:
    """Counters and quarantines per (fingerprint, group); ``pair in q``: not served (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall
        self._rows: dict[Pair, _Row] = {}
        self._held: set[Pair] = set()
        self._begun = 0
        self._lifted = 0

    def __contains__(self, pair: object) -> bool:
        return pair in self._held

    def __len__(self) -> int:
        return len(self._held)

    def _row(self, pair: Pair, kind: str) -> tuple[Pair, _Row]:
        if pair not in self._rows and len(self._rows) >= MAX_ROWS - (_OTHER not in self._rows):
            pair = _OTHER
        return pair, self._rows.setdefault(pair, _Row(kind if pair != _OTHER else "other"))

    def record(self, fingerprint: bytes, group_id: int, kind: str, *, checked: int, diverged: int, missing: int,
               max_error: float, evidence: str, threshold: int, window_s: float) -> bool:
        """Count one check's entries of one pair; True when the pair is quarantined after it.

        ``evidence`` (the keys that diverged, their errors) goes into the error line when this check
        begins a quarantine."""
        pair, row = self._row((fingerprint, group_id), kind)
        c = row.counts
        c[0] += checked
        c[1] += checked - diverged
        c[2] += diverged
        c[3] += missing
        row.max_error = max(row.max_error, max_error)
        if pair == _OTHER:
            return False
        now = self.clock()
        row.recent.extend([now] * diverged)
        while row.recent and now - row.recent[0] > window_s:
            row.recent.popleft()
        if pair not in self._held and diverged and len(row.recent) >= threshold:
            self._held.add(pair)
            row.since = self.wall()
            self._begun += 1
            log.error("quarantined fingerprint %s group %d (%s): %d divergences within %g s, largest error %.4g; "
                      "its entries are no longer served (engines recompute). Evidence: %s. After a fix: "
                      "hkvd quarantine --clear %s, or SIGHUP", fingerprint.hex(), group_id, kind, len(row.recent),
                      window_s, row.max_error, evidence, fingerprint.hex())
        return pair in self._held

    def lift(self, fingerprint_hex: str) -> list[Pair]:
        """Lift every quarantine whose fingerprint's hex starts with ``fingerprint_hex``; those lifted."""
        prefix = fingerprint_hex.lower()
        return self._lift([p for p in self._held if p[0].hex().startswith(prefix)], f"hkvd quarantine --clear {prefix}")

    def lift_all(self, why: str) -> list[Pair]:
        return self._lift(list(self._held), why)

    def _lift(self, pairs: list[Pair], why: str) -> list[Pair]:
        for pair in pairs:
            self._held.discard(pair)
            row = self._rows[pair]
            row.since = 0.0
            row.recent.clear()
            self._lifted += 1
            log.warning("quarantine of fingerprint %s group %d lifted (%s): its entries are served again",
                        pair[0].hex(), pair[1], why)
        return sorted(pairs)

    def statistics(self) -> VerifyStats:
        rows = tuple(
            VerifyGroupStats("other" if pair == _OTHER else pair[0].hex(), "other" if pair == _OTHER else str(pair[1]),
                             r.kind, r.counts[0], r.counts[1], r.counts[2], r.counts[3], r.max_error,
                             pair in self._held, r.since)
            for pair, r in self._rows.items())
        return VerifyStats(rows, self._begun, self._lifted)
