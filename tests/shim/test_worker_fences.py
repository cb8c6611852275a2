# SPDX-License-Identifier: Apache-2.0
"""Worker-side ordering rules with the one fake daemon (no daemon, no model).

The real daemon copies too fast to catch a copy in flight at a block reuse, so these tests
script completions: fences wait for copies out of reused blocks, a fence timeout aborts and
never confirms, confirms carry only step events seen done, a state copy offered two steps back is
waited for once (the daemon drops it otherwise), delayed frees wait for copies, and
every load is reported finished once, after the daemon's reply and never before, a failed one as a
failed request (never as block errors), while ``start_load_kv`` never waits for a load.
"""

from __future__ import annotations

from typing import Any

import pytest

from hkvd.shim.testing.fake_daemon import FakeDaemon
from hkvd.transport.wire.kv import Item

pytestmark = pytest.mark.vllm


class FenceDaemon(FakeDaemon):
    """The one fake daemon (hkvd.shim.testing.fake_daemon), with the worker's ordering rules checked where
    they are observed: host KV caches send no GPU events, and no step waits for a load."""

    def submit_store(self, items: Any, wait_event: bytes = b"", *args: Any, **kw: Any) -> int:
        assert wait_event == b""  # host KV caches: no GPU events
        return super().submit_store(items, wait_event, *args, **kw)

    def submit_step_event(self, seq: int, step: int, offers: Any, confirms: Any = (), wait_event: bytes = b"",
                          notes: Any = None, verifies: Any = (), *args: Any, **kw: Any) -> int:
        assert wait_event == b"" and list(verifies) == []  # no sampled hits here
        return super().submit_step_event(seq, step, offers, confirms, wait_event, notes, verifies, *args, **kw)

    def wait(self, req_ids: Any, timeout_s: float) -> dict[int, Any]:
        kinds = {s[0]: s[1] for s in self.sent}
        assert all(kinds[rid] != "retrieve" for rid in req_ids), "a step waited for a load"
        return super().wait(req_ids, timeout_s)


def _side() -> tuple[Any, FenceDaemon]:
    from hkvd.shim.shim_config import ShimConfig
    from hkvd.shim.worker import WorkerSide

    side = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent", fence_timeout_s=0.01))
    client = FenceDaemon()
    side.link.client = client
    side._regions = [object()]  # registered
    return side, client


def _meta(step: int, **kw: Any) -> Any:
    from hkvd.shim.metadata import HkvdConnectorMetadata

    return HkvdConnectorMetadata(step=step, **kw)


def _run_step(side: Any, meta: Any) -> tuple[set[str] | None, set[str]]:
    """One step as vLLM's model runner drives it; returns (finished sending, failed loads).

    What it reported as finished receiving is left in ``side._last_recving``.
    """
    side.handle_preemptions(meta)
    side.bind(meta)
    side.start_load_kv()
    side.wait_for_save()
    sending, recving, failed = side.get_transfer_results(set(meta.delayed_free))
    assert failed <= recving, "a failed load is also reported finished"
    reported = getattr(side, "_reported", set())
    assert not (recving & reported), "a load is reported once"
    side._reported = reported | recving
    side._last_recving = recving
    assert side.get_block_ids_with_load_errors() == set()  # vLLM stops hybrid engines on these
    return sending or None, failed


def test_fence_waits_for_copy_out_of_reused_block_then_confirms() -> None:
    from hkvd.shim.jobs import StoreJob

    side, client = _side()
    offer = ("r1", Item(1, 0, b"k" * 16, [9]))
    _run_step(side, _meta(1, stores=[StoreJob("r1", [Item(0, 0, b"k" * 16, [5, 6])])], offers=[offer]))
    store_id, step_id = 1, 2
    client.finish_on_wait = {store_id, step_id}
    _run_step(side, _meta(2, fence_blocks={6, 9}))  # both blocks reused now: wait for both copies
    assert client.aborted == []
    assert side.stats["stores"] == 1
    (last,) = [s for s in client.sent if s[1] == "step" and s[2] == 2]
    assert last[4] == [step_id]  # seen done before the reuse: confirmed


