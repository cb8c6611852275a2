"""Copies between an engine's memory and the pool: where each runs, its budget, its settlement, its pages.

Threading
    ``Copies.run`` is awaited on the event loop. A copy runs on the daemon's copy thread pool with a
    timeout (``copy_timeout_s``), on the step events' own thread when urgent, or on the loop when the
    copy engine says one this small costs less than the hand-off (``inline_max_bytes``). A copy that
    outlives its timeout keeps its pins until the thread returns (the pool pages are in use), and its
    job fails with ``KVTimeout``.

Errors
    ``KVTimeout`` (counted as ``copy_timeouts``), the copy engine's ``KVError``, and ``CopyFailedError``
    for an ``OSError`` (both counted as ``copy_errors``). A failed copy's pages go back through
    ``release_after``: at once, or once the GPU has finished a copy it may still run (``PagesInUse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from hkvd.transport.copy_engine import Attachment, CopyEngine, CopyResult, Direction, EnqueuedCopy, Segment
from hkvd.transport.errors import CopyFailedError, KVError, KVTimeout, PagesInUse

if TYPE_CHECKING:
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.metrics import Metrics

log = logging.getLogger("hkvd.service")

# An enqueued copy is settled by its engine's own budget (copy_timeout_s); the daemon's wait is a backstop
# this long past it.
ENQUEUED_GRACE_S = 5.0


def _settle_future(fut: asyncio.Future[CopyResult], ticket: EnqueuedCopy) -> None:
    """Pass an enqueued copy's outcome (``EnqueuedCopy``) to its future on the loop."""
    if fut.done():
        return
    exc = ticket.exception()
    if exc is None:
        fut.set_result(ticket.result)
    else:
        fut.set_exception(exc)


def _settled_copy(fut: asyncio.Future[CopyResult]) -> None:
    """Retrieve a copy thread's outcome; one nobody awaits any more (timed out, cancelled) is logged at debug."""
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.debug("a copy thread ended with %r", exc)


