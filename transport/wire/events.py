"""Step events: the engine's per-step ordering signal for Mamba/GDN boundary states.

``StepEvent(req_id, seq, step, offers, confirms)``: ``seq`` increases by one per event on a
connection (a gap means an event was lost); ``offers`` are the boundary states this step computed,
as store items (one block each); ``confirms`` are req_ids of earlier step events whose ``Done`` the
engine saw before it let the offered blocks be reused. Only confirmed states become visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire import MAX_ITEMS, Message, MsgType, check_u64
from hkvd.transport.wire.kv import Item, check_event, checked_items, parse_items


@dataclass(frozen=True, slots=True)
class StepEvent(Message):
    TYPE = MsgType.STEP_EVENT
    req_id: int
    seq: int
    step: int
    offers: list[Any]
    confirms: list[int]
    wait_event: bytes = b""  # the step's end event (CUDA IPC handle), as in Store.wait_event

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.seq, "seq")
        check_u64(self.step, "step")
        if len(self.confirms) > MAX_ITEMS:
            raise ProtocolViolation(f"StepEvent: at most {MAX_ITEMS} confirms")
        check_event(self.wait_event, "StepEvent.wait_event")
        parsed = parse_items(self.offers, "StepEvent.offers")
        if any(len(it.block_ids) != 1 for it in parsed):
            raise ProtocolViolation("StepEvent.offers: a boundary state names exactly one block")

    def parsed(self) -> list[Item]:
        return checked_items(self.offers)  # validated when decoded