def test_fence_timeout_aborts_and_never_confirms() -> None:
    side, client = _side()
    _run_step(side, _meta(1, offers=[("r1", Item(1, 0, b"k" * 16, [9]))]))
    _run_step(side, _meta(2, fence_blocks={9}))  # the copy never finishes
    step_id = 1  # the step-1 event carrying the offer
    assert client.aborted == [step_id]
    client.complete(step_id)  # a late Done must not resurrect it
    _run_step(side, _meta(3))
    confirms = [s[4] for s in client.sent if s[1] == "step"]
    assert all(step_id not in c for c in confirms)
    assert side.stats["fence_timeouts"] == 1


def test_state_copy_two_steps_back_is_waited_for_then_confirmed() -> None:
    side, client = _side()
    _run_step(side, _meta(1, offers=[("r1", Item(1, 0, b"k" * 16, [9]))]))
    _run_step(side, _meta(2))  # still copying: one step late is in time
    step_id = 1
    assert side.stats["state_copy_waits"] == 0
    client.finish_on_wait = {step_id}
    _run_step(side, _meta(3))  # its copy must end before step 3 is reported: waited for before the forward
    assert side.stats["state_copy_waits"] == 1 and side.stats["state_copy_timeouts"] == 0
    (third,) = [s for s in client.sent if s[1] == "step" and s[2] == 3]
    assert third[4] == [step_id]  # done before the event reporting step 3: confirmed in it
    assert client.aborted == []


def test_state_copy_past_its_wait_is_left_to_the_daemon_and_not_waited_for_again() -> None:
    side, client = _side()
    _run_step(side, _meta(1, offers=[("r1", Item(1, 0, b"k" * 16, [9]))]))
    _run_step(side, _meta(2))
    _run_step(side, _meta(3))  # the copy never ends in time: the daemon drops it once step 3 is reported
    _run_step(side, _meta(4))
    assert side.stats["state_copy_waits"] == 1 and side.stats["state_copy_timeouts"] == 1
    assert client.aborted == []  # its block was not reused: nothing to abort, the daemon's rule ends it
    assert all(1 not in s[4] for s in client.sent if s[1] == "step")


def test_delayed_free_waits_for_copies() -> None:
    from hkvd.shim.jobs import StoreJob

    side, client = _side()
    _run_step(side, _meta(1, stores=[StoreJob("r1", [Item(0, 0, b"k" * 16, [5])])]))
    sending, _ = _run_step(side, _meta(2, delayed_free=["r1"]))
    assert sending is None  # store 1 still copying
    client.complete(1)
    sending, _ = _run_step(side, _meta(3))
    assert sending == {"r1"}


def test_loads_end_with_the_daemons_reply_and_never_hold_a_step() -> None:
    from hkvd.shim.jobs import LoadJob

    side, client = _side()
    ok = LoadJob("a", 7, [Item(0, 0, b"k" * 16, [3])], [3])
    bad = LoadJob("b", 8, [[0, 0, b"j" * 16, [4]]], [4])
    empty = LoadJob("c", 9, [], [11, 12])  # the scheduler could not plan it (null block)
    _, failed = _run_step(side, _meta(1, loads=[ok, bad, empty]))
    assert failed == {"c"} and side._last_recving == {"c"}  # no copy to wait for: reported at once
    for step in (2, 3):  # the daemon is still copying: the steps go on, nothing is reported
        _, failed = _run_step(side, _meta(step, offers=[("x", Item(1, 0, b"m" * 16, [9]))]))
        assert failed == set() and side._last_recving == set()
    assert len([s for s in client.sent if s[1] == "step"]) == 3  # each step's event went out meanwhile
    assert side.loads.requests() == {"a", "b"}
    client.complete(1)
    client.complete(2, ok=False)
    _, failed = _run_step(side, _meta(4))
    assert side._last_recving == {"a", "b"} and failed == {"b"}
    assert side.loads.stats["loads_ok"] == 1 and side.loads.stats["loads_failed"] == 2
    _, failed = _run_step(side, _meta(5))
    assert failed == set() and side._last_recving == set()  # reported once


