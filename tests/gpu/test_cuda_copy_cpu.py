"""CPU tests of the CUDA copy engine's ordering, completion and abandonment rules.

CuPy's runtime is replaced at its boundary by ``_FakeGpu``: streams are queues of operations that
run only when the test steps the GPU (a paused stream does not run), a wait on an event blocks its
stream until that event completes, copies move real bytes with memmove (the "device" memory and the
pool are host arrays), and host functions run when their stream reaches them, as the driver would
call them (a gate stream's host function hands the copy to the completion thread, which enqueues it
on the copy stream).
What needs a real GPU is in ``test_cuda_gpu.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from hkvd.cuda import copy as cuda_copy
from hkvd.cuda import dma
from hkvd.cuda import ipc as cuda_ipc
from hkvd.cuda.completion import CompletionWatcher, CopyTicket
from hkvd.cuda.copy import CudaCopyEngine, choose_method
from hkvd.cuda.ipc import IpcMemRegistry
from hkvd.transport.copy_engine import Direction, Region, Segment
from hkvd.transport.errors import CopyFailedError, KVTimeout, PagesInUse

U0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
POOL = 1 << 20
REGION = 1 << 20


class _Stream:
    def __init__(self, gpu: _FakeGpu) -> None:
        self.gpu = gpu
        self.ptr = gpu.new_id()
        gpu.streams[self.ptr] = self
        self.ops: list[tuple[Any, ...]] = []

    def launch_host_func(self, fn: Callable[[Any], None], arg: Any) -> None:
        self.gpu.note(("host", self.ptr))
        self.ops.append(("host", fn, arg))

    def synchronize(self) -> None:
        self.gpu.run()


class _FakeRuntime:
    memcpyDefault = 4
    memcpyHostToDevice = 1
    cudaDevAttrCanUseHostPointerForRegisteredMem = 91
    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, gpu: _FakeGpu) -> None:
        self.gpu = gpu

    # events
    def eventCreateWithFlags(self, flags: int) -> int:
        ev = self.gpu.new_id()
        self.gpu.done[ev] = True  # a never-recorded event is complete
        return ev

    def ipcGetEventHandle(self, ev: int) -> bytes:
        return ev.to_bytes(8, "little") * 8

    def ipcOpenEventHandle(self, handle: bytes) -> int:
        return self.gpu.engine_events[handle]

    def eventRecord(self, ev: int, stream: int) -> None:
        self.gpu.done[ev] = False
        self.gpu.streams[stream].ops.append(("record", ev))
        self.gpu.note(("record", stream, ev))

    def streamWaitEvent(self, stream: int, ev: int, flags: int) -> None:
        self.gpu.streams[stream].ops.append(("wait", ev))
        self.gpu.note(("wait", stream, ev))

    def eventQuery(self, ev: int) -> int:
        if self.gpu.fault:
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        return 0 if self.gpu.done[ev] else 600

    def eventDestroy(self, ev: int) -> None:
        self.gpu.destroyed.append(ev)

    # copies
    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        self.gpu.streams[stream].ops.append(("memcpy", dst, src, n))
        self.gpu.note(("memcpy", stream, dst, src, n))

    # IPC memory: handles name host arrays the test registered
    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        self.gpu.opened.add(handle)
        return self.gpu.memory[handle]

    def ipcCloseMemHandle(self, ptr: int) -> None:
        self.gpu.opened.discard(next(h for h, p in self.gpu.memory.items() if p == ptr))

    def deviceGetAttribute(self, attr: int, device: int) -> int:
        return 1

    # pinned host memory: registrations recorded as (addr, nbytes)
    def hostRegister(self, addr: int, n: int, flags: int) -> None:
        self.gpu.pinned.append((addr, n))

    def hostUnregister(self, addr: int) -> None:
        self.gpu.pinned = [(a, n) for a, n in self.gpu.pinned if a != addr]


class _FakeGpu:
    """Streams as op queues, run when the test says (``run``). See the module docstring."""

    def __init__(self) -> None:
        self._next = 0x1000
        self.streams: dict[int, _Stream] = {}
        self.done: dict[int, bool] = {}
        self.engine_events: dict[bytes, int] = {}
        self.memory: dict[bytes, int] = {}
        self.opened: set[bytes] = set()
        self.destroyed: list[int] = []
        self.pinned: list[tuple[int, int]] = []
        self.log: list[tuple[Any, ...]] = []
        self.changed = threading.Condition()
        self.paused: set[int] = set()  # streams that do not run (a slow GPU)
        self.fault = False
        self.rt = _FakeRuntime(self)
        gpu = self

        class _Cuda:
            runtime = gpu.rt

            @staticmethod
            @contextlib.contextmanager
            def Device(i: int) -> Iterator[None]:
                yield

            @staticmethod
            def Stream(non_blocking: bool = False) -> _Stream:
                return _Stream(gpu)

        class _Cupy:
            cuda = _Cuda

        self.cupy = _Cupy

    def new_id(self) -> int:
        self._next += 0x10
        return self._next

    def engine_event(self) -> bytes:
        """An engine's step-end event, recorded and not complete until ``complete``."""
        ev = self.new_id()
        self.done[ev] = False
        handle = ev.to_bytes(8, "little") * 8
        self.engine_events[handle] = ev
        return handle

    def note(self, entry: tuple[Any, ...]) -> None:
        with self.changed:
            self.log.append(entry)
            self.changed.notify_all()

    def until(self, pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait (on the log's condition, no sleep loop) until ``pred()`` holds; its last value."""
        with self.changed:
            return self.changed.wait_for(pred, timeout_s)

    def complete(self, handle: bytes) -> None:
        self.done[self.engine_events[handle]] = True
        self.note(("complete", self.engine_events[handle]))

    def run(self) -> None:
        """Run every stream as far as it can go (a wait on an incomplete event stops that stream)."""
        progress = True
        while progress:
            progress = False
            for s in list(self.streams.values()):
                while s.ops and s.ptr not in self.paused:
                    op = s.ops[0]
                    if op[0] == "wait" and not self.done[op[1]]:
                        break
                    s.ops.pop(0)
                    progress = True
                    if op[0] == "memcpy":
                        ctypes.memmove(op[1], op[2], op[3])
                    elif op[0] == "record":
                        self.done[op[1]] = True
                    elif op[0] == "host":
                        op[1](op[2])

    def ops_on(self, stream: int) -> list[str]:
        return [e[0] for e in self.log if e[1] == stream]


@dataclass
class _Pool:
    array: np.ndarray

    @property
    def base_addr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def size(self) -> int:
        return int(self.array.size)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> _FakeGpu:
    g = _FakeGpu()
    for mod in ("hkvd.cuda.ipc", "hkvd.cuda.ipc_events", "hkvd.cuda.copy", "hkvd.cuda.hostreg"):
        monkeypatch.setattr(f"{mod}.runtime", lambda: g.rt)
        monkeypatch.setattr(f"{mod}.cupy", lambda: g.cupy)
    monkeypatch.setattr(cuda_ipc, "REGISTRY", IpcMemRegistry())
    monkeypatch.setattr(cuda_copy, "REGISTRY", cuda_ipc.REGISTRY)
    monkeypatch.setattr(cuda_copy, "visible_device_uuids", lambda: [U0])
    monkeypatch.setattr(dma, "batch_api", lambda: None)
    return g


@dataclass
class _Setup:
    eng: CudaCopyEngine
    att: Any
    pool: np.ndarray
    device_mem: np.ndarray


@pytest.fixture
def setup(gpu: _FakeGpu) -> Iterator[_Setup]:
    yield from _make_setup(gpu)


def _make_setup(gpu: _FakeGpu, timeout_s: float = 30.0, method: str = "memcpy") -> Iterator[_Setup]:
    rng = np.random.default_rng(1)
    pool = np.zeros(POOL, dtype=np.uint8)
    device_mem = rng.integers(0, 256, REGION, dtype=np.uint8)
    handle = b"\x05" * 64
    gpu.memory[handle] = int(device_mem.ctypes.data)
    eng = CudaCopyEngine(_Pool(pool), method=method, copy_timeout_s=timeout_s, register_pool=False)
    att = eng.attach(4321, [Region(1, "cuda", REGION, handle=handle, device_uuid=U0)])
    try:
        yield _Setup(eng, att, pool, device_mem)
    finally:
        eng.close()


def _lane_stream(s: _Setup, d: Direction) -> int:
    return int(s.att.state["cuda"].lanes[d].stream.ptr)


def _gate_stream(s: _Setup, d: Direction) -> int:
    return int(s.att.state["cuda"].lanes[d].gate.ptr)


def _settle_gates(gpu: _FakeGpu, s: _Setup) -> None:
    """Run the GPU, then let the completion thread enqueue what opened gates handed it, until quiet."""
    for _ in range(5):
        n = len(gpu.log)
        gpu.run()
        assert s.eng._watcher.flush(5.0)
        if len(gpu.log) == n:
            return


# ---------------------------------------------------------------------------------------------
# Ordering
# ---------------------------------------------------------------------------------------------


def test_store_is_gated_on_the_step_event_and_enqueued_only_after_it(gpu: _FakeGpu, setup: _Setup) -> None:
    step_end = gpu.engine_event()
    ev = gpu.engine_events[step_end]
    ticket = setup.eng.submit(setup.att, [Segment(1, 0, 0, 8192)], Direction.TO_POOL, wait_event=step_end)
    copy_stream, gate = _lane_stream(setup, Direction.TO_POOL), _gate_stream(setup, Direction.TO_POOL)
    assert gpu.ops_on(gate) == ["wait", "host"]  # the GPU waits on the gate; no host poll
    assert ("wait", gate, ev) in gpu.log
    assert gpu.ops_on(copy_stream) == []  # the copy is not enqueued behind the engine's event
    _settle_gates(gpu, setup)  # the engine's step has not ended: nothing is enqueued, nothing moves
    assert gpu.ops_on(copy_stream) == [] and not ticket.done() and not setup.pool[:8192].any()
    assert ticket.result.done_event == b""  # no done event is handed out before the copy is enqueued
    gpu.complete(step_end)
    _settle_gates(gpu, setup)
    assert ticket.wait(5.0).nbytes == 8192
    # Enqueued by the completion thread after the gate opened, behind a wait on the (complete) event.
    assert gpu.ops_on(copy_stream) == ["wait", "memcpy", "record", "host"]
    done_at = gpu.log.index(("complete", ev))
    assert all(i > done_at for i, e in enumerate(gpu.log) if e[0] == "memcpy"), "a copy op precedes the event"
    assert ticket.result.done_event == gpu.rt.ipcGetEventHandle(next(e[2] for e in gpu.log if e[0] == "record"))
    assert np.array_equal(setup.pool[:8192], setup.device_mem[:8192])


def test_retrieve_reply_carries_an_event_recorded_after_the_copies(gpu: _FakeGpu, setup: _Setup) -> None:
    setup.pool[:4096] = 9
    ticket = setup.eng.submit(setup.att, [Segment(1, 4096, 0, 4096)], Direction.FROM_POOL)
    stream = _lane_stream(setup, Direction.FROM_POOL)
    entries = [e for e in gpu.log if e[1] == stream]
    assert [e[0] for e in entries] == ["memcpy", "record", "host"]
    recorded = entries[1][2]
    assert ticket.result.done_event == gpu.rt.ipcGetEventHandle(recorded)
    assert not gpu.done[recorded]  # the engine waits on it: complete only after the copy ran
    gpu.run()
    assert gpu.done[recorded] and ticket.wait(5.0).done_event == ticket.result.done_event
    assert (setup.device_mem[4096:8192] == 9).all()


def test_stores_and_retrieves_use_different_streams(gpu: _FakeGpu, setup: _Setup) -> None:
    setup.eng.submit(setup.att, [Segment(1, 0, 0, 4096)], Direction.TO_POOL)
    setup.eng.submit(setup.att, [Segment(1, 0, 8192, 4096)], Direction.FROM_POOL)
    assert _lane_stream(setup, Direction.TO_POOL) != _lane_stream(setup, Direction.FROM_POOL)
    gpu.run()


def test_contiguous_rows_are_coalesced_into_one_copy(gpu: _FakeGpu, setup: _Setup) -> None:
    segs = [Segment(1, 0, 0, 4096), Segment(1, 4096, 4096, 4096), Segment(1, 16384, 65536, 4096)]
    setup.eng.submit(setup.att, segs, Direction.TO_POOL)
    copies = [e for e in gpu.log if e[0] == "memcpy"]
    assert [c[4] for c in copies] == [8192, 4096]
    gpu.run()


def test_requests_in_flight_overlap(gpu: _FakeGpu, setup: _Setup) -> None:
    """Two copies (one thread, then another) are both enqueued before either completes."""
    first = setup.eng.submit(setup.att, [Segment(1, 0, 0, 4096)], Direction.TO_POOL)
    box: list[CopyTicket] = []
    t = threading.Thread(target=lambda: box.append(
        setup.eng.submit(setup.att, [Segment(1, 4096, 4096, 4096)], Direction.TO_POOL)))
    t.start()
    t.join(10)
    assert box and not first.done() and not box[0].done()
    assert len([e for e in gpu.log if e[0] == "memcpy"]) == 2
    gpu.run()
    assert first.wait(5.0).nbytes == box[0].wait(5.0).nbytes == 4096


def test_copy_ordered_returns_only_after_the_gpu_finished(gpu: _FakeGpu, setup: _Setup) -> None:
    """The blocking path (what the daemon calls today): a store is not reported before its bytes land."""
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(
        setup.eng.copy(setup.att, [Segment(1, 0, 0, 4096)], Direction.TO_POOL)))
    t.start()
    deadline = time.monotonic() + 10
    while not any(e[0] == "host" for e in gpu.log) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not done
    gpu.run()
    t.join(10)
    assert done == [4096] and np.array_equal(setup.pool[:4096], setup.device_mem[:4096])


# ---------------------------------------------------------------------------------------------
# Budgets, failures, abandonment
# ---------------------------------------------------------------------------------------------


def test_wedged_step_event_times_out_with_nothing_enqueued(gpu: _FakeGpu) -> None:
    for s in _make_setup(gpu, timeout_s=0.3):
        step_end = gpu.engine_event()  # never completes (until the end)
        with pytest.raises(KVTimeout, match="step-end event did not complete within the copy budget") as err:
            s.eng.copy_ordered(s.att, [Segment(1, 0, 0, 8192)], Direction.TO_POOL, wait_event=step_end)
        assert PagesInUse.of(err.value) is None  # nothing can run: the pages are free at once
        copy_stream = _lane_stream(s, Direction.TO_POOL)
        assert gpu.ops_on(copy_stream) == [] and not any(e[0] == "memcpy" for e in gpu.log)
        assert s.att.state["cuda"].inflight == 0  # no user of the mappings is left
        wedged_gate = next(e[1] for e in gpu.log if e[0] == "wait")
        assert _gate_stream(s, Direction.TO_POOL) != wedged_gate, "the wedged gate is still in use"
        assert wedged_gate in gpu.streams and wedged_gate in {id_of(x) for x in s.eng._retired}
        # The next store waits on a fresh gate and completes; the wedged gate is never used again.
        step2 = gpu.engine_event()
        n = len(gpu.log)
        t = s.eng.submit(s.att, [Segment(1, 4096, 4096, 4096)], Direction.TO_POOL, wait_event=step2)
        gpu.complete(step2)
        _settle_gates(gpu, s)
        assert t.wait(5.0).nbytes == 4096
        assert all(e[1] != wedged_gate for e in gpu.log[n:])
        # The wedged event completes at last: the timed-out copy never runs.
        gpu.complete(step_end)
        _settle_gates(gpu, s)
        assert not s.pool[:4096].any() and not s.pool[8192:].any()
        assert len([e for e in gpu.log if e[0] == "memcpy"]) == 1


def id_of(x: Any) -> int:
    return int(x.ptr) if hasattr(x, "ptr") else -1


def test_abandon_before_the_step_event_releases_at_once_and_nothing_runs_later(gpu: _FakeGpu, setup: _Setup) -> None:
    step_end = gpu.engine_event()
    ticket = setup.eng.submit(setup.att, [Segment(1, 0, 0, 8192)], Direction.TO_POOL, wait_event=step_end)
    copy_stream = _lane_stream(setup, Direction.TO_POOL)
    setup.eng.abandon(setup.att)
    with pytest.raises(CopyFailedError, match="gone") as err:
        ticket.wait(2.0)
    assert PagesInUse.of(err.value) is None and ticket.gpu_finished.is_set()
    setup.eng.detach(setup.att)
    assert gpu.opened == set(), "the mappings of a copy that never left its gate were kept"
    gpu.complete(step_end)  # the event completes after all (or the driver lets the wait go)
    _settle_gates(gpu, setup)
    assert gpu.ops_on(copy_stream) == [] and not any(e[0] == "memcpy" for e in gpu.log)
    assert not setup.pool.any()


def test_timed_out_enqueued_copy_holds_pages_and_mappings_until_the_gpu_ran_it(gpu: _FakeGpu) -> None:
    for s in _make_setup(gpu, timeout_s=0.3):
        step_end = gpu.engine_event()
        ticket = s.eng.submit(s.att, [Segment(1, 0, 0, 8192)], Direction.TO_POOL, wait_event=step_end)
        copy_stream = _lane_stream(s, Direction.TO_POOL)
        gpu.paused.add(copy_stream)  # the GPU is slow: the copy is enqueued but does not run in time
        gpu.complete(step_end)
        _settle_gates(gpu, s)
        assert gpu.ops_on(copy_stream) == ["wait", "memcpy", "record", "host"]
        with pytest.raises(KVTimeout, match="not complete within the copy budget") as err:
            ticket.wait()
        held = PagesInUse.of(err.value)
        assert held is not None and not held.is_free()
        freed = threading.Event()
        held.call_when_free(freed.set)
        assert s.att.state["cuda"].lanes[Direction.TO_POOL].broken  # its stream is never reused
        s.eng.detach(s.att)
        assert gpu.opened == {b"\x05" * 64}, "mapping released under a copy the GPU may still run"
        gpu.paused.clear()
        _settle_gates(gpu, s)  # the late copy writes the pool: the pages had to stay held
        assert np.array_equal(s.pool[:8192], s.device_mem[:8192])
        assert freed.wait(5.0) and held.is_free()
        assert gpu.until(lambda: gpu.opened == set())


def test_abandon_of_an_enqueued_copy_holds_its_pages_until_the_gpu_ran_it(gpu: _FakeGpu, setup: _Setup) -> None:
    setup.pool[:4096] = 3
    ticket = setup.eng.submit(setup.att, [Segment(1, 0, 0, 4096)], Direction.FROM_POOL)
    setup.eng.abandon(setup.att)
    with pytest.raises(CopyFailedError, match="gone") as err:
        ticket.wait(2.0)
    held = PagesInUse.of(err.value)
    assert held is not None and not held.is_free()
    setup.eng.detach(setup.att)
    assert gpu.opened == {b"\x05" * 64}
    _settle_gates(gpu, setup)
    assert held.until.wait(5.0) and gpu.until(lambda: gpu.opened == set())
    assert (setup.device_mem[:4096] == 3).all()


def test_cuda_error_at_the_deadline_is_a_copy_failure(gpu: _FakeGpu) -> None:
    for s in _make_setup(gpu, timeout_s=0.2):
        gpu.fault = True  # host functions never run after an error; the query at the deadline says why
        with pytest.raises(CopyFailedError, match="illegal memory access"):
            s.eng.copy(s.att, [Segment(1, 0, 0, 4096)], Direction.TO_POOL)
        gpu.fault = False


def test_abandon_ends_a_waiting_copy_promptly(gpu: _FakeGpu, setup: _Setup) -> None:
    assert setup.eng.copy_timeout_s == 30.0
    step_end = gpu.engine_event()  # the engine died before its step ended
    outcome: list[BaseException | int] = []
    ended = threading.Event()

    def store() -> None:
        try:
            outcome.append(setup.eng.copy_ordered(setup.att, [Segment(1, 0, 0, 4096)], Direction.TO_POOL,
                                                  wait_event=step_end).nbytes)
        except BaseException as e:
            outcome.append(e)
        ended.set()

    t = threading.Thread(target=store)
    t.start()
    deadline = time.monotonic() + 10
    while not any(e[0] == "host" for e in gpu.log) and time.monotonic() < deadline:
        time.sleep(0.01)
    wedged = _lane_stream(setup, Direction.TO_POOL)
    setup.eng.abandon(setup.att)
    assert ended.wait(2.0), "abandon did not end the copy waiting on the dead engine's event"
    assert isinstance(outcome[0], CopyFailedError) and "gone" in str(outcome[0])
    with pytest.raises(CopyFailedError, match="gone"):
        setup.eng.submit(setup.att, [Segment(1, 0, 0, 16)], Direction.TO_POOL)
    setup.eng.detach(setup.att)
    assert gpu.opened == set()  # no copy uses the mapping any more
    # The abandoned stream is never used again, by this engine's other attachments either.
    handle2 = b"\x06" * 64
    other = np.zeros(REGION, dtype=np.uint8)
    gpu.memory[handle2] = int(other.ctypes.data)
    att2 = setup.eng.attach(99, [Region(1, "cuda", REGION, handle=handle2, device_uuid=U0)])
    n = len(gpu.log)
    setup.eng.submit(att2, [Segment(1, 0, 0, 16)], Direction.TO_POOL)
    assert all(e[1] != wedged for e in gpu.log[n:])
    gpu.run()
    t.join(5)


def test_abandon_ends_a_copy_waiting_on_its_own_done_event(gpu: _FakeGpu, setup: _Setup) -> None:
    ticket = setup.eng.submit(setup.att, [Segment(1, 0, 0, 4096)], Direction.FROM_POOL)
    setup.eng.abandon(setup.att)
    with pytest.raises(CopyFailedError, match="gone"):
        ticket.wait(2.0)


def test_detach_during_a_copy_is_deferred_until_it_settles(gpu: _FakeGpu, setup: _Setup) -> None:
    ticket = setup.eng.submit(setup.att, [Segment(1, 0, 0, 4096)], Direction.TO_POOL)
    setup.eng.detach(setup.att)
    assert gpu.opened == {b"\x05" * 64}, "mapping released under a running copy"
    with pytest.raises(CopyFailedError, match="detached"):
        setup.eng.submit(setup.att, [Segment(1, 0, 0, 16)], Direction.TO_POOL)
    gpu.run()
    ticket.wait(5.0)
    deadline = time.monotonic() + 5
    while gpu.opened and time.monotonic() < deadline:  # released by the completion thread's settlement
        time.sleep(0.01)
    assert gpu.opened == set()


def test_out_of_range_is_refused_before_anything_is_enqueued(gpu: _FakeGpu, setup: _Setup) -> None:
    with pytest.raises(CopyFailedError, match="leaves region"):
        setup.eng.submit(setup.att, [Segment(1, REGION - 8, 0, 16)], Direction.FROM_POOL)
    assert gpu.log == [] and setup.att.state["cuda"].inflight == 0


def test_watcher_settles_at_each_deadline_independently() -> None:
    w = CompletionWatcher(lambda ev: None)
    try:
        now = time.monotonic()
        slow = CopyTicket(1, b"", deadline=now + 30, what="slow")
        fast = CopyTicket(1, b"", deadline=now + 0.1, what="fast")
        w.watch(slow)
        w.watch(fast)
        with pytest.raises(KVTimeout, match="fast"):
            fast.wait(10)
        assert not slow.done()
        w.gpu_reached(slow)
        assert slow.wait(10).nbytes == 1 and slow.gpu_finished.wait(10)
    finally:
        w.close()


# ---------------------------------------------------------------------------------------------
# DMA: the batch call's arguments, both signatures, the per-row fallback
# ---------------------------------------------------------------------------------------------


def _desc(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def test_batch_args() -> None:
    d = _desc([(100, 200, 16), (300, 400, 32)])
    attrs = object()
    assert dma.batch_args(d, 77, attrs) == ([200, 400], [100, 300], [16, 32], 2, [attrs], [0], 1, 77)
    with pytest.raises(ValueError, match="default stream"):
        dma.batch_args(d, 0, attrs)


@pytest.mark.parametrize("returns", [(0,), (0, 0)], ids=["cuda13", "cuda12"])
def test_run_batch_accepts_both_signatures(returns: tuple[int, ...]) -> None:
    calls: list[tuple[Any, ...]] = []

    def fn(*a: Any) -> tuple[int, ...]:
        calls.append(a)
        return returns

    api = dma.BatchApi(fn=fn, attrs="A", version=13000)
    dma.run_batch(api, _desc([(1, 2, 3), (4, 5, 6)]), 9)
    assert calls == [([2, 5], [1, 4], [3, 6], 2, ["A"], [0], 1, 9)]


def test_run_batch_error_names_the_failing_row() -> None:
    api = dma.BatchApi(fn=lambda *a: (1, 1), attrs="A", version=12080)
    with pytest.raises(CopyFailedError, match=r"at row 1 \(cudaError 1\)"):
        dma.run_batch(api, _desc([(1, 2, 3), (4, 5, 6)]), 9)
    api13 = dma.BatchApi(fn=lambda *a: (1,), attrs="A", version=13000)
    with pytest.raises(CopyFailedError, match=r"failed \(cudaError 1\)"):
        dma.run_batch(api13, _desc([(1, 2, 3), (4, 5, 6)]), 9)


class _Enum:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _BindingsRuntime:
    cudaMemcpySrcAccessOrder = _Enum(cudaMemcpySrcAccessOrderStream="STREAM")
    cudaMemcpyFlags = _Enum(cudaMemcpyFlagPreferOverlapWithCompute="OVERLAP")

    def __init__(self, runtime_version: int, driver_version: int, has_batch: bool = True) -> None:
        self.versions = (runtime_version, driver_version)
        if has_batch:
            self.cudaMemcpyBatchAsync = lambda *a: (0,)

    def cudaRuntimeGetVersion(self) -> tuple[int, int]:
        return 0, self.versions[0]

    def cudaDriverGetVersion(self) -> tuple[int, int]:
        return 0, self.versions[1]

    class cudaMemcpyAttributes:
        srcAccessOrder: Any = None
        flags: Any = None


def test_resolve_batch_api() -> None:
    api, why = dma.resolve_batch_api(lambda: _BindingsRuntime(13000, 13000))
    assert api is not None and why == "" and api.version == 13000
    assert (api.attrs.srcAccessOrder, api.attrs.flags) == ("STREAM", "OVERLAP")
    api, why = dma.resolve_batch_api(lambda: _BindingsRuntime(12080, 12040))
    assert api is None and "12.4 is older than 12.8" in why  # the driver's version counts too

    def missing() -> Any:
        raise ImportError("No module named 'cuda.bindings'")

    api, why = dma.resolve_batch_api(missing)
    assert api is None and "pip install 'cuda-bindings" in why
    api, why = dma.resolve_batch_api(lambda: _BindingsRuntime(12090, 12090, has_batch=False))
    assert api is None and "no cudaMemcpyBatchAsync" in why


def test_engine_uses_the_batch_call_when_present(gpu: _FakeGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def batch(*a: Any) -> tuple[int]:
        calls.append(a)
        for dst, src, n in zip(a[0], a[1], a[2], strict=True):
            gpu.streams[a[7]].ops.append(("memcpy", dst, src, n))
        return (0,)

    monkeypatch.setattr(dma, "batch_api", lambda: dma.BatchApi(fn=batch, attrs="A", version=13000))
    for s in _make_setup(gpu):
        segs = [Segment(1, 0, 0, 4096), Segment(1, 8192, 8192, 4096)]
        t = s.eng.submit(s.att, segs, Direction.TO_POOL)
        assert len(calls) == 1 and calls[0][3] == 2 and calls[0][7] == _lane_stream(s, Direction.TO_POOL)
        assert not [e for e in gpu.log if e[0] == "memcpy"]  # no per-row call
        gpu.run()
        t.wait(5.0)
        assert np.array_equal(s.pool[8192:12288], s.device_mem[8192:12288])


def test_engine_falls_back_to_one_memcpy_per_row(gpu: _FakeGpu, setup: _Setup) -> None:
    setup.eng.submit(setup.att, [Segment(1, 0, 0, 4096), Segment(1, 8192, 8192, 4096)], Direction.TO_POOL)
    assert len([e for e in gpu.log if e[0] == "memcpy"]) == 2
    gpu.run()


def test_auto_takes_the_kernel_only_for_many_tiny_rows() -> None:
    many_tiny = np.tile(np.asarray([[0, 0, 2048]], dtype=np.int64), (cuda_copy.AUTO_KERNEL_MIN_ROWS, 1))
    assert choose_method(many_tiny, "auto") == "kernel"
    assert choose_method(many_tiny, "auto", kernel_ok=False) == "memcpy"
    assert choose_method(many_tiny[:-1], "auto") == "memcpy"
    pages = np.tile(np.asarray([[0, 0, 8 << 20]], dtype=np.int64), (64, 1))  # the measured workload
    assert choose_method(pages, "auto") == "memcpy"
    big_rows = many_tiny.copy()
    big_rows[:, 2] = 64 << 10
    assert choose_method(big_rows, "auto") == "memcpy"
    assert choose_method(pages, "kernel") == "kernel"
    assert cuda_copy.DEFAULT_METHOD in ("auto", "memcpy")


def test_cuda_copy_method_option(gpu: _FakeGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cuda-copy-method`` reaches the engine ``hkvd serve`` builds; a bad value names the choices."""
    import argparse

    from hkvd.daemon.cli import _serve_parser, build_config
    from hkvd.daemon.config import ConfigError
    from hkvd.daemon.engines import engine_factory

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    cfg = build_config(parser.parse_args(["serve", "--cuda-copy-method", "KERNEL"]))
    assert cfg.cuda_copy_method == "kernel"
    with pytest.raises(ConfigError, match=r"--cuda-copy-method 'dma'.*auto"):
        build_config(parser.parse_args(["serve", "--cuda-copy-method", "dma"]))
    monkeypatch.setattr(engine_factory, "check_copy_engine", lambda name: None)

    class _NoPin:  # cudaHostRegister is the boundary here
        boundaries = ()

        @staticmethod
        def for_pool(pool: Any, max_chunk_bytes: int) -> Any:
            return _NoPin()

        def close(self) -> None:
            pass

    monkeypatch.setattr(cuda_copy, "PinnedRegistration", _NoPin)
    eng = engine_factory.make_copy_engine("cuda", _Pool(np.zeros(4096, dtype=np.uint8)), copy_timeout_s=5.0,
                                          cuda_copy_method=cfg.cuda_copy_method)
    try:
        assert isinstance(eng, CudaCopyEngine) and eng.method == "kernel"
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------
# A pool pinned in several registrations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_copies_across_pinned_registrations_are_cut_at_their_boundaries(gpu: _FakeGpu,
                                                                        direction: Direction) -> None:
    chunk = 64 << 10  # the pool is pinned as 16 registrations of 64 KiB
    backing = np.zeros(POOL + 4096, dtype=np.uint8)
    skip = -int(backing.ctypes.data) % 4096
    pool = backing[skip : skip + POOL]  # page-aligned, as the daemon's pool is
    pool[:] = np.random.default_rng(2).integers(0, 256, POOL, dtype=np.uint8)
    device_mem = np.random.default_rng(3).integers(0, 256, REGION, dtype=np.uint8)
    handle = b"\x06" * 64
    gpu.memory[handle] = int(device_mem.ctypes.data)
    eng = CudaCopyEngine(_Pool(pool), method="memcpy", pin_chunk_bytes=chunk)
    base = int(pool.ctypes.data)
    assert gpu.pinned == [(base + i * chunk, chunk) for i in range(POOL // chunk)]
    try:
        att = eng.attach(4321, [Region(1, "cuda", REGION, handle=handle, device_uuid=U0)])
        # Two segments, contiguous on both sides (coalesced into one row), spanning three registrations.
        segs = [Segment(1, 1000, chunk - 300, 40_000), Segment(1, 41_000, chunk - 300 + 40_000, 60_000)]
        before_pool, before_dev = pool.copy(), device_mem.copy()
        ticket = eng.submit(att, segs, direction)
        gpu.run()
        assert ticket.wait(5.0).nbytes == 100_000
        rows = [e for e in gpu.log if e[0] == "memcpy"]
        assert len(rows) == 3  # cut at 64 KiB and 128 KiB of the pool, nothing else
        for _, _, dst, src, n in rows:
            at = (dst if direction is Direction.TO_POOL else src) - base
            assert at // chunk == (at + n - 1) // chunk, f"a row spans two registrations: pool [{at}, {at + n})"
        lo, hi = chunk - 300, chunk - 300 + 100_000
        if direction is Direction.TO_POOL:
            assert np.array_equal(pool[lo:hi], device_mem[1000:101_000])
            assert np.array_equal(pool[:lo], before_pool[:lo]) and np.array_equal(pool[hi:], before_pool[hi:])
        else:
            assert np.array_equal(device_mem[1000:101_000], pool[lo:hi])
            assert np.array_equal(device_mem[:1000], before_dev[:1000])
            assert np.array_equal(device_mem[101_000:], before_dev[101_000:])
    finally:
        eng.close()
    assert gpu.pinned == []  # every registration undone at close


# ---------------------------------------------------------------------------------------------
# The daemon's service over the enqueuing engine
# ---------------------------------------------------------------------------------------------


async def test_the_service_answers_retrieves_once_enqueued_and_unpins_once_the_gpu_ran_them(gpu: _FakeGpu) -> None:
    """One copy thread, four retrieves in flight: each is answered with its done event before the GPU has run
    any of them (the thread is held only while it enqueues), and the pool pages stay pinned until it has."""
    import asyncio
    import contextlib

    from hkvd.daemon.config import DaemonConfig
    from hkvd.daemon.engines.in_process import in_process_service, own_conn
    from hkvd.transport.keys import chunk_keys
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire import Message, control, kv
    from hkvd.transport.wire.control import EngineSpec

    page, blocks, chunk = 4096, 64, 16
    keys = chunk_keys(list(range(4 * chunk)), chunk)
    cfg = DaemonConfig(chunk_size=chunk, l1_size_bytes=64 << 20, hugepages="off")
    stack = contextlib.ExitStack()
    parts = stack.enter_context(in_process_service(
        cfg, lambda pool: CudaCopyEngine(pool, method="memcpy", register_pool=False)))
    service, index, eng = parts.service, parts.cache, parts.copy_engine
    sent: list[Message] = []
    conn = own_conn(sent)
    device_mem = np.random.default_rng(4).integers(0, 256, blocks * page, dtype=np.uint8)
    handle = b"\x07" * 64
    gpu.memory[handle] = int(device_mem.ctypes.data)
    group = GroupSpec(0, "full", chunk, 0, blocks, "bfloat16", (View(0, 0, 1, page, page, page),))
    spec = EngineSpec("m", 1, 0, "t", chunk, chunk, 8192, "none",
                      [Region(0, "cuda", blocks * page, handle=handle, device_uuid=U0)], [group])

    async def call(msg: Message) -> Message:
        before = len(sent)
        job = service.handle(conn, msg)
        if job is not None:
            await job
        assert len(sent) == before + 1, sent[before:]
        return sent[-1]

    try:
        assert isinstance(await call(control.Register(1, spec.to_wire())), control.RegisterAck)
        store = asyncio.create_task(call(kv.Store(2, [kv.Item(0, c, keys[c], [1 + c]) for c in range(4)])))
        while not store.done():  # the GPU runs what the copy thread enqueued
            gpu.run()
            await asyncio.sleep(0.002)
        assert isinstance(store.result(), kv.StoreResult)
        before, first = device_mem.copy(), len(sent)
        jobs = [service.handle(conn, kv.Retrieve(10 + c, 0, [kv.Item(0, c, keys[c], [20 + c])])) for c in range(4)]
        await asyncio.wait_for(asyncio.gather(*(j for j in jobs if j is not None)), 5.0)
        replies = sent[first:]
        assert sorted(r.req_id for r in replies) == [10, 11, 12, 13]
        # Answered with a done event, the GPU has run none of them, and their pages are pinned.
        assert all(isinstance(r, kv.RetrieveResult) and r.event for r in replies), replies
        assert np.array_equal(device_mem, before)
        assert index.statistics().pinned_entries == 4
        gpu.run()
        assert eng._watcher.flush(5.0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert index.statistics().pinned_entries == 0
        for c in range(4):
            assert np.array_equal(device_mem[(20 + c) * page:(21 + c) * page], before[(1 + c) * page:(2 + c) * page])
    finally:
        service.disconnect(conn)
        stack.close()
