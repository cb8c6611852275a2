"""Session pins: a session's chunk keys held against eviction until their TTL ends.

Role
    A finished request may ask (``kv.Pin``) that the chunks it used stay cached for ``ttl_s`` seconds, so
    the session's next turn finds them. ``Pins`` is the table of those pins: per session, its pin records
    (the engine world that sent them, the tenant, the chunk keys, the expiry), and per (fingerprint, chunk
    key) how many records hold it. The index asks ``is_pinned`` (a dict look-up) before it evicts, and is
    told through ``on_change`` when a (fingerprint, chunk key) becomes held or free, so it can keep its
    entries out of the eviction order and count pinned bytes (``daemon/cache/index.py``).

Rules
    - A session's newer pin supersedes its older pins of the same world whose keys are a prefix of the
      new keys (a chat's next turn holds the whole conversation), their partial chunks' keys (a turn's
      end, held along) with them. A session keeps at most
      ``max_per_session`` records: past it, its oldest lapses.
    - A hit on a pinned chunk (``refresh``) restarts the TTL of every record holding it.
    - ``expire`` (the daemon's housekeeping, every second) ends the records past their TTL.
    - The budget is the index's: past it, the least recently pinned or refreshed records lapse first
      (``oldest``, ``lapse``).
    - At most ``max_sessions`` sessions: a pin of a new session beyond that is refused and logged; it never
      fails the request.
    Lapses are counted by reason: ttl, budget, unpin, superseded, session_limit.

Threading
    Event-loop only; the clock is injected (tests pass a fake one).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hkvd.transport.stat_fields import metric, status_only

log = logging.getLogger("hkvd.pins")

MAX_PER_SESSION = 16
MAX_SESSIONS = 4096
REASONS = ("ttl", "budget", "unpin", "superseded", "session_limit")

SHOWN_SESSIONS = 20  # sessions ``hkvd status`` lists, the longest-lasting first


@dataclass(frozen=True, slots=True)
class PinSessionStats:
    """One pinned session: its tenant, its pin records, the seconds until its last one lapses."""

    session: str = status_only()
    tenant: str = status_only()
    pins: int = status_only()
    ttl_left_s: float = status_only()


@dataclass(frozen=True, slots=True)
class PinStats:
    """Session pins (``hkvd status``: ``pins``; docs/pins.md)."""

    pinned_bytes: int = metric("hkvd_pinned_bytes", "Pool bytes of the entries session pins hold", default=0)
    budget_bytes: int = metric("hkvd_pin_budget_bytes", "The most pool bytes session pins may hold "
                               "(--pin-max-fraction)", default=0)
    sessions: int = metric("hkvd_pin_sessions", "Sessions holding pins", default=0)
    pins: int = status_only(default=0)  # pin records alive (a session holds up to 16)
    lapsed: dict[str, int] = metric("hkvd_pins_lapsed", "Pins ended, by reason (ttl, budget, unpin, superseded, "
                                    "session_limit)", "counter", key="reason", default_factory=dict)
    refused: int = metric("hkvd_pins_refused", "Pins of a new session refused: too many sessions pinned",
                          "counter", default=0)
    longest: tuple[PinSessionStats, ...] = status_only(default=())  # the 20 longest-lasting sessions


#: ``on_change(fingerprint, chunk_key, held)``: that chunk of that rank became held (True) or free (False).
ChangeFn = Callable[[bytes, bytes, bool], None]


@dataclass(eq=False, slots=True)
class PinRecord:
    """One ``kv.Pin``: ``keys`` of every rank of ``world``, held until ``expiry`` (refreshed by hits)."""

    session: str
    tenant: str
    world: tuple[bytes, ...]
    keys: tuple[bytes, ...]
    ttl_s: float
    expiry: float
    alive: bool = True
    partial: tuple[bytes, ...] = ()  # partial chunks' keys: held, but not in the prefix rule

    def held(self) -> tuple[bytes, ...]:
        return self.keys + self.partial if self.partial else self.keys


class Pins:
    def __init__(self, on_change: ChangeFn, clock: Callable[[], float] = time.monotonic, *,
                 max_per_session: int = MAX_PER_SESSION, max_sessions: int = MAX_SESSIONS) -> None:
        self._on_change = on_change
        self.clock = clock
        self.max_per_session = max_per_session
        self.max_sessions = max_sessions
        self._sessions: dict[str, list[PinRecord]] = {}  # oldest record first
        self._holders: dict[tuple[bytes, bytes], dict[PinRecord, None]] = {}  # (fingerprint, chunk key) -> records
        self._order: OrderedDict[PinRecord, None] = OrderedDict()  # least recently pinned or refreshed first
        self._heap: list[tuple[float, int, PinRecord]] = []  # (expiry, seq, record); stale items skipped
        self._seq = 0
        self.lapsed: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.refused = 0  # pins of a new session refused at max_sessions

    # ---- queries -------------------------------------------------------------------------------
    def is_pinned(self, fingerprint: bytes, chunk_key: bytes) -> bool:
        return (fingerprint, chunk_key) in self._holders

    def __len__(self) -> int:
        """Pin records alive."""
        return len(self._order)

    def sessions(self) -> int:
        return len(self._sessions)

    def remaining(self, limit: int) -> list[PinSessionStats]:
        """Up to ``limit`` sessions, the longest-lasting first."""
        now = self.clock()
        rows = [PinSessionStats(s, recs[-1].tenant, len(recs), max(max(r.expiry for r in recs) - now, 0.0))
                for s, recs in self._sessions.items()]
        rows.sort(key=lambda r: -r.ttl_left_s)
        return rows[:limit]

    def statistics(self, pinned_bytes: int, budget_bytes: int) -> PinStats:
        return PinStats(pinned_bytes, budget_bytes, len(self._sessions), len(self._order), dict(self.lapsed),
                        self.refused, tuple(self.remaining(SHOWN_SESSIONS)))

    def oldest(self) -> PinRecord | None:
        """The least recently pinned or refreshed record (the first to lapse past the budget)."""
        return next(iter(self._order), None)

    # ---- changes -------------------------------------------------------------------------------
    def pin(self, world: Sequence[bytes], session: str, tenant: str, keys: Sequence[bytes], ttl_s: float,
            partial: Sequence[bytes] = ()) -> bool:
        """Hold ``keys`` and ``partial`` (partial chunks' keys, outside the prefix rule) of every rank of
        ``world`` for ``ttl_s`` as pin ``session``. False: refused (too many sessions; logged)."""
        old = self._sessions.get(session)
        if old is None and len(self._sessions) >= self.max_sessions:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("pin of session %r refused: %d sessions are pinned already (the most); %d refused so far."
                            " Unpin ended sessions (hkvd unpin SESSION) or shorten pin_s", session[:40],
                            len(self._sessions), self.refused)
            return False
        world, keys = tuple(world), tuple(keys)
        rec = PinRecord(session, tenant, world, keys, ttl_s, self.clock() + ttl_s, partial=tuple(partial))
        if old is not None:
            for prior in [r for r in old if r.world == world and keys[:len(r.keys)] == r.keys]:
                self.lapse(prior, "superseded")
        recs = self._sessions.setdefault(session, [])
        recs.append(rec)
        self._order[rec] = None
        self._push(rec)
        holders = self._holders
        for fp in world:
            for k in rec.held():
                held = holders.get((fp, k))
                if held is None:
                    holders[(fp, k)] = {rec: None}
                    self._on_change(fp, k, True)
                else:
                    held[rec] = None
        while len(recs) > self.max_per_session:
            self.lapse(recs[0], "session_limit")
        return True

    def refresh(self, fingerprint: bytes, keys: Sequence[bytes]) -> int:
        """A hit on ``keys`` of ``fingerprint``: the records holding any restart their TTL; how many did."""
        holders = self._holders
        if not holders:
            return 0
        seen: set[PinRecord] = set()
        now = self.clock()
        for k in keys:
            for rec in holders.get((fingerprint, k), ()):
                if rec not in seen:
                    seen.add(rec)
                    rec.expiry = now + rec.ttl_s
                    self._order.move_to_end(rec)
        return len(seen)

    def unpin(self, session: str) -> int:
        """End every record of ``session``; how many there were."""
        recs = self._sessions.get(session, [])
        n = len(recs)
        for rec in list(recs):
            self.lapse(rec, "unpin")
        return n

    def expire(self) -> int:
        """End every record past its TTL; how many."""
        now = self.clock()
        heap = self._heap
        n = 0
        while heap and heap[0][0] <= now:
            _, _, rec = heapq.heappop(heap)
            if not rec.alive:
                continue
            if rec.expiry <= now:
                self.lapse(rec, "ttl")
                n += 1
            else:  # refreshed since it was pushed: due at its new expiry
                self._push(rec)
        return n

    def lapse(self, rec: PinRecord, reason: str) -> None:
        """End ``rec`` (counted under ``reason``); the chunks no other record holds become free."""
        if not rec.alive:
            return
        rec.alive = False
        self.lapsed[reason] += 1
        del self._order[rec]
        recs = self._sessions[rec.session]
        recs.remove(rec)
        if not recs:
            del self._sessions[rec.session]
        holders = self._holders
        for fp in rec.world:
            for k in rec.held():
                held = holders.get((fp, k))
                if held is None or held.pop(rec, 0) is not None:
                    continue  # a key repeated in the record: already let go
                if not held:
                    del holders[(fp, k)]
                    self._on_change(fp, k, False)

    def records(self) -> Iterator[PinRecord]:
        """Every live record, least recently pinned or refreshed first."""
        return iter(list(self._order))

    def _push(self, rec: PinRecord) -> None:
        # One heap item per live record (a refresh moves no item: ``expire`` pushes it again when it comes
        # due early). Ended records' items are dropped when they come due, or all at once when they
        # outnumber the live ones.
        heap = self._heap
        if len(heap) > 2 * len(self._order) + 64:
            heap[:] = [item for item in heap if item[2].alive]
            heapq.heapify(heap)
        self._seq += 1
        heapq.heappush(heap, (rec.expiry, self._seq, rec))