class FakeGpu:
    """``shim.gpu.GpuOrdering``'s boundary: records which done events the engine's stream waited on."""

    def __init__(self, side: Any) -> None:
        self.side = side
        self.waited: list[tuple[bytes, set[str]]] = []

    def wait_loaded(self, handle: bytes) -> None:
        self.waited.append((handle, set(self.side._reported)))

    def step_end_event(self) -> bytes:
        return b""


def test_gpu_load_waits_on_the_daemons_event_before_it_is_reported() -> None:
    from hkvd.shim.jobs import LoadJob

    side, client = _side()
    side._gpu = gpu = FakeGpu(side)
    side._reported = set()
    _run_step(side, _meta(1, loads=[LoadJob("g", 7, [Item(0, 0, b"k" * 16, [3])], [3]),
                                    LoadJob("h", 8, [Item(0, 0, b"j" * 16, [4])], [4])]))
    assert gpu.waited == []
    client.event = b"E" * 64
    client.complete(1)
    client.event = b""  # a Done without an event (nothing was copied on a stream): no wait
    client.complete(2)
    _run_step(side, _meta(2))
    # Waited on once, before the request was reported to vLLM (which then schedules its forward).
    assert gpu.waited == [(b"E" * 64, set())]
    assert side._last_recving == {"g", "h"}


def test_daemon_down_fails_loads_and_releases_delayed_frees() -> None:
    from hkvd.shim.jobs import LoadJob, StoreJob

    side, _client = _side()
    _run_step(side, _meta(1, stores=[StoreJob("r1", [Item(0, 0, b"k" * 16, [5])])]))
    side._lost(ConnectionError("daemon gone"))
    side.link._next_try = float("inf")  # stays down for this test
    sending, failed = _run_step(side, _meta(2, loads=[LoadJob("a", 1, [Item(0, 0, b"k" * 16, [3])], [3])],
                                            delayed_free=["r1"]))
    assert failed == {"a"}
    assert sending == {"r1"}


@pytest.mark.parametrize("late_ok", [True, False])
def test_a_load_past_its_timeout_keeps_its_blocks_until_the_daemon_ends_the_copy(late_ok: bool) -> None:
    """vLLM reuses a request's blocks once its load is reported; the daemon may still be writing
    into them after the shim's timeout, so the report waits for the daemon's reply."""
    import time

    from hkvd.shim.jobs import LoadJob

    side, client = _side()
    _, failed = _run_step(side, _meta(1, loads=[LoadJob("slow", 7, [Item(0, 0, b"k" * 16, [3])], [3])]))
    assert failed == set() and client.aborted == []
    for p in side.loads._flying.values():
        p.deadline = time.monotonic() - 0.1  # forged: load_timeout_s is over
    for step in (2, 3):  # aborted once; still copying: nothing reported, the blocks stay held
        _, failed = _run_step(side, _meta(step))
        assert failed == set() and side._last_recving == set() and client.aborted == [1]
    client.complete(1, ok=late_ok)  # the daemon's reply: the copy is over
    _, failed = _run_step(side, _meta(4))
    assert side._last_recving == {"slow"}
    assert failed == (set() if late_ok else {"slow"})


def _settling_side(fraction: float, max_s: float) -> tuple[Any, FenceDaemon]:
    from hkvd.shim.shim_config import ShimConfig
    from hkvd.shim.worker import WorkerSide

    side = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent", load_settle_fraction=fraction,
                                             load_settle_max_s=max_s))
    client = FenceDaemon()
    side.link.client = client
    side._regions = [object()]
    return side, client


class ReplyAfter(FenceDaemon):
    """Completes retrieve ``rid`` once a poll has waited ``after_s`` in all (the daemon's copy time)."""

    def __init__(self, rid: int, after_s: float) -> None:
        super().__init__()
        self.rid, self.left = rid, after_s
        self.polled_s = 0.0

    def poll(self, timeout_s: float = 0.0) -> list[Any]:
        import time

        if self.rid not in self.done and any(s[0] == self.rid for s in self.sent):
            slept = min(timeout_s, self.left)
            time.sleep(slept)
            self.polled_s += slept
            self.left -= slept
            if self.left <= 0:
                self.complete(self.rid)
        return super().poll(0.0)


