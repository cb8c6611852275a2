"""Step-ordered snapshots: when a copied Mamba/SWA state may become visible to lookups.

Role
    vLLM offers a boundary state (a Mamba block, an SWA window block) in the step that
    computes it. The block holds that state after the step's forward and may be reused by the
    forward of step ``s + 2``. A copy that races with that reuse would publish another
    request's state under this prefix's key: a silent wrong answer. This module is the
    per-engine ordering state machine that makes such a copy invisible. It never copies,
    never touches the index and never sees a socket: the connection adapter feeds it events
    and acts on the answers (start copies, discard bytes, publish entries).

Threading model
    Sans-IO and single-threaded: call every method from the event loop. Copy completions
    from the copy thread pool must be marshalled onto the loop before ``on_copy_done``.

Lifecycle of a job (one StepEvent's offers; ``job_id`` is chosen by the caller, unique for
the lifetime of the engine):

    COPYING --on_copy_done--> PENDING --confirm--> visible (forgotten here, published by the caller)
       |                         |
       | step >= s+2 reported,   | step >= s+3 reported, gap, abort, disconnect
       | gap, abort, disconnect  v
       v                      dropped
    INVALID (copy still running; on_copy_done answers False and forgets it)

Rules (docs/design.md, "Step-ordered snapshots")
    - StepEvent ``seq`` must be last + 1. ``seq <= last``: duplicate, no effect at all.
      ``seq > last + 1``: a gap; every unconfirmed job is invalidated (we may have missed
      the event whose step advance should have invalidated them), then the event is applied.
      The first event of a connection may carry any seq: there is nothing to invalidate yet.
    - Offers of step ``s`` in an event that arrives after the engine reported a step
      ``>= s + 1`` are late and refused: the copy could not be trusted to beat step ``s+2``.
    - A copy not finished when step ``s + 2`` is reported is invalid.
    - A finished copy stays pending until confirmed; the shim confirms only jobs it saw done
      before it let step ``s + 2``'s forward reuse the block.
    - A pending job not confirmed by (at the latest: in) the event reporting step ``s + 3``
      is dropped.
    - A confirm never resurrects: confirms for unknown, still-copying, invalidated or
      already visible jobs are ignored and counted.

Order inside one StepEvent (:meth:`SnapshotOrdering.on_step_event`)
    1. seq check (duplicate -> return; gap -> invalidate all unconfirmed),
    2. confirms (so a confirm carried by the event reporting ``s + 3`` still counts),
    3. step advance and the ``s + 2`` / ``s + 3`` invalidations,
    4. offers: refused if late, else a new COPYING job.

Errors
    Caller bugs (a reused job id, a completion for a job never started, events after
    disconnect) raise ``ValueError``/``KeyError``/``RuntimeError``; peers cannot cause them
    except by reusing a job id, which the adapter should treat as a protocol violation.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

from hkvd.transport.stat_fields import status_only
from hkvd.transport.wire.events import COPY_DEADLINE_STEPS

JobId = int

# The shim confirms in the event of step s+2 at the latest (it confirms before that step's
# forward); one more step of slack covers an event that carried no offers. Beyond that an
# unconfirmed state is dropped, so the pending set stays bounded by ~3 steps of offers.
CONFIRM_DEADLINE_STEPS = 3


class StepOutcome(enum.Enum):
    ACCEPT = "accept"  # in order; offers (if any) became a COPYING job
    DUPLICATE = "duplicate"  # seq already seen: ignored, reply ok
    GAP = "gap"  # seq skipped: all unconfirmed invalidated, then applied like ACCEPT
    LATE = "late"  # applied, but its offers are refused (step already passed)


class JobState(enum.Enum):
    COPYING = "copying"
    PENDING = "pending"  # copy finished, waiting for the engine's confirm
    INVALID = "invalid"  # invalidated while its copy still runs; bytes must be discarded


class StepDecision(NamedTuple):
    """What the caller must do after :meth:`SnapshotOrdering.on_step_event`.

    ``start_copies``: the event's offers became a COPYING job; start its copies and call
    ``on_copy_done``/``on_copy_failed`` when they end. ``invalidated``: jobs that just became
    invalid (discard their bytes; those still copying will get ``False`` from
    ``on_copy_done``). ``visible``: jobs confirmed by this event; publish their entries now.
    A LATE outcome wins over GAP; ``invalidated`` then still lists the gap's victims.
    """

    outcome: StepOutcome
    start_copies: bool = False
    invalidated: tuple[JobId, ...] = ()
    visible: tuple[JobId, ...] = ()


@dataclass(frozen=True, slots=True)
class SnapshotStats:
    """One engine's step-event ordering: events, gaps, jobs started, invalidated and confirmed."""

    events: int = status_only(default=0)  # step events processed, duplicates excluded
    duplicates: int = status_only(default=0)
    gaps: int = status_only(default=0)
    late_offers: int = status_only(default=0)  # events whose offers were refused as late
    jobs_started: int = status_only(default=0)
    invalidated: int = status_only(default=0)  # jobs invalidated for any reason (deadline, gap, abort, disconnect)
    confirmed: int = status_only(default=0)  # jobs made visible
    ignored_confirms: int = status_only(default=0)  # confirms for jobs not PENDING (never resurrect)
    copy_failures: int = status_only(default=0)
    discarded_copies: int = status_only(default=0)  # copies that finished after their job was invalidated


@dataclass(slots=True)
class _Job:
    step: int
    state: JobState


