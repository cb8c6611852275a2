"""A request's states on the scheduler side (``hkvd.shim.request_state``): every transition of the table
taken, every other one refused, and the one source of "load finished" (``LoadReports``)."""

from __future__ import annotations

import itertools

import pytest

from hkvd.shim.jobs import PullSpec
from hkvd.shim.request_state import TRANSITIONS, Event, InvalidTransition, LoadReports, RequestRecord, State


def record(state: State) -> RequestRecord:
    st = RequestRecord("r1", list(range(100)), 100, state=state, lookup_id=4, hit_chunks=3, lease_id=9,
                       lease_used=True, next_store_chunk=3, pull=PullSpec("p:1", [b"k" * 16], 0))
    return st


@pytest.mark.parametrize(("start", "event"), sorted(TRANSITIONS, key=lambda t: (t[0].name, t[1].name)),
                         ids=lambda v: v.name)
def test_each_transition_of_the_table_is_taken(start: State, event: Event) -> None:
    st = record(start)
    assert st.fire(event) is TRANSITIONS[(start, event)] is st.state
    if st.state is State.LOOKUP:  # asked again: the spent lease and the old answer are gone
        assert (st.hit_chunks, st.lookup_id, st.lease_id, st.lease_used) == (0, None, 0, False)
        assert not st.answered
    elif st.state is State.FAILED:  # recomputed from scratch: no hit, no lease, every chunk stored again
        assert (st.hit_chunks, st.lease_id, st.next_store_chunk) == (0, 0, 0)
        assert st.load_failed
    else:  # the record's other fields are the caller's
        assert (st.hit_chunks, st.lookup_id, st.lease_id, st.next_store_chunk) == (3, 4, 9, 3)
    assert st.loading == (st.state is State.LOADING)


REFUSED = [(s, e) for s, e in itertools.product(State, Event) if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("start", "event"), REFUSED, ids=lambda v: v.name)
def test_every_other_transition_is_refused_and_changes_nothing(start: State, event: Event) -> None:
    st = record(start)
    with pytest.raises(InvalidTransition) as e:
        st.fire(event)
    assert (e.value.req_id, e.value.state, e.value.event) == ("r1", start, event)
    assert f"from '{start.value}' on '{event.value}'" in str(e.value)
    assert st.state is start and (st.hit_chunks, st.lease_id, st.next_store_chunk) == (3, 9, 3)


def test_the_table_covers_the_lives_vllm_gives_a_request() -> None:
    # Looked up, loaded, run, finished with copies; a failed load recomputed; a preempted one looked up again.
    lives = [
        [Event.ANSWERED, Event.LOAD_PLANNED, Event.LOAD_DONE, Event.ALLOCATED, Event.FINISHED_STORING],
        [Event.ANSWERED, Event.LOAD_PLANNED, Event.LOAD_FAILED, Event.ALLOCATED, Event.FINISHED_STORING],
        [Event.ANSWERED, Event.ALLOCATED, Event.ASKED_AGAIN, Event.ANSWERED, Event.LOAD_PLANNED, Event.FINISHED],
        [Event.ANSWERED, Event.ANSWERED, Event.LOAD_PLANNED, Event.LOAD_DONE, Event.ASKED_AGAIN],
    ]
    ends = []
    for life in lives:
        st = RequestRecord("r", [1] * 64, 64)
        assert st.state is State.LOOKUP
        for event in life:
            st.fire(event)
        ends.append(st.state)
    assert ends == [State.STORING, State.STORING, State.FINISHED, State.LOOKUP]
    # Every state is reachable from LOOKUP.
    seen, todo = {State.LOOKUP}, [State.LOOKUP]
    while todo:
        s = todo.pop()
        for (a, _), b in TRANSITIONS.items():
            if a is s and b not in seen:
                seen.add(b)
                todo.append(b)
    assert seen == set(State)


def test_a_request_finished_while_loading_never_waits_for_its_copies_too() -> None:
    # vLLM frees its blocks when the load is reported: asking for a delayed free as well would free them twice.
    assert (State.LOADING, Event.FINISHED_STORING) not in TRANSITIONS
    assert TRANSITIONS[(State.LOADING, Event.FINISHED)] is State.FINISHED


@pytest.mark.parametrize("event", list(Event), ids=lambda v: v.name)
def test_failing_safely_recomputes_and_a_promised_load_still_goes_to_the_worker(event: Event) -> None:
    st = record(State.STORING)
    st.fail_safe(event)
    assert (st.hit_chunks, st.lease_id) == (0, 0)
    # A load vLLM waits for is sent empty (the worker refuses it and reports it failed); else failed now.
    assert st.state is (State.LOADING if event is Event.LOAD_PLANNED else State.FAILED)


def test_a_load_the_watch_reported_is_taken_out_of_the_workers_later_report() -> None:
    reports = LoadReports()
    reports.watched("a")
    reports.watched("b")
    assert sorted(reports.take_watched()) == ["a", "b"] and reports.take_watched() == []
    reports.reported_by_watch("a")
    recving, failed = {"a", "c"}, {"a"}
    reports.from_workers(recving, failed)
    assert (recving, failed) == ({"c"}, set())  # vLLM hears "a" once, from the watch
    assert not reports.awaiting_workers
    recving = {"a"}
    reports.from_workers(recving, set())  # a later load of "a" (after a preemption) is the worker's
    assert recving == {"a"}


def test_a_load_the_worker_reported_first_is_not_reported_again_by_its_watch() -> None:
    reports = LoadReports()
    reports.watched("a")
    recving = {"a"}
    reports.from_workers(recving, set())
    assert recving == {"a"} and reports.take_watched() == []


def test_two_watch_reports_of_one_request_take_out_two_worker_reports() -> None:
    reports = LoadReports()
    reports.reported_by_watch("a")
    reports.reported_by_watch("a")
    for _ in range(2):
        recving = {"a"}
        reports.from_workers(recving, set())
        assert recving == set()
    recving = {"a"}
    reports.from_workers(recving, set())
    assert recving == {"a"} and not reports.awaiting_workers
