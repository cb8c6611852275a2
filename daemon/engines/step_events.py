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
from hkvd.transport.tier_matchers import POOL
from hkvd.transport.wire.events import StepResult

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache, EntryKey
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.engines.snapshots import StepDecision
    from hkvd.daemon.engines.stores import Stores
    from hkvd.daemon.engines.verification import Verification
    from hkvd.daemon.metrics import Metrics
    from hkvd.transport.wire import events
    from hkvd.transport.wire.kv import Item


class StepEvents:
    """Boundary states: written by ``stores`` (pending), checked by ``verification``."""

    def __init__(self, index: Cache, stores: Stores, verification: Verification, metrics: Metrics) -> None:
        self.index = index
        self.stores = stores
        self.verification = verification
        self.metrics = metrics
        # Pending jobs' entries whose request's store tiers leave a tier out (StepEvent.skip_tiers), by (connection,
        # job): applied to the write-behind when the job is confirmed; gone with the job, confirmed or dropped.
        self._skips: dict[tuple[int, int], dict[EntryKey, int]] = {}

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
        stored, tenants, skips = self._stored_offers(engine, msg)
        try:
            copied, written = await self.stores.write_items(conn, engine, stored, job_id=msg.req_id,
                                                            pending=True, wait_event=msg.wait_event, notes=notes,
                                                            tenant=tenants)
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
            if skips:
                self._skips[(conn.conn_id, msg.req_id)] = skips
            if scratch:
                conn.verifying[msg.req_id] = scratch
        else:  # invalidated while copying: the block may have been reused under us
            for e in written:
                self.index.drop(e)
            self.verification.free_scratch(scratch)
        conn.send(StepResult.after_copy(decision.outcome.value, copied))

    def _stored_offers(self, engine: EngineState, msg: events.StepEvent
                       ) -> tuple[list[Item], str | list[str], dict[EntryKey, int]]:
        """The offers to store, their tenants, and the tiers below the pool each one's store tiers leave out (by
        entry key, only where any). An offer whose store tiers leave the pool out is not stored (counted)."""
        if not msg.skip_tiers:
            return msg.offers, msg.tenants or "", {}
        stored: list[Item] = []
        tenants: list[str] = []
        skips: dict[EntryKey, int] = {}
        for i, (it, skip) in enumerate(zip(msg.offers, msg.skip_tiers, strict=True)):
            if skip & POOL:
                self.stores.count_outcome("store_tiers", 1, engine.entry_bytes[it.group_id])
                continue
            stored.append(it)
            tenants.append(msg.tenants[i] if msg.tenants else "")
            if skip:
                skips[(engine.fingerprint, it.group_id, it.key)] = skip
        return stored, tenants, skips

    def _settle(self, conn: Conn, engine: EngineState, decision: StepDecision) -> None:
        """Confirm the jobs ``decision`` made visible (entries READY and offered to the tiers, scratch
        compared), drop the ones it invalidated, and count the outcome."""
        for job in decision.visible:
            skips = self._skips.pop((conn.conn_id, job), {})
            for e in conn.pending.pop(job, []):
                if self.index.confirm(e):  # not if it was dropped meanwhile: its pages may hold another entry
                    self.stores.write_behind([e], skips.get(e.key, 0))
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
            self._skips.pop((conn.conn_id, job), None)
            for e in conn.pending.pop(job, []):
                self.index.drop(e)
            self.verification.free_scratch(conn.verifying.pop(job, []))
            self.metrics.inc("snapshots_invalidated")
