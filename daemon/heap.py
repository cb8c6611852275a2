"""The daemon's garbage-collector policy: long-lived objects out of the cyclic collector's scans.

Why
    CPython's cyclic collector stops the interpreter, so the event loop and every engine waiting
    on it, while it walks every tracked object of the generation it collects. A full collection
    (generation 2) walks the whole heap, and runs each time the heap of survivors has grown by a
    quarter. The index holds about five tracked objects per entry: at 10^6 entries a full
    collection took 0.9-1.2 s (measured, ``python -m bench scale``), and with a small index the
    ~40 000 objects of the imported modules still cost 15-25 ms a time (measured in peer pulls).

Policy
    - At start-up, once the daemon is ready: one full collection, then ``gc.freeze()``: every
      object alive then (modules, the pool, the server) moves to the permanent generation, which
      collections never walk.
    - Then, each time ``freeze_every`` more entries have been written into the index: collect the
      two young generations (cost: the young objects only) and freeze again. The entries written
      since the last freeze, the bulk of the heap's growth, leave the scans.
    - ``freeze_every = 0`` (``--gc-freeze-every 0``) leaves CPython's collector as it is.

What freezing costs
    Frozen objects are still freed by reference counting when the last reference goes: an
    entry, its allocation and its chain node hold no reference cycles (``tests/unit/test_heap.py``
    checks that dropping every entry frees what freezing kept). An object that is alive at a
    freeze and later becomes garbage *only through a cycle* is never reclaimed: a request in
    flight at that moment that ends with an exception, say. With a freeze per ``freeze_every``
    entries written, that is a few objects per freeze. ``hkvd status`` shows the frozen count and
    the longest pause, so both are visible.

Threading
    Event loop only (``gc.callbacks`` run on whichever thread triggered a collection; they only
    add to plain counters).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

from hkvd.daemon.metrics import Metrics
from hkvd.transport.stat_fields import status_only

log = logging.getLogger("hkvd.heap")

DEFAULT_FREEZE_EVERY = 10_000


@dataclass(frozen=True, slots=True)
class HeapStats:
    """The collector's longest pause and what the policy froze (``hkvd status``: ``heap``); the collections
    and their pauses are the ``gc_collections`` and ``gc_pause_seconds`` counters."""

    freeze_every: int = status_only()  # entries written between freezes; 0: freezing off
    freezes: int = status_only()
    frozen_objects: int = status_only()
    max_pause_ms: float = status_only()


class HeapPolicy:
    def __init__(self, freeze_every: int, metrics: Metrics) -> None:
        if freeze_every < 0:
            raise ValueError(f"freeze_every must be >= 0, got {freeze_every}")
        self.freeze_every = freeze_every
        self.metrics = metrics
        self.freezes = 0
        self.max_pause_s = 0.0
        self._last_writes = 0
        self._started = 0.0
        self._installed = False

    # ---- pauses --------------------------------------------------------------------------------
    def install(self) -> None:
        """Count every collection and its pause (also with freezing off)."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        """Stop counting, and hand what was frozen back to the collector (a daemon embedded in another
        program, e.g. a test, leaves that program's collector as it found it)."""
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False
        if self.freezes:
            gc.unfreeze()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        gen = str(info.get("generation", "?"))
        self.metrics.inc("gc_collections", generation=gen)
        self.metrics.inc("gc_pause_seconds", pause, generation=gen)
        self.max_pause_s = max(self.max_pause_s, pause)

    # ---- freezing ------------------------------------------------------------------------------
    def start(self, writes: int) -> None:
        """Once ready: collect everything start-up left behind, then freeze what lives on."""
        self._last_writes = writes
        if not self.freeze_every:
            return
        gc.collect()
        gc.freeze()
        self.freezes += 1
        log.info("gc: froze %d start-up objects; freezing again every %d entries written",
                 gc.get_freeze_count(), self.freeze_every)

    def maybe_freeze(self, writes: int) -> bool:
        """Freeze again once ``freeze_every`` entries were written since the last freeze."""
        if not self.freeze_every or writes - self._last_writes < self.freeze_every:
            return False
        self._last_writes = writes
        gc.collect(1)  # the young garbage goes first: only survivors are frozen
        gc.freeze()
        self.freezes += 1
        return True

    def statistics(self) -> HeapStats:
        return HeapStats(freeze_every=self.freeze_every, freezes=self.freezes, frozen_objects=gc.get_freeze_count(),
                         max_pause_ms=round(self.max_pause_s * 1e3, 3))
