"""Step events: the Mamba boundary states an engine offers each step, and when they may be seen.

Role
    Serves ``StepEvent``: its offers (states to store) and verifies (states of a sampled hit, copied
    to scratch room) are one job, copied, invalidated and confirmed together. ``SnapshotOrdering``
    (``daemon/engines/snapshots.py``) decides which earlier jobs a step confirms (their entries turn
    READY; their scratch is compared) and which it invalidates (dropped, never compared).

Threading
    Event loop; the copies run on the step events' own thread (``Copies``, ``urgent``): a state is due
    before step s+2 is reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hkvd.daemon.engines.connection import registered_engine
from hkvd.daemon.engines.snapshots import StepOutcome
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.events import StepResult

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.engines.snapshots import StepDecision
    from hkvd.daemon.engines.stores import Stores
    from hkvd.daemon.engines.verification import Verification
    from hkvd.daemon.metrics import Metrics
    from hkvd.transport.wire import events


class StepEvents:
    """Boundary states: written by ``stores`` (pending), checked by ``verification``."""

    def __init__(self, index: Cache, stores: Stores, verification: Verification, metrics: Metrics) -> None:
        self.index = index
        self.stores = stores
        self.verification = verification
        self.metrics = metrics

    async def step_event(self, conn: Conn, msg: events.StepEvent) -> None:
        engine = registered_engine(conn, copy=True)
        assert conn.snapshots is not None
        offers, verifies = msg.offers, msg.verifies
        for field_name, items in (("offers", offers), ("verifies", verifies)):
            for it in items:
                if engine.check_item(it).kind != "mamba":
                    raise ProtocolViolation(f"StepEvent {field_name} carry Mamba states only; group {it.group_id} "
                                            f"is {engine.groups[it.group_id].kind}")
        notes = self.stores.check_notes(engine, msg.parsed_notes(), offers)
        # Offers and verifies of one event are one job: copied, invalidated and confirmed together.
        decision = conn.snapshots.on_step_event(msg.seq, msg.step, msg.req_id, [*offers, *verifies],
                                                list(msg.confirms))
        self._settle(conn, engine, decision)
        if not decision.start_copies:
            conn.send(StepResult(msg.req_id, 0, decision.outcome.value))
            return
        try:
            copied, written = await self.stores.write_items(conn, engine, offers, job_id=msg.req_id,
                                                            pending=True, wait_event=msg.wait_event, notes=notes,
                                                            tenant=msg.tenants or "")
        except BaseException:
            conn.snapshots.on_copy_failed(msg.req_id)
            raise
        try:
            scratch = await self.verification.copy_scratch(conn, engine, verifies, msg.wait_event, urgent=True)
        except BaseException:
            conn.snapshots.on_copy_failed(msg.req_id)
            for e in written:
                self.index.drop(e)
            raise
        if conn.snapshots.on_copy_done(msg.req_id):
            conn.pending[msg.req_id] = written
            if scratch:
                conn.verifying[msg.req_id] = scratch
        else:  # invalidated while copying: the block may have been reused under us
            for e in written:
                self.index.drop(e)
            self.verification.free_scratch(scratch)
        conn.send(StepResult.after_copy(decision.outcome.value, copied))

    def _settle(self, conn: Conn, engine: EngineState, decision: StepDecision) -> None:
        """Confirm the jobs ``decision`` made visible (entries READY and offered to the tiers, scratch
        compared), drop the ones it invalidated, and count the outcome."""
        for job in decision.visible:
            for e in conn.pending.pop(job, []):
                if self.index.confirm(e):  # not if it was dropped meanwhile: its pages may hold another entry
                    self.stores.write_behind([e])
            if job in conn.verifying:
                self.verification.start_check(engine, conn.verifying.pop(job))
        self.drop_jobs(conn, list(decision.invalidated))
        self.metrics.inc("step_events", outcome=decision.outcome.value)
        if decision.outcome is StepOutcome.GAP:
            self.metrics.inc("step_event_gaps")

    def drop_jobs(self, conn: Conn, job_ids: list[int]) -> None:
        """Drop the entries of unconfirmed jobs and free their scratch (never compared: it may hold a
        later state)."""
        for job in job_ids:
            for e in conn.pending.pop(job, []):
                self.index.drop(e)
            self.verification.free_scratch(conn.verifying.pop(job, []))
            self.metrics.inc("snapshots_invalidated")
