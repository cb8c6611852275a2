# SPDX-License-Identifier: Apache-2.0
"""``FakeDaemon``: the shim's ``DaemonPort`` in memory, the one fake of the daemon for the shim's unit tests.

Role
    Records every request in ``sent`` as ``(id, kind, *fields)`` and completes it the way the daemon
    would, when the test says so:

    - ``lookup`` is answered at once with ``hit`` chunks (at most the keys sent) and ``lease_id``; with
      ``tail_held`` the lookup's first tail at its whole-chunk hit extends it (``Lookup.tails``); with
      ``ends`` asked and no tail won, the reply names those turn ends (``Lookup.ends``); with ``places``
      asked and set, a hit's reply carries them (``LookupReply.places``, in-step loads). With
      ``hold_lookups`` the replies wait for ``answer()`` (a busy daemon).
    - every other submit (retrieve, store, step, verify, pull, watch, events poll) waits for
      ``complete(rid, ok)`` (or ``fail(rid)``), whose result is the reply message of its kind (a test may
      give its own; ``reply`` builds the default); ids in ``finish_on_wait`` complete when someone
      ``wait``s for them.
    - ``release``, ``pin``, ``uncacheable`` and ``abort`` send no reply: they are recorded (``released``,
      ``aborted``, a ``pin`` row in ``sent``, ``uncacheable``).

    Rows: ``(rid, "lookup", keys, tails, ends)``, ``(rid, "retrieve", items, lease_id)``, ``(rid, "store",
    items, tenant[, turn_end])``, ``(rid, "step", step, offers, confirms, verifies, tenants)`` (and the
    sequence number in ``seqs[rid]``), ``(rid, "verify", items)``, ``(rid, "pull", peer, n_keys, max_chunks,
    release_lease)``, ``(rid, "watch", lease_id)``, ``(rid, "events", since)``, ``(0, "pin", session, tenant,
    ttl_s, keys[, partial_keys])``.

Threading
    One thread, like the scheduler side's and the worker side's callers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hkvd.shim.results import Completion, Result
from hkvd.transport.errors import KVTimeout, NotFound
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.events import KVEvents, StepResult
from hkvd.transport.wire.kv import Item, LeaseWritten, LookupReply, RetrieveResult, StoreResult, VerifyResult
from hkvd.transport.wire.peer import PullResult


class FakeDaemon:
    """See the module docstring. ``advertise``: the peer address ``status()`` reports (prefill/decode)."""

    daemon_pid = 0

    def __init__(self, hit: int = 0, lease_id: int = 0, *, tail_held: bool = False, ends: Sequence[list[int]] = (),
                 hold_lookups: bool = False, advertise: str = "", server_id: str = "fake", first_id: int = 1) -> None:
        self.hit, self.lease_id = hit, lease_id
        self.tail_held = tail_held
        self.ends = [list(e) for e in ends]
        self.hold_lookups = hold_lookups
        self.advertise = advertise
        self.server_id = server_id
        self.connected = True
        self.sent: list[tuple[Any, ...]] = []
        self.seqs: dict[int, int] = {}  # step event id -> its sequence number
        self.done: dict[int, Completion] = {}  # ready for poll / wait
        self.held: list[Completion] = []  # lookup replies held back (hold_lookups) until answer()
        self.finish_on_wait: set[int] = set()  # complete these when someone waits for them
        self.fail_on_wait: set[int] = set()  # ... and as failed
        self.released: list[int] = []
        self.aborted: list[int] = []
        self.uncacheable_reasons: list[str] = []
        self.statuses = 0
        self.event = b""  # the done event a RetrieveResult carries (GPU KV caches)
        self.retrieve_s = 0.0  # the daemon's own time a RetrieveResult reports (0: not measured)
        self.places: list[Any] | None = None  # LookupReply.places for lookups that ask (in-step loads)
        self.pool: list[int] = []  # HelloAck.pool
        self.mapped_pool = ""
        self._next = first_id - 1

    # ---- what the test reads and drives -------------------------------------------------------
    def kinds(self, kind: str) -> list[tuple[Any, ...]]:
        return [s for s in self.sent if s[1] == kind]

    def complete(self, rid: int, ok: bool = True, result: Result | None = None) -> None:
        """Complete request ``rid`` as the daemon would: its kind's reply, or a failure (``NotFound``)."""
        if not ok:
            self.done[rid] = Completion(rid, False, None, NotFound("scripted failure"))
            return
        self.done[rid] = Completion(rid, True, self.reply(rid) if result is None else result, None)

    def reply(self, rid: int) -> Result:
        """The daemon's reply to request ``rid`` by its kind: one entry copied, one step in order, nothing
        compared, every key pulled under ``lease_id``, no events, the lease written."""
        row = next(s for s in self.sent if s[0] == rid)
        match row[1]:
            case "store":
                return StoreResult(rid, 1, 1, 0, 0, 0)
            case "step":
                return StepResult(rid, 1, "in_order")
            case "retrieve":
                return RetrieveResult(rid, 1, 1, self.event, self.retrieve_s)
            case "verify":
                return VerifyResult(rid, 0, 0, 0, 0, 0.0, False)
            case "pull":
                return PullResult(rid, 0, row[3], self.lease_id, 30.0, row[3], 0, 0.0)
            case "events":
                return KVEvents(rid, row[2], 0, [])
            case "watch":
                return LeaseWritten(rid)
        raise ValueError(f"request {rid} ({row[1]}) gets no reply")

    def fail(self, rid: int) -> None:
        self.complete(rid, ok=False)

    def answer(self) -> None:
        """Hand out the lookup replies held back (``hold_lookups``)."""
        for c in self.held:
            self.done[c.req_id] = c
        self.held = []

    def close(self) -> None:
        self.connected = False

    def _id(self, *what: Any) -> int:
        self._next += 1
        self.sent.append((self._next, *what))
        return self._next

    # ---- DaemonPort --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        self.statuses += 1
        return {"peer": {"advertise": self.advertise}}

    def submit_lookup(self, keys: Sequence[bytes], lease: bool = True,
                      tails: Sequence[tuple[int, bytes]] = (), ends: bool = False, places: bool = False,
                      skip_tiers: int = 0) -> int:
        rid = self._id("lookup", list(keys), list(tails), ends, *([skip_tiers] if skip_tiers else []))
        hit = min(self.hit, len(keys))
        tail = next((i + 1 for i, (j, _) in enumerate(tails) if j == hit), 0) if self.tail_held else 0
        named = self.ends if ends and not tail else []
        placed = self.places if places and self.places is not None and hit else []
        reply = Completion(rid, True, LookupReply(rid, hit + (tail > 0), self.lease_id, 30.0, tail, named,
                                                  places=placed), None)
        if self.hold_lookups:
            self.held.append(reply)
        else:
            self.done[rid] = reply
        return rid

    def submit_store(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"",
                     notes: Sequence[BlockNote] | None = None, tenant: str = "", turn_end: int = 0,
                     skip_tiers: int = 0) -> int:
        return self._id("store", list(items), tenant, *([turn_end] if turn_end else []),
                        *([("skip_tiers", skip_tiers)] if skip_tiers else []))

    def submit_retrieve(self, items: Sequence[Item | Sequence[Any]], lease_id: int = 0) -> int:
        return self._id("retrieve", list(items), lease_id)

    def submit_step_event(self, seq: int, step: int, offers: Sequence[Item | Sequence[Any]],
                          confirms: Iterable[int] = (), wait_event: bytes = b"",
                          notes: Sequence[BlockNote] | None = None,
                          verifies: Sequence[Item | Sequence[Any]] = (), tenants: Sequence[str] = (),
                          skip_tiers: Sequence[int] = ()) -> int:
        rid = self._id("step", step, list(offers), list(confirms), list(verifies), list(tenants),
                       *([list(skip_tiers)] if skip_tiers else []))
        self.seqs[rid] = seq
        return rid

    def submit_verify(self, items: Sequence[Item | Sequence[Any]], wait_event: bytes = b"") -> int:
        return self._id("verify", list(items))

    def submit_events_poll(self, since: int) -> int:
        return self._id("events", since)

    def submit_pull(self, peer: str, keys: Sequence[bytes], max_chunks: int = 0, release_lease: int = 0) -> int:
        return self._id("pull", peer, len(keys), max_chunks, release_lease)

    def submit_watch(self, lease_id: int) -> int:
        return self._id("watch", lease_id)

    def release(self, lease_id: int) -> None:
        self.released.append(lease_id)

    def pin(self, session: str, tenant: str, ttl_s: float, keys: Sequence[bytes],
            partial_keys: Sequence[bytes] = ()) -> None:
        partial = [list(partial_keys)] if partial_keys else []  # a pin of whole chunks only: six fields
        self.sent.append((0, "pin", session, tenant, ttl_s, list(keys), *partial))

    def hints(self, tenant: str, keys: Sequence[bytes], actions: Sequence[tuple[str, float, str]],
              counted: Mapping[str, int]) -> None:
        self.sent.append((0, "hints", tenant, list(keys), list(actions), dict(counted)))

    def uncacheable(self, reason: str) -> None:
        self.uncacheable_reasons.append(reason)

    def abort(self, req_id: int) -> None:
        self.aborted.append(req_id)

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        out = list(self.done.values())
        self.done.clear()
        return out

    def wait(self, req_ids: Iterable[int], timeout_s: float) -> dict[int, Completion]:
        """The completions of ``req_ids``, completing those in ``finish_on_wait``; ``KVTimeout`` (as the
        client raises past ``timeout_s``) when any is still missing, the others kept for a later poll."""
        want = list(req_ids)
        for rid in want:
            if rid in self.finish_on_wait and rid not in self.done:
                self.complete(rid, ok=rid not in self.fail_on_wait)
        if any(rid not in self.done for rid in want):
            raise KVTimeout("scripted timeout")
        return {rid: self.done.pop(rid) for rid in want}
