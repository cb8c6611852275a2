# SPDX-License-Identifier: Apache-2.0
"""Worker-side ordering rules with a scripted daemon client (no daemon, no model).

The real daemon copies too fast to catch a copy in flight at a block reuse, so these tests
script completions: fences wait for copies out of reused blocks, a fence timeout aborts and
never confirms, confirms carry only step events seen done, delayed frees wait for copies, and
every load is reported finished once, a failed one as a failed request (never as block errors).
"""

from __future__ import annotations

from typing import Any

import pytest

from hkvd.transport.wire.kv import Item

pytestmark = pytest.mark.vllm


class ScriptedClient:
    def __init__(self) -> None:
        self.next_id = 0
        self.done: dict[int, Any] = {}  # req_id -> Completion ready for poll/wait
        self.finish_on_wait: set[int] = set()  # complete these when someone waits for them
        self.fail: set[int] = set()
        self.sent: list[tuple] = []
        self.aborted: list[int] = []
        self.connected = True

    def _id(self, what: tuple) -> int:
        self.next_id += 1
        self.sent.append((self.next_id, *what))
        return self.next_id

    def submit_store(self, items: Any, wait_event: bytes = b"") -> int:
        assert wait_event == b""  # host KV caches: no GPU events
        return self._id(("store", items))

    def submit_retrieve(self, items: Any, lease_id: int) -> int:
        return self._id(("retrieve", items, lease_id))

    def submit_step_event(self, seq: int, step: int, offers: Any, confirms: Any, wait_event: bytes = b"") -> int:
        assert wait_event == b""
        return self._id(("step", seq, step, offers, list(confirms)))

    def complete(self, rid: int, ok: bool = True) -> None:
        from hkvd.shim.results import Completion, RetrieveResult, StepResult, StoreResult
        from hkvd.transport.errors import NotFound

        kind = next(s[1] for s in self.sent if s[0] == rid)
        result = {"store": StoreResult(1, 1, 0, 0, 0), "retrieve": RetrieveResult(1, 1),
                  "step": StepResult(1, "in_order")}[kind]
        self.done[rid] = Completion(rid, ok, result if ok else None, None if ok else NotFound("gone"))

    def poll(self, timeout_s: float = 0.0) -> list[Any]:
        out = list(self.done.values())
        self.done.clear()
        return out

    def wait(self, req_ids: Any, timeout_s: float) -> dict[int, Any]:
        from hkvd.transport.errors import KVTimeout

        for rid in req_ids:
            if rid in self.finish_on_wait:
                self.complete(rid, ok=rid not in self.fail)
        if any(rid not in self.done for rid in req_ids):
            raise KVTimeout("scripted timeout")
        return {rid: self.done.pop(rid) for rid in req_ids}

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)

    def close(self) -> None:
        self.connected = False


def _side() -> tuple[Any, ScriptedClient]:
    from hkvd.shim.config import ShimConfig
    from hkvd.shim.worker import WorkerSide

    side = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent", fence_timeout_s=0.01))
    client = ScriptedClient()
    side.link.client = client
    side._regions = [object()]  # registered
    return side, client


def _meta(step: int, **kw: Any) -> Any:
    from hkvd.shim.metadata import HkvdConnectorMetadata

    return HkvdConnectorMetadata(step=step, **kw)


def _run_step(side: Any, meta: Any, late: set[str] = frozenset()) -> tuple[set[str] | None, set[str]]:
    """One step as vLLM's model runner drives it; returns (finished sending, failed loads).

    ``late``: loads that outlive load_timeout_s in this step and are reported when the daemon ends them.
    """
    side.handle_preemptions(meta)
    side.bind(meta)
    side.start_load_kv()
    side.wait_for_save()
    sending, recving, failed = side.get_transfer_results(set(meta.delayed_free))
    want = {job.req_id for job in meta.loads} - late
    assert want <= recving and not (recving & late), "every load is reported finished, in its step"
    side._last_recving = recving
    assert side.get_block_ids_with_load_errors() == set()  # vLLM stops hybrid engines on these
    return sending or None, failed


def test_fence_waits_for_copy_out_of_reused_block_then_confirms() -> None:
    from hkvd.shim.metadata import StoreJob

    side, client = _side()
    offer = ("r1", Item(1, 0, b"k" * 16, [9]))
    _run_step(side, _meta(1, stores=[StoreJob("r1", [Item(0, 0, b"k" * 16, [5, 6])])], offers=[offer]))
    store_id, step_id = 1, 2
    client.finish_on_wait = {store_id, step_id}
    _run_step(side, _meta(2, fence_blocks={6, 9}))  # both blocks reused now: wait for both copies
    assert client.aborted == []
    assert side.stats["stores"] == 1
    (last,) = [s for s in client.sent if s[1] == "step" and s[3] == 2]
    assert last[5] == [step_id]  # seen done before the reuse: confirmed


def test_fence_timeout_aborts_and_never_confirms() -> None:
    side, client = _side()
    _run_step(side, _meta(1, offers=[("r1", Item(1, 0, b"k" * 16, [9]))]))
    _run_step(side, _meta(2, fence_blocks={9}))  # the copy never finishes
    step_id = 1  # the step-1 event carrying the offer
    assert client.aborted == [step_id]
    client.complete(step_id)  # a late Done must not resurrect it
    _run_step(side, _meta(3))
    confirms = [s[5] for s in client.sent if s[1] == "step"]
    assert all(step_id not in c for c in confirms)
    assert side.stats["fence_timeouts"] == 1


def test_delayed_free_waits_for_copies() -> None:
    from hkvd.shim.metadata import StoreJob

    side, client = _side()
    _run_step(side, _meta(1, stores=[StoreJob("r1", [Item(0, 0, b"k" * 16, [5])])]))
    sending, _ = _run_step(side, _meta(2, delayed_free=["r1"]))
    assert sending is None  # store 1 still copying
    client.complete(1)
    sending, _ = _run_step(side, _meta(3))
    assert sending == {"r1"}


def test_failed_or_unplannable_load_fails_its_request() -> None:
    from hkvd.shim.metadata import LoadJob

    side, client = _side()
    ok = LoadJob("a", 7, [Item(0, 0, b"k" * 16, [3])], [3])
    bad = LoadJob("b", 8, [[0, 0, b"j" * 16, [4]]], [4])
    empty = LoadJob("c", 9, [], [11, 12])  # the scheduler could not plan it (null block)
    client.finish_on_wait = {1, 2}
    client.fail = {2}
    _, failed = _run_step(side, _meta(1, loads=[ok, bad, empty]))
    assert failed == {"b", "c"}
    assert side.stats["loads_ok"] == 1
    _, failed = _run_step(side, _meta(2))
    assert failed == set()  # reported once


def test_daemon_down_fails_loads_and_releases_delayed_frees() -> None:
    from hkvd.shim.metadata import LoadJob, StoreJob

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
    from hkvd.shim.metadata import LoadJob

    side, client = _side()
    _, failed = _run_step(side, _meta(1, loads=[LoadJob("slow", 7, [Item(0, 0, b"k" * 16, [3])], [3])]),
                          late={"slow"})
    assert failed == set() and client.aborted == [1]
    _, failed = _run_step(side, _meta(2))  # still copying: nothing reported, the blocks stay held
    assert failed == set() and side._last_recving == set()
    client.complete(1, ok=late_ok)  # the daemon's reply: the copy is over
    _, failed = _run_step(side, _meta(3))
    assert side._last_recving == {"slow"}
    assert failed == (set() if late_ok else {"slow"})