@pytest.mark.parametrize("settle", [True, False])
def test_a_load_about_to_end_is_waited_for_at_the_steps_end_within_its_budget(settle: bool) -> None:
    """The settle wait reports a nearly done load in this step; without it, a step later."""
    import time

    from hkvd.shim.jobs import LoadJob

    side, _ = _settling_side(0.5 if settle else 0.0, 0.05)
    client = ReplyAfter(1, 0.004)
    side.link.client = client
    meta = _meta(1, loads=[LoadJob("a", 7, [Item(0, 0, b"k" * 16, [3])], [3])])
    side.handle_preemptions(meta)
    side.bind(meta)
    side.start_load_kv()
    time.sleep(0.02)  # the forward: the budget is half of it, 10 ms, and the copy needs 4 more
    t = time.monotonic()
    _, recving, _ = side.get_transfer_results(set())
    waited = time.monotonic() - t
    if settle:
        assert recving == {"a"} and side.stats["load_settles_won"] == 1
        assert waited < 0.015  # never past the budget
    else:
        assert recving == set() and side.stats["load_settles"] == 0 and client.polled_s == 0.0


def test_a_load_not_due_within_the_budget_is_not_waited_for() -> None:
    """A long load (its blocks at the engine's measured pace) does not hold the step."""
    import time

    from hkvd.shim.jobs import LoadJob

    side, _ = _settling_side(0.5, 0.05)
    client = ReplyAfter(1, 0.002)
    side.link.client = client
    short = LoadJob("a", 7, [Item(0, 0, b"k" * 16, [3])], [3])
    side.bind(_meta(1, loads=[short]))
    side.start_load_kv()
    time.sleep(0.004)
    side.get_transfer_results(set())
    side.bind(_meta(2))
    side.get_transfer_results(set())  # the pace now known: about 2-6 ms a block
    assert side.loads.stats["loads_ok"] == 1
    client.rid, client.left = 2, 10.0  # the next load never ends within the test
    long = LoadJob("b", 8, [Item(0, 0, b"j" * 16, list(range(100, 1100)))], list(range(100, 1100)))
    side.bind(_meta(3, loads=[long]))
    side.start_load_kv()
    time.sleep(0.02)
    settles = side.stats["load_settles"]
    t = time.monotonic()
    side.get_transfer_results(set())
    assert time.monotonic() - t < 0.005 and side.stats["load_settles"] == settles


def test_a_load_read_a_step_late_does_not_stop_the_wait_for_the_next_short_one() -> None:
    """The pace comes from the daemon's own time for a load, not from when the worker read its reply."""
    import time

    from hkvd.shim.jobs import LoadJob

    side, _ = _settling_side(0.5, 0.05)
    client = ReplyAfter(1, 0.0)
    client.retrieve_s = 0.001  # the daemon copied it in 1 ms
    side.link.client = client
    first = LoadJob("a", 7, [Item(0, 0, b"k" * 16, [3])], [3])
    side.bind(_meta(1, loads=[first]))
    side.start_load_kv()
    time.sleep(0.06)  # its reply waits, unread, for a whole step
    side.bind(_meta(2))
    side.get_transfer_results(set())
    assert side.loads.stats["loads_ok"] == 1 and side.loads.stats["load_seconds"] >= 0.06
    client.rid, client.left = 2, 0.004
    second = LoadJob("b", 8, [Item(0, 0, b"j" * 16, [4])], [4])
    side.bind(_meta(3, loads=[second]))
    side.start_load_kv()
    time.sleep(0.02)  # the forward: a budget of 10 ms, and the copy needs 4
    _, recving, _ = side.get_transfer_results(set())
    assert recving == {"b"} and side.stats["load_settles_won"] == 1
