"""Step events: the engine's per-step ordering signal for Mamba/GDN boundary states.

``StepEvent(req_id, seq, step, offers, confirms)``: ``seq`` increases by one per event on a
connection (a gap means an event was lost); ``offers`` are the boundary states this step computed,
as store items (one block each); ``confirms`` are req_ids of earlier step events whose ``StepResult`` the
engine saw before it let the offered blocks be reused. Only confirmed states become visible.
Its optional ``notes`` name the offered chunks as vLLM does (``hkvd.transport.wire.block_notes``).
The daemon answers ``StepResult(req_id, nbytes, outcome[, stored, skipped, dropped, thinned])`` once the
offered copies finish; the counts are trailing optional fields, all four left out when no copy ran (a copy
counts each offer once, so a step that copied never has all four at 0).

KV events, the connector's path (docs/routing.md): a scheduler-side connection asks
``KVEventsPoll(req_id, since)`` for the event batches of its engine's layout with sequence numbers
from ``since`` on; the daemon answers ``KVEvents(req_id, next, lost, batches)``: each batch is the
msgpack of one vLLM ``KVEventBatch``, ``next`` is the ``since`` of the next poll, ``lost`` counts the
batches between ``since`` and the oldest one the daemon still keeps (the poller fell behind).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.block_notes import BlockNote, check_notes, checked_notes
from hkvd.transport.wire.control import check_tenant
from hkvd.transport.wire.kv import Item, StoreResult, check_event, check_skip_tiers
from hkvd.transport.wire.message import MAX_ITEMS, Message, MsgType, check_u64

# An offered state's copy must finish before the engine reports step s + COPY_DEADLINE_STEPS (the daemon
# drops it otherwise): vLLM keeps the offered block for the step that computed it plus one more, and step
# s + 2's forward may overwrite it (MambaManager keeps 1 + num_speculative_blocks states live).
COPY_DEADLINE_STEPS = 2


@dataclass(frozen=True, slots=True)
class StepEvent(Message):
    TYPE = MsgType.STEP_EVENT
    req_id: int
    seq: int
    step: int
    offers: list[Item]  # decoded and checked with the frame (Item.decode_list)
    confirms: list[int]
    wait_event: bytes = b""  # the step's end event (CUDA IPC handle), as in Store.wait_event
    notes: Any = None  # vLLM's names of the offered chunks, as in Store.notes
    # Boundary states this step recomputed for a sampled hit (kv.Verify's docstring): copied under the same
    # ordering rules as offers, then compared with the entries under their keys once confirmed; never stored.
    verifies: list[Item] = field(default_factory=list)
    # The tenant of each offer (``Store.tenant``), or none: every offer the unsalted share's. Sent only to a
    # daemon whose RegisterAck.step_tenants says so.
    tenants: list[str] = field(default_factory=list)
    # The tiers each offer's request leaves out of its stores (``Store.skip_tiers``), or none: every tier for
    # every offer. Sent only to a daemon whose RegisterAck.request_tiers says so.
    skip_tiers: list[int] = field(default_factory=list)

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.seq, "seq")
        check_u64(self.step, "step")
        if len(self.confirms) > MAX_ITEMS:
            raise ProtocolViolation(f"StepEvent: at most {MAX_ITEMS} confirms")
        check_event(self.wait_event, "StepEvent.wait_event")
        if any(len(it.block_ids) != 1 for it in self.offers):
            raise ProtocolViolation("StepEvent.offers: a boundary state names exactly one block")
        if any(len(it.block_ids) != 1 for it in self.verifies):
            raise ProtocolViolation("StepEvent.verifies: a boundary state names exactly one block")
        check_notes(self.notes, "StepEvent.notes")
        if self.tenants and len(self.tenants) != len(self.offers):
            raise ProtocolViolation(f"StepEvent.tenants: one per offer ({len(self.offers)}) or none, "
                                    f"got {len(self.tenants)}")
        for t in self.tenants:
            check_tenant(t, "StepEvent.tenants")
        if self.skip_tiers and len(self.skip_tiers) != len(self.offers):
            raise ProtocolViolation(f"StepEvent.skip_tiers: one per offer ({len(self.offers)}) or none, "
                                    f"got {len(self.skip_tiers)}")
        for skip in self.skip_tiers:
            check_skip_tiers(skip, "StepEvent.skip_tiers")

    def parsed_notes(self) -> list[BlockNote]:
        return checked_notes(self.notes)


@dataclass(frozen=True, slots=True)
class StepResult(Message):
    TYPE = MsgType.STEP_RESULT
    req_id: int
    nbytes: int  # bytes the offers' copy read (0: none ran)
    outcome: str  # hkvd.daemon.engines.snapshots.StepOutcome's value
    stored: int = 0  # the counts of the offers' copy, as in StoreResult; all 0 (and left out) when none ran
    skipped: int = 0
    dropped: int = 0
    thinned: int = 0

    @classmethod
    def after_copy(cls, outcome: str, copied: StoreResult) -> Self:
        """A step event whose offers were copied (the job ``copied`` answers), with that copy's bytes and counts."""
        return cls(copied.req_id, copied.nbytes, outcome, copied.stored, copied.skipped, copied.dropped,
                   copied.thinned)


# Batches one KVEvents reply carries at most; the poller asks again for the rest.
MAX_POLL_BATCHES = 1024


@dataclass(frozen=True, slots=True)
class KVEventsPoll(Message):
    TYPE = MsgType.KV_EVENTS_POLL
    req_id: int
    since: int  # the first sequence number wanted; 0 on a new connection

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.since, "since")


@dataclass(frozen=True, slots=True)
class KVEvents(Message):
    TYPE = MsgType.KV_EVENTS
    req_id: int
    next: int
    lost: int
    batches: list[bytes]

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.next, "next")
        check_u64(self.lost, "lost")
        if len(self.batches) > MAX_POLL_BATCHES:
            raise ProtocolViolation(f"KVEvents: at most {MAX_POLL_BATCHES} batches")
