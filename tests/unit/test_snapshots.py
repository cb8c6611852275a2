"""Step-ordered snapshots: every event order that matters, plus a stateful property test."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkvd.daemon.engines.snapshots import JobState, SnapshotOrdering, StepDecision, StepOutcome

OFFER = ("r1", 1, 6, 64)  # (req, group, block, boundary tokens): opaque to the machine


def fresh() -> SnapshotOrdering:
    return SnapshotOrdering(engine_id=7)


# ---------------------------------------------------------------- in order


def test_happy_path_copy_then_confirm_at_s2() -> None:
    o = fresh()
    d = o.on_step_event(0, 10, job_id=1, offers=[OFFER])
    assert d == StepDecision(StepOutcome.ACCEPT, start_copies=True)
    assert o.job_state(1) is JobState.COPYING
    o.on_step_event(1, 11, job_id=2, offers=[])
    assert o.on_copy_done(1) is True
    assert o.job_state(1) is JobState.PENDING
    # The shim confirms in the event of step s+2 (before that forward reuses the block).
    d = o.on_step_event(2, 12, job_id=3, offers=[], confirms=[1])
    assert d.visible == (1,)
    assert d.invalidated == ()
    assert o.job_state(1) is None
    s = o.statistics()
    assert (s.events, s.confirmed, s.jobs_started, s.invalidated) == (3, 1, 1, 0)


def test_confirm_carried_by_s3_event_still_counts() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    d = o.on_step_event(1, 13, 2, [], confirms=[1])  # confirms are applied before the advance
    assert d.visible == (1,)
    assert d.invalidated == ()


def test_pending_not_confirmed_by_s3_is_dropped() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    assert o.on_step_event(1, 12, 2, []).invalidated == ()  # s+2: still pending
    assert o.on_step_event(2, 13, 3, []).invalidated == (1,)
    d = o.on_step_event(3, 14, 4, [], confirms=[1])  # too late: must not resurrect
    assert d.visible == ()
    assert o.statistics().ignored_confirms == 1


def test_copy_still_running_at_s2_is_invalid_and_discarded() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_step_event(1, 11, 2, []).invalidated == ()
    d = o.on_step_event(2, 12, 3, [])
    assert d.invalidated == (1,)
    assert o.job_state(1) is JobState.INVALID
    assert o.on_copy_done(1) is False  # copies finishing late: discard the bytes
    assert o.job_state(1) is None
    assert o.on_step_event(3, 12, 4, [], confirms=[1]).visible == ()
    assert o.statistics().discarded_copies == 1


def test_step_jump_over_s2_in_one_event() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_step_event(1, 20, 2, []).invalidated == (1,)


def test_confirm_of_still_copying_job_is_ignored() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_step_event(1, 11, 2, [], confirms=[1]).visible == ()
    assert o.on_copy_done(1) is True
    assert o.on_step_event(2, 12, 3, [], confirms=[1]).visible == (1,)
    assert o.statistics().ignored_confirms == 1


def test_same_step_events_are_not_late() -> None:
    o = fresh()
    assert o.on_step_event(0, 10, 1, [OFFER]).start_copies
    assert o.on_step_event(1, 10, 2, [OFFER]).start_copies


def test_event_without_offers_starts_nothing_and_does_not_consume_job_id() -> None:
    o = fresh()
    d = o.on_step_event(0, 10, 1, [])
    assert d == StepDecision(StepOutcome.ACCEPT)
    assert o.job_state(1) is None
    assert o.on_step_event(1, 10, 1, [OFFER]).start_copies


# ---------------------------------------------------------------- reordered, duplicated, gaps, late


def test_duplicate_is_ignored_entirely() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    d = o.on_step_event(0, 15, 9, [OFFER], confirms=[1])  # replay of seq 0 (with junk)
    assert d == StepDecision(StepOutcome.DUPLICATE)
    assert o.max_step == 10
    assert o.job_state(1) is JobState.PENDING
    assert o.job_state(9) is None
    assert o.statistics().duplicates == 1


def test_reordered_seq_older_than_last_counts_as_duplicate() -> None:
    o = fresh()
    o.on_step_event(5, 10, 1, [OFFER])
    o.on_step_event(6, 11, 2, [OFFER])
    assert o.on_step_event(4, 9, 3, [OFFER]).outcome is StepOutcome.DUPLICATE


def test_gap_invalidates_every_unconfirmed_job_then_applies() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])  # stays copying
    o.on_step_event(1, 10, 2, [OFFER])
    assert o.on_copy_done(2)  # pending
    d = o.on_step_event(3, 11, 3, [OFFER], confirms=[2])  # seq 2 lost
    assert d.outcome is StepOutcome.GAP
    assert d.start_copies
    assert sorted(d.invalidated) == [1, 2]
    assert d.visible == ()  # the gap came first: confirm must not resurrect job 2
    assert o.job_state(3) is JobState.COPYING
    assert o.on_copy_done(1) is False
    assert o.statistics().gaps == 1


def test_gap_does_not_recall_visible_jobs() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    assert o.on_step_event(1, 11, 2, [], confirms=[1]).visible == (1,)
    assert o.on_step_event(5, 12, 3, []).invalidated == ()


def test_late_offers_are_refused() -> None:
    o = fresh()
    o.on_step_event(0, 11, 1, [])
    d = o.on_step_event(1, 10, 2, [OFFER])  # offers of step 10 after step 11 was reported
    assert d.outcome is StepOutcome.LATE
    assert not d.start_copies
    assert o.job_state(2) is None
    assert o.max_step == 11
    assert o.statistics().late_offers == 1


def test_late_event_still_delivers_its_confirms() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    o.on_step_event(1, 11, 2, [])
    d = o.on_step_event(2, 10, 3, [OFFER], confirms=[1])
    assert d.outcome is StepOutcome.LATE
    assert d.visible == (1,)


def test_late_wins_over_gap() -> None:
    o = fresh()
    o.on_step_event(0, 11, 1, [OFFER])
    d = o.on_step_event(2, 10, 2, [OFFER])
    assert d.outcome is StepOutcome.LATE
    assert d.invalidated == (1,)
    s = o.statistics()
    assert (s.gaps, s.late_offers) == (1, 1)


def test_first_event_may_have_any_seq() -> None:
    o = fresh()
    assert o.on_step_event(41, 3, 1, [OFFER]).outcome is StepOutcome.ACCEPT


# ---------------------------------------------------------------- abort, failure, disconnect


def test_abort_copying_and_pending() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    o.on_step_event(1, 10, 2, [OFFER])
    assert o.on_copy_done(2)
    assert o.on_abort([1, 2, 99]) == [1, 2]
    assert o.on_abort([1]) == []  # already invalid: not reported twice
    assert o.on_copy_done(1) is False
    assert o.on_step_event(2, 11, 3, [], confirms=[1, 2]).visible == ()


def test_abort_after_confirm_is_a_noop() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    assert o.on_confirm([1]) == [1]
    assert o.on_abort([1]) == []


def test_copy_failed_forgets_job() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    o.on_copy_failed(1)
    assert o.job_state(1) is None
    assert o.on_confirm([1]) == []
    assert o.statistics().copy_failures == 1
    with pytest.raises(KeyError):
        o.on_copy_failed(1)


def test_disconnect_drops_everything_unconfirmed() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    o.on_step_event(1, 10, 2, [OFFER])
    o.on_step_event(2, 10, 3, [OFFER])
    assert o.on_copy_done(2)
    assert o.on_copy_done(3)
    assert o.on_confirm([3]) == [3]
    assert sorted(o.on_disconnect()) == [1, 2]
    assert o.on_copy_done(1) is False  # the copy thread may still report afterwards
    with pytest.raises(RuntimeError):
        o.on_step_event(3, 11, 4, [])
    with pytest.raises(RuntimeError):
        o.on_confirm([2])


def test_caller_bugs_raise() -> None:
    o = fresh()
    o.on_step_event(0, 10, 1, [OFFER])
    with pytest.raises(ValueError, match="reused"):
        o.on_step_event(1, 10, 1, [OFFER])
    assert o.on_copy_done(1)
    with pytest.raises(ValueError, match="twice"):
        o.on_copy_done(1)
    with pytest.raises(KeyError):
        o.on_copy_done(42)
    with pytest.raises(ValueError, match=">= 0"):
        o.on_step_event(2, -1, 2, [])


# ---------------------------------------------------------------- stateful property


@dataclass
class Facts:
    """What the test knows about one job, from the outside."""

    step: int
    done_at_max_step: int | None = None  # highest reported step when the copy finished
    finished: bool = False  # on_copy_done/on_copy_failed was called
    failed: bool = False
    killed: bool = False  # a gap, abort or disconnect hit it while unconfirmed
    visible: bool = False
    sut: SnapshotOrdering | None = None  # the ordering (connection) that started it


class OrderingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sut = fresh()
        self.jobs: dict[int, Facts] = {}
        self.next_job = 1
        self.last_seq: int | None = None
        self.max_step: int | None = None
        self.old: dict[int, Facts] = {}  # jobs of connections that were dropped

    # -- helpers

    def _confirmable(self, jid: int, max_step_before: int | None) -> bool:
        f = self.jobs.get(jid)
        return (
            f is not None
            and not f.visible
            and not f.killed
            and not f.failed
            and f.done_at_max_step is not None
            and f.done_at_max_step < f.step + 2  # copy finished before s+2 was reported
            and (max_step_before is None or max_step_before < f.step + 3)  # confirmed by s+3
        )

    def _kill_unconfirmed(self, ids) -> None:
        for jid in ids:
            f = self.jobs[jid]
            if not f.visible:
                f.killed = True

    # -- rules

    @rule(
        data=st.data(),
        seq_kind=st.sampled_from(["next"] * 8 + ["dup", "gap"]),
        step_delta=st.sampled_from([-2, -1, 0, 0, 1, 1, 1, 2, 3]),
        with_offers=st.booleans(),
    )
    def step_event(self, data, seq_kind: str, step_delta: int, with_offers: bool) -> None:
        if self.last_seq is None:
            seq = 0
        else:
            seq = {"next": self.last_seq + 1, "dup": self.last_seq, "gap": self.last_seq + 2}[seq_kind]
        step = max(0, (self.max_step or 0) + step_delta)
        known = sorted(self.jobs)
        confirms = data.draw(st.lists(st.sampled_from([*known, 10_000]), max_size=4, unique=True))
        jid = self.next_job
        d = self.sut.on_step_event(seq, step, jid, [OFFER] if with_offers else [], confirms)

        if self.last_seq is not None and seq <= self.last_seq:
            assert d == StepDecision(StepOutcome.DUPLICATE)
            return
        gap = self.last_seq is not None and seq > self.last_seq + 1
        self.last_seq = seq
        if gap:
            self._kill_unconfirmed(self.jobs)
        before = self.max_step
        expected_visible = [j for j in confirms if self._confirmable(j, before)]
        # Safety: a job is visible only if its copy finished before s+2 was reported, it was
        # confirmed, and nothing invalidated it first. Precision: and every such job is.
        assert list(d.visible) == expected_visible
        for j in d.visible:
            self.jobs[j].visible = True
        self.max_step = step if before is None else max(before, step)
        late = step < self.max_step
        assert d.start_copies == (with_offers and not late)
        if with_offers:
            assert d.outcome is (StepOutcome.LATE if late else StepOutcome.GAP if gap else StepOutcome.ACCEPT)
        for j in d.invalidated:
            assert not self.jobs[j].visible
        if d.start_copies:
            self.jobs[jid] = Facts(step, sut=self.sut)
            self.next_job += 1

    @rule(data=st.data())
    def copy_done(self, data) -> None:
        running = [f for f in (*self.jobs.values(), *self.old.values()) if not f.finished]
        if not running:
            return
        f = data.draw(st.sampled_from(running))
        jid = next(j for j, g in (*self.jobs.items(), *self.old.items()) if g is f)
        f.finished = True
        f.done_at_max_step = self.max_step
        in_time = self.max_step is None or self.max_step < f.step + 2
        assert f.sut is not None
        assert f.sut.on_copy_done(jid) is (in_time and not f.killed)

    @rule(data=st.data())
    def copy_failed(self, data) -> None:
        running = [(j, f) for j, f in (*self.jobs.items(), *self.old.items()) if not f.finished]
        if not running:
            return
        jid, f = data.draw(st.sampled_from(running))
        f.finished = f.failed = True
        assert f.sut is not None
        f.sut.on_copy_failed(jid)

    @rule(data=st.data())
    def abort(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from([*self.jobs, 10_000]), max_size=3, unique=True))
        out = self.sut.on_abort(ids)
        for j in out:
            assert not self.jobs[j].visible
        self._kill_unconfirmed(j for j in ids if j in self.jobs)

    @precondition(lambda self: len(self.jobs) >= 4)
    @rule(really=st.integers(0, 3))
    def disconnect(self, really: int) -> None:
        if really:  # keep disconnects rare so long step histories get explored
            return
        out = self.sut.on_disconnect()
        for j in out:
            assert not self.jobs[j].visible
        self._kill_unconfirmed(self.jobs)
        with pytest.raises(RuntimeError):
            self.sut.on_step_event(0, 0, 0, [])
        # The engine re-registers on a new connection: a fresh ordering, fresh seq and steps;
        # copies of the old connection's jobs may still complete and must be discarded.
        self.old.update(self.jobs)
        self.jobs = {}
        self.sut = fresh()
        self.last_seq = self.max_step = None

    # -- invariants

    @invariant()
    def states_agree(self) -> None:
        for jid, f in self.jobs.items():
            state = self.sut.job_state(jid)
            if f.visible or f.failed:
                assert state is None
            elif state is JobState.PENDING:
                assert f.done_at_max_step is not None
                assert not f.killed
            elif state is JobState.COPYING:
                assert not f.finished
                assert not f.killed

    @invariant()
    def statistics_add_up(self) -> None:
        s = self.sut.statistics()
        assert s.confirmed == sum(f.visible for f in self.jobs.values())
        assert s.jobs_started == len(self.jobs)


TestOrderingMachine = OrderingMachine.TestCase
TestOrderingMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
