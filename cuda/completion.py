"""Host-side completion of enqueued GPU copies, without a spinning or sleeping thread.

Role
    A copy is enqueued and its thread returns a ``CopyTicket`` at once. Behind the copy (and its
    done event) the engine enqueues a host function (``cudaLaunchHostFunc``): when the GPU
    reaches it, a CUDA driver thread calls ``CompletionWatcher.gpu_reached``, which only hands
    the ticket to the watcher's thread (a host function must make no CUDA call). That thread
    settles the ticket (its waiters wake, its callbacks run: pool accounting, deferred IPC
    releases, which do call CUDA). The same thread enforces every ticket's budget: it sleeps on
    a condition until the earliest deadline or a wake-up, never polling a GPU event in a loop.

Budgets
    A ticket whose host function has not run by its deadline (a wedged step-end event, a hung
    stream, or a CUDA error: host functions do not run after an error in the context) is
    settled with ``KVTimeout``, or with ``CopyFailedError`` when one ``cudaEventQuery`` of its
    done event reports an error. Nothing blocks forever: the watcher never calls a blocking
    CUDA function, and ``CopyTicket.wait`` has its own bound past the deadline.

Threading
    ``watch`` / ``fail`` from any thread; ``gpu_reached`` from the CUDA callback thread; one
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
from hkvd.transport.errors import CopyFailedError, KVError, KVTimeout

logger = logging.getLogger(__name__)

# CopyTicket.wait gives the watcher this long past the deadline before giving up on it itself.
WAIT_GRACE_S = 5.0


class CopyTicket:
    """One enqueued copy. ``result`` is known at once (bytes, done-event handle); ``wait`` blocks
    until the copy completed on the GPU or failed (budget included)."""

    def __init__(self, nbytes: int, done_event: bytes, *, deadline: float, what: str, event_ptr: int = 0,
                 keep: Any = None, owner: Any = None) -> None:
        self.result = CopyResult(nbytes, done_event)
        self.deadline = deadline
        self.what = what
        self.event_ptr = event_ptr
        self.keep = keep  # buffers the GPU reads (kernel descriptors): held until gpu_finished
        self.owner = owner  # the engine's bookkeeping (attachment state, lane)
        self.gpu_finished = threading.Event()
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
        """Call ``fn(ticket)`` once the GPU reached the end of the copy (perhaps never, after a failure)."""
        with self._lock:
            if not self.gpu_finished.is_set():
                self._finished_callbacks.append(fn)
                return
        fn(self)

    def settle(self, exc: BaseException | None = None) -> bool:
        """Record the outcome (first call wins), run the callbacks, then wake the waiters; True if this
        call settled it."""
        with self._lock:
            if self._outcome:
                return False
            self._outcome = True
            self._exc = exc
            callbacks, self._callbacks = self._callbacks, []
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

    def pending(self) -> int:
        with self._cond:
            return sum(1 for _, _, t in self._heap if not t.done())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._closed:
                    while self._heap and self._heap[0][2].done():
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                ready, self._ready = self._ready, []
                now = time.monotonic()
                expired: list[CopyTicket] = []
                while self._heap and self._heap[0][0] <= now:
                    expired.append(heapq.heappop(self._heap)[2])
            for t in ready:
                t.settle(None)
                t.mark_gpu_finished()
            for t in expired:
                if t.done():
                    continue
                self._expire(t)

    def _expire(self, t: CopyTicket) -> None:
        try:
            err = self._query_error(t.event_ptr) if t.event_ptr else None
        except Exception as e:  # the query itself failed: report it as the copy's failure
            err = str(e)
        exc: KVError = (CopyFailedError(f"{t.what} failed on the GPU: {err}") if err
                        else KVTimeout(f"{t.what}: not complete within the copy budget"))
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