class Copies:
    """The service's copies: ``executor`` for stores, loads and checks, ``step_executor`` for the step
    events' own (due before step s+2 is reported); ``timeout_s`` bounds each (``copy_timeout_s``)."""

    def __init__(self, copy_engine: CopyEngine, executor: Executor, step_executor: Executor, metrics: Metrics,
                 timeout_s: float) -> None:
        self.copy_engine = copy_engine
        self.executor = executor
        self.step_executor = step_executor
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def run(self, conn: Conn, attachment: Attachment | None, segments: list[Segment],
                  direction: Direction, wait_event: bytes = b"", urgent: bool = False,
                  answer_enqueued: bool = False) -> tuple[CopyResult, asyncio.Future[CopyResult] | None]:
        """Move ``segments``: on a copy thread with a timeout (``urgent``: the step events' own), or on
        the loop when the engine says a copy this small costs less than the hand-off (``inline_max_bytes``).

        An engine that ``enqueues`` (CUDA) holds the copy thread only while it enqueues. Its copy is
        awaited until the device finished it, unless ``answer_enqueued`` (a retrieve, whose reply carries
        the done event the engine's stream waits on): then this returns once the copy is enqueued, with
        the future that settles when the device finished it (or failed); else that future is None."""
        assert attachment is not None
        engine = self.copy_engine
        executor = self.step_executor if urgent else self.executor
        conn.inflight += 1
        t0 = time.perf_counter()
        try:
            settled = None
            if (engine.inline_max_bytes and not wait_event
                    and sum(s.nbytes for s in segments) <= engine.inline_max_bytes):
                result = engine.copy_ordered(attachment, segments, direction)
            elif engine.enqueues:
                result, settled = await self._enqueued(executor, attachment, segments, direction, wait_event,
                                                       answer_enqueued)
            else:
                result = await self._threaded(executor, attachment, segments, direction, wait_event)
            if settled is None:
                # GB/s of the last copies per direction, submit to completion (thread hand-off included)
                self.metrics.observe_rate("copy", result.nbytes, time.perf_counter() - t0,
                                          direction=direction.value)
            else:
                settled.add_done_callback(functools.partial(self._count_settled, direction, t0))
            return result, settled
        except KVTimeout:
            raise  # counted as copy_timeouts
        except KVError:
            self.metrics.inc("copy_errors")
            raise
        except OSError as e:
            self.metrics.inc("copy_errors")
            raise CopyFailedError(f"{direction.value} copy failed: {e}") from None
        finally:
            conn.inflight -= 1

    async def _enqueued(self, executor: Executor, attachment: Attachment, segments: list[Segment],
                        direction: Direction, wait_event: bytes,
                        answer_enqueued: bool) -> tuple[CopyResult, asyncio.Future[CopyResult] | None]:
        """``CopyEngine.submit`` on a copy thread (it returns once the copy is enqueued or gated), then the
        device's completion, bridged to the loop. See ``run``."""
        loop = asyncio.get_running_loop()
        ticket = await loop.run_in_executor(executor, functools.partial(
            self.copy_engine.submit, attachment, segments, direction, wait_event=wait_event or None))
        settled: asyncio.Future[CopyResult] = loop.create_future()

        def bridge(t: EnqueuedCopy) -> None:  # on the engine's completion thread
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                loop.call_soon_threadsafe(_settle_future, settled, t)

        ticket.add_done_callback(bridge)
        if answer_enqueued and not wait_event:  # enqueued already: its done event is in the result
            return ticket.result, settled
        # The engine's own budget settles the ticket (KVTimeout, PagesInUse); this bound is a backstop.
        try:
            async with asyncio.timeout(self.timeout_s + ENQUEUED_GRACE_S):
                return await asyncio.shield(settled), None
        except TimeoutError:
            self.metrics.inc("copy_timeouts")
            settled.add_done_callback(_settled_copy)
            err = KVTimeout(f"{direction.value} copy: no completion from the device after "
                            f"{self.timeout_s + ENQUEUED_GRACE_S:g} s")
            err.pages_in_use = PagesInUse.until_finished(ticket)  # type: ignore[attr-defined]
            raise err from None

    def _count_settled(self, direction: Direction, t0: float, settled: asyncio.Future[CopyResult]) -> None:
        """A copy answered once enqueued has settled: count its rate, or its failure."""
        if settled.cancelled():
            return
        exc = settled.exception()
        if exc is None:
            self.metrics.observe_rate("copy", settled.result().nbytes, time.perf_counter() - t0,
                                      direction=direction.value)
        elif isinstance(exc, KVTimeout):
            self.metrics.inc("copy_timeouts")
        else:
            self.metrics.inc("copy_errors")

    async def _threaded(self, executor: Executor, attachment: Attachment, segments: list[Segment],
                        direction: Direction, wait_event: bytes) -> CopyResult:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(executor, functools.partial(
            self.copy_engine.copy_ordered, attachment, segments, direction, wait_event=wait_event or None))
        # The shield below stops passing the thread's outcome on once this job times out or is
        # cancelled: its exception (the engine's own timeout, say) is retrieved here instead of
        # being reported by asyncio as "never retrieved" when the future is collected.
        fut.add_done_callback(_settled_copy)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            self.metrics.inc("copy_timeouts")
            # The thread still uses the pages: wait for it (bounded by the kernel call) before unpinning.
            await asyncio.wait([fut])
            raise KVTimeout(f"{direction.value} copy took longer than {self.timeout_s:g} s") from None

    @staticmethod
    def release_after(exc: BaseException, release: Callable[[], None]) -> None:
        """Give a failed copy's pool pages back (``release``): now, or, when the copy engine says the GPU
        may still run that copy (``PagesInUse`` on its error), once it has finished. Until then the
        entries stay pinned (WRITING ones are never served): a late write lands in pages nobody reuses."""
        held = PagesInUse.of(exc)
        if held is None or held.is_free():
            release()
            return
        loop = asyncio.get_running_loop()
        log.info("a failed copy may still run on the GPU: its pool pages stay held until it has finished")

        def free_on_loop() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: the pool goes with it
                loop.call_soon_threadsafe(release)

        held.call_when_free(free_on_loop)
