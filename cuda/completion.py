"""Host-side completion of enqueued GPU copies, without a spinning or sleeping thread.

Role
    A copy is enqueued and its thread returns a ``CopyTicket`` at once. Behind the copy (and its
    done event) the engine enqueues a host function (``cudaLaunchHostFunc``): when the GPU
    reaches it, a CUDA driver thread calls ``CompletionWatcher.gpu_reached``, which only hands
    the ticket to the watcher's thread (a host function must make no CUDA call). That thread
    settles the ticket (its waiters wake, its callbacks run: pool accounting, deferred IPC
    releases, which do call CUDA). The same thread enforces every ticket's budget: it sleeps on
    a condition until the earliest deadline or a wake-up, never polling a GPU event in a loop.

Gates
    A copy that must follow an engine's step-end event is not enqueued at first: its ticket holds
    a launch function, and a host function behind the event on a gate stream calls
    ``gate_opened``, which hands the ticket to the watcher's thread; that thread runs the launch
    (``CopyTicket.open_gate``), unless the ticket was settled first. Settling and launching take
    the ticket's lock, so a copy is either never enqueued (its memory is free at once,
    ``gpu_finished`` is set) or enqueued and then held until the GPU finished it (``PagesInUse``
    on the failure).

Budgets
    A ticket whose host function has not run by its deadline (a wedged step-end event, a hung
    stream, or a CUDA error: host functions do not run after an error in the context) is
    settled with ``KVTimeout``, or with ``CopyFailedError`` when one ``cudaEventQuery`` of its
    done event reports an error. Nothing blocks forever: the watcher never calls a blocking
    CUDA function, and ``CopyTicket.wait`` has its own bound past the deadline.

Threading
    ``watch`` / ``settle`` from any thread; ``gpu_reached`` / ``gate_opened`` from the CUDA callback thread; one
    watcher thread runs settlements and callbacks in order. ``CopyTicket`` is settled once
    (the first outcome wins); ``gpu_finished`` is set whenever the GPU reaches the end of the
    copy, even after the ticket was settled as failed (the GPU may run an abandoned copy later).

Lifecycle
    ``CompletionWatcher.close`` fails what is still pending and joins the thread (bounded).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hkvd.transport.copy_engine import CopyResult
from hkvd.transport.errors import CopyFailedError, KVError, KVTimeout, PagesInUse

logger = logging.getLogger(__name__)

# CopyTicket.wait gives the watcher this long past the deadline before giving up on it itself.
WAIT_GRACE_S = 5.0


class LaunchFailed(Exception):
    """Raised by a ticket's launch function: ``error`` is the copy's failure; ``enqueued`` says
    whether any of it may have reached a stream (its pages are then held until ``gpu_finished``)."""

    def __init__(self, error: KVError, *, enqueued: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.enqueued = enqueued


Launch = Callable[["CopyTicket"], tuple[CopyResult, int, object]]


class CopyTicket:
    """One copy. ``result.nbytes`` is known at once; ``result.done_event`` once the copy is enqueued
    (at once, or when its gate opened); ``wait`` blocks until the copy completed on the GPU or failed
    (budget included).

    A ticket made with ``launch`` is not enqueued yet: ``open_gate`` runs ``launch`` (which enqueues
    the copy and returns its result, done event pointer and the buffers the GPU reads), unless the
    ticket was settled first; then nothing is ever enqueued and ``gpu_finished`` is set at once.
    A ticket that failed after it was enqueued carries ``PagesInUse`` on its exception.
    """

    def __init__(self, nbytes: int, done_event: bytes, *, deadline: float, what: str, event_ptr: int = 0,
                 keep: object = None, owner: Any = None, launch: Launch | None = None) -> None:
        self.result = CopyResult(nbytes, done_event)
        self.deadline = deadline
        self.what = what
        self.event_ptr = event_ptr
        self.keep = keep  # buffers the GPU reads (kernel descriptors): held until gpu_finished
        self.owner = owner  # the engine's bookkeeping (where the copy was, or will be, enqueued)
        self.enqueued = launch is None  # True once any of the copy may be on a stream
        self.gpu_finished = threading.Event()  # the GPU will never touch this copy's memory again
        self._launch = launch
        self._settled = threading.Event()  # set after the done callbacks ran: waiters see settled bookkeeping
        self._outcome = False
        self._lock = threading.Lock()
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[CopyTicket], None]] = []
        self._finished_callbacks: list[Callable[[CopyTicket], None]] = []

    def done(self) -> bool:
        return self._settled.is_set()

    def exception(self) -> BaseException | None:
        return self._exc

    def wait(self, timeout_s: float | None = None) -> CopyResult:
        """Block until settled; return ``result`` or raise the failure. Never waits unbounded:
        at most until the deadline plus ``WAIT_GRACE_S`` (or ``timeout_s``)."""
        bound = max(0.0, self.deadline - time.monotonic()) + WAIT_GRACE_S if timeout_s is None else timeout_s
        if not self._settled.wait(bound):
            self.settle(KVTimeout(f"{self.what}: no completion after the copy budget"))
        if self._exc is not None:
            raise self._exc
        return self.result

    def add_done_callback(self, fn: Callable[[CopyTicket], None]) -> None:
        """Call ``fn(ticket)`` once settled (at once if it already is), on the settling thread."""
        with self._lock:
            if not self._outcome:
                self._callbacks.append(fn)
                return
        fn(self)

    def add_finished_callback(self, fn: Callable[[CopyTicket], None]) -> None:
        """Call ``fn(ticket)`` once the GPU is done with the copy's memory: it reached the end of the
        copy, or the copy was never enqueued and never will be (perhaps never, after a CUDA fault)."""
        with self._lock:
            if not self.gpu_finished.is_set():
                self._finished_callbacks.append(fn)
                return
        fn(self)

    def open_gate(self) -> None:
        """Enqueue the copy now (its step-end event completed), unless the ticket is settled already.
        Runs ``launch`` under the ticket's lock, so ``settle`` either precedes it (nothing is enqueued)
        or follows it (the copy is enqueued and its pages are held until ``gpu_finished``)."""
        failure: LaunchFailed | None = None
        with self._lock:
            launch, self._launch = self._launch, None
            if launch is None or self._outcome:
                return
            try:
                self.result, self.event_ptr, self.keep = launch(self)
                self.enqueued = True
            except LaunchFailed as e:
                self.enqueued = e.enqueued
                failure = e
            except BaseException:
                self.enqueued = True  # unknown how far it got: hold its memory
                raise
        if failure is not None:
            if not failure.enqueued:
                self.mark_gpu_finished()
            self.settle(failure.error)

    def settle(self, exc: BaseException | None = None) -> bool:
        """Record the outcome (first call wins), run the callbacks, then wake the waiters; True if this
        call settled it. A failed ticket that is not enqueued never will be (its memory is free at
        once); one that is carries ``PagesInUse`` until the GPU finished it."""
        with self._lock:
            if self._outcome:
                return False
            self._outcome = True
            self._exc = exc
            never = self._launch is not None or not self.enqueued
            self._launch = None
            if exc is not None and not never and not self.gpu_finished.is_set():
                exc.pages_in_use = PagesInUse.until_finished(self)  # type: ignore[attr-defined]
            callbacks, self._callbacks = self._callbacks, []
        if never:
            self.mark_gpu_finished()
        _run_all(callbacks, self)
        self._settled.set()
        return True

    def mark_gpu_finished(self) -> None:
        with self._lock:
            if self.gpu_finished.is_set():
                return
            self.gpu_finished.set()
            callbacks, self._finished_callbacks = self._finished_callbacks, []
        self.keep = None
        _run_all(callbacks, self)


def _run_all(callbacks: list[Callable[[CopyTicket], None]], ticket: CopyTicket) -> None:
    for fn in callbacks:
        try:
            fn(ticket)
        except Exception:
            logger.exception("a copy completion callback failed (%s)", ticket.what)


class CompletionWatcher:
    """Settles tickets as the GPU reaches them, and at their deadlines. See the module docstring.

    ``query_error(event_ptr)`` returns an error message when the event reports a CUDA error, else
    None; it is called only on the watcher's thread, at a ticket's deadline.
    """

    def __init__(self, query_error: Callable[[int], str | None], name: str = "hkvd-cuda-completion") -> None:
        self._query_error = query_error
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, CopyTicket]] = []
        self._ready: list[CopyTicket] = []
        self._gates: list[CopyTicket] = []
        self._marks: list[threading.Event] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, ticket: CopyTicket) -> None:
        with self._cond:
            if self._closed:
                raise CopyFailedError("the CUDA copy engine is closed")
            heapq.heappush(self._heap, (ticket.deadline, next(self._seq), ticket))
            self._cond.notify()

    def gpu_reached(self, ticket: CopyTicket) -> None:
        """The host function behind a copy: runs on a CUDA driver thread, so it only queues."""
        with self._cond:
            self._ready.append(ticket)
            self._cond.notify()

    def gate_opened(self, ticket: CopyTicket) -> None:
        """The host function behind a gate (the step-end event completed): runs on a CUDA driver
        thread, so it only queues; the watcher's thread enqueues the copy (``CopyTicket.open_gate``)."""
        with self._cond:
            self._gates.append(ticket)
            self._cond.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the thread handled everything queued before this call; False past ``timeout_s``."""
        mark = threading.Event()
        with self._cond:
            if self._closed:
                return True
            self._marks.append(mark)
            self._cond.notify()
        return mark.wait(timeout_s)

    def pending(self) -> int:
        with self._cond:
            return sum(1 for _, _, t in self._heap if not t.done())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._gates and not self._marks and not self._closed:
                    while self._heap and self._heap[0][2].done():
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                ready, self._ready = self._ready, []
                gates, self._gates = self._gates, []
                marks, self._marks = self._marks, []
                now = time.monotonic()
                expired: list[CopyTicket] = []
                while self._heap and self._heap[0][0] <= now:
                    expired.append(heapq.heappop(self._heap)[2])
            for t in ready:
                t.settle(None)
                t.mark_gpu_finished()
            for t in gates:
                try:
                    t.open_gate()
                except Exception:  # a launch must raise LaunchFailed; anything else must not stop the thread
                    logger.exception("enqueueing a gated copy failed (%s)", t.what)
                    t.settle(CopyFailedError(f"{t.what}: enqueueing it failed; see the daemon's log"))
            for t in expired:
                if t.done():
                    continue
                self._expire(t)
            for m in marks:
                m.set()

    def _expire(self, t: CopyTicket) -> None:
        try:
            err = self._query_error(t.event_ptr) if t.event_ptr else None
        except Exception as e:  # the query itself failed: report it as the copy's failure
            err = str(e)
        exc: KVError
        if err:
            exc = CopyFailedError(f"{t.what} failed on the GPU: {err}")
        elif not t.enqueued:
            exc = KVTimeout(f"{t.what}: the engine's step-end event did not complete within the copy budget; "
                            "nothing was copied (is the engine wedged?)")
        else:
            exc = KVTimeout(f"{t.what}: not complete within the copy budget")
        t.settle(exc)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending = [t for _, _, t in self._heap]
            self._heap.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        for t in pending:
            t.settle(CopyFailedError(f"{t.what}: the CUDA copy engine closed before the copy completed"))