class SnapshotOrdering:
    """The step-ordering state machine of one engine (one registration on one connection)."""

    def __init__(self, engine_id: int) -> None:
        self.engine_id = engine_id
        self._last_seq: int | None = None
        self._max_step: int | None = None  # highest step the engine has reported
        self._jobs: dict[JobId, _Job] = {}
        self._closed = False
        self._counts: dict[str, int] = {f.name: 0 for f in fields(SnapshotStats)}

    # ------------------------------------------------------------------ events

    def on_step_event(
        self,
        seq: int,
        step: int,
        job_id: JobId,
        offers: Sequence[object],
        confirms: Iterable[JobId] = (),
    ) -> StepDecision:
        """Apply one StepEvent; see the module docstring for the order of the four phases.

        ``offers`` are opaque to this class: only their presence matters (no offers -> no
        job, and ``job_id`` is not consumed).
        """
        self._check_open()
        if seq < 0 or step < 0:
            raise ValueError(f"engine {self.engine_id}: seq and step must be >= 0, got {seq}, {step}")
        # 1. Ordering.
        if self._last_seq is not None and seq <= self._last_seq:
            self._count("duplicates")
            return StepDecision(StepOutcome.DUPLICATE)
        if offers and job_id in self._jobs:
            raise ValueError(f"engine {self.engine_id}: job id {job_id} reused while still tracked")
        gap = self._last_seq is not None and seq > self._last_seq + 1
        self._last_seq = seq
        self._count("events")
        invalidated: list[JobId] = []
        if gap:
            self._count("gaps")
            invalidated.extend(self._invalidate_all())
        # 2. Confirms before the advance: the event reporting s+3 may still confirm step s.
        visible = self.on_confirm(confirms)
        # 3. Step advance.
        if self._max_step is None or step > self._max_step:
            self._max_step = step
            invalidated.extend(self._expire(step))
        # 4. Offers. step < max_step <=> the engine reported >= step+1 before this event.
        started = False
        late = step < self._max_step
        if offers:
            if late:
                self._count("late_offers")
            else:
                self._jobs[job_id] = _Job(step, JobState.COPYING)
                self._count("jobs_started")
                started = True
        if late and offers:
            outcome = StepOutcome.LATE
        elif gap:
            outcome = StepOutcome.GAP
        else:
            outcome = StepOutcome.ACCEPT
        return StepDecision(outcome, started, tuple(invalidated), tuple(visible))

    def on_copy_done(self, job_id: JobId) -> bool:
        """A job's copies all finished. True: keep it as pending-confirm. False: it was
        invalidated meanwhile; the caller must discard the copied bytes."""
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"engine {self.engine_id}: copy done for unknown job {job_id}")
        if job.state is JobState.INVALID:
            del self._jobs[job_id]
            self._count("discarded_copies")
            return False
        if job.state is not JobState.COPYING:
            raise ValueError(f"engine {self.engine_id}: copy done twice for job {job_id}")
        job.state = JobState.PENDING
        return True

    def on_copy_failed(self, job_id: JobId) -> None:
        """A job's copy failed: forget it (nothing was published, nothing to confirm)."""
        job = self._jobs.get(job_id)
        if job is None or job.state is JobState.PENDING:
            raise KeyError(f"engine {self.engine_id}: copy failed for job {job_id} that is not copying")
        del self._jobs[job_id]
        self._count("copy_failures")

    def on_confirm(self, job_ids: Iterable[JobId]) -> list[JobId]:
        """Confirm jobs; returns those that become visible now, in the given order.

        Prefer passing confirms to :meth:`on_step_event`, which applies them at the right
        point; calling this directly applies them against the current step.
        """
        self._check_open()
        visible: list[JobId] = []
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None or job.state is not JobState.PENDING:
                # Unknown, already visible, still copying (the shim confirms only what it
                # saw done) or invalidated: never resurrect.
                self._count("ignored_confirms")
                continue
            del self._jobs[job_id]
            visible.append(job_id)
            self._count("confirmed")
        return visible

    def on_abort(self, job_ids: Iterable[JobId]) -> list[JobId]:
        """The engine aborted these jobs; returns those that were invalidated. Visible
        (already confirmed) jobs are not recalled: their entries are correct data."""
        self._check_open()
        out: list[JobId] = []
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None and job.state is not JobState.INVALID:
                self._invalidate(job_id, job)
                out.append(job_id)
        return out

    def on_disconnect(self) -> list[JobId]:
        """The engine is gone: every unconfirmed job is invalidated and returned. Further
        step events are refused; copy completions still answer (False)."""
        out = self._invalidate_all()
        self._closed = True
        return out

    # ------------------------------------------------------------------ introspection

    def job_state(self, job_id: JobId) -> JobState | None:
        """The job's state, or None when it is unknown, visible, or fully discarded."""
        job = self._jobs.get(job_id)
        return None if job is None else job.state

    @property
    def max_step(self) -> int | None:
        return self._max_step

    def statistics(self) -> SnapshotStats:
        return SnapshotStats(**self._counts)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id}: snapshot ordering used after disconnect")

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] += n

    def _invalidate(self, job_id: JobId, job: _Job) -> None:
        if job.state is JobState.COPYING:
            job.state = JobState.INVALID  # keep a tombstone until the copy returns
        else:
            del self._jobs[job_id]
        self._count("invalidated")

    def _invalidate_all(self) -> list[JobId]:
        out = [jid for jid, job in self._jobs.items() if job.state is not JobState.INVALID]
        for jid in out:
            self._invalidate(jid, self._jobs[jid])
        return out

    def _expire(self, step: int) -> list[JobId]:
        out: list[JobId] = []
        for jid, job in list(self._jobs.items()):
            if (job.state is JobState.COPYING and step >= job.step + COPY_DEADLINE_STEPS) or (
                job.state is JobState.PENDING and step >= job.step + CONFIRM_DEADLINE_STEPS
            ):
                self._invalidate(jid, job)
                out.append(jid)
        return out
