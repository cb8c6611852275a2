# SPDX-License-Identifier: Apache-2.0
"""Per-request timeline: when each request passed each point of the connector's path, as JSON lines.

Role
    With ``kv_connector_extra_config.timeline_path`` set, every process of the engine (the scheduler side
    and each worker) appends one JSON line per event to that file::

        {"req": "<vLLM request id>", "event": "load_done", "t": <time.monotonic()>, "step": 7, "pid": 1234}

    ``t`` is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine), ``step`` the
    scheduler step the event belongs to (``SchedulerSide``: the number of the ``build_connector_meta`` call in
    progress or next; a worker: the step whose metadata it last bound), ``pid`` the writing process. Events, in
    the order a hit meets them: ``arrival`` (``on_new_request``), ``lookup_sent``, ``lookup_answered``,
    ``first_schedule`` (the first ``get_num_new_matched_tokens``), ``load_planned`` (``update_state_after_alloc``
    with external tokens), ``load_issued`` and ``load_done`` or ``load_failed`` (a worker: the Retrieve
    submitted, its reply read; an in-step load's copies begun in ``handle_preemptions`` and ended in
    ``start_load_kv``, with ``states_copied`` after its Mamba/GDN states' copy and ``attention_copy`` when its
    attention blocks' copy begins: vLLM's own preparation of the step lies between those two),
    ``load_reported`` (``update_connector_output``: the load vLLM hears of as finished), ``first_forward``
    (``build_connector_meta`` of the first step that schedules tokens of the request) and ``finished``
    (``request_finished``). docs/design.md ("Timeline") says what lies between them and which points vLLM
    gives no hook for.

Cost
    Off (the default) a hook pays one attribute test. On, an event is a tuple appended to a list; the list
    is written with one ``os.write`` on an ``O_APPEND`` descriptor once per step and when a request finishes,
    never per token, so the lines of several processes interleave whole.

Threading
    One instance per connector half, used from that half's one thread (vLLM's scheduler thread, a worker's
    execute thread).

Errors
    A write that fails (disk full, file removed) is logged once and the timeline goes off: a diagnostic
    never stops the engine.
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger("hkvd.shim")

# Every event name, in the order a hit meets them (load_failed ends a failed load instead of load_done).
EVENTS = ("arrival", "lookup_sent", "lookup_answered", "first_schedule", "load_planned", "load_issued",
          "states_copied", "attention_copy", "load_done", "load_failed", "load_reported", "first_forward",
          "finished")


class Timeline:
    """Buffered JSON-lines event log of one process; ``Timeline(None)`` (or ``""``) is off and free."""

    __slots__ = ("_buf", "_fd", "_firsts", "_pid", "on", "step")

    def __init__(self, path: str | None) -> None:
        self.on = bool(path)
        self.step = 0  # the step events are noted under, kept by the owner
        self._buf: list[tuple[str, str, float, int]] = []
        self._firsts: dict[str, set[str]] = {}  # request -> the events note_first has recorded for it
        self._pid = os.getpid()
        self._fd = -1
        if path:
            # Opened once per process; O_APPEND keeps the lines of several processes whole and in write order.
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(self, req: str, event: str) -> None:
        """Record ``event`` of request ``req`` now, under the current step (buffered: see ``flush``)."""
        if self.on:
            self._buf.append((req, event, time.monotonic(), self.step))

    def note_first(self, req: str, event: str) -> None:
        """``note``, the first time only for this request (``first_schedule``, ``first_forward``) until ``forget``."""
        if self.on:
            seen = self._firsts.setdefault(req, set())
            if event not in seen:
                seen.add(event)
                self._buf.append((req, event, time.monotonic(), self.step))

    def forget(self, req: str) -> None:
        """The request has finished: ``note_first`` keeps nothing of it."""
        self._firsts.pop(req, None)

    def flush(self) -> None:
        """Write the buffered events in one ``os.write``."""
        if not self._buf or self._fd < 0:
            return
        buf, self._buf = self._buf, []
        pid = self._pid
        data = "".join(json.dumps({"req": r, "event": e, "t": t, "step": s, "pid": pid}) + "\n"
                       for r, e, t, s in buf).encode()
        try:
            os.write(self._fd, data)
        except OSError as e:
            logger.warning("hkvd: writing the timeline failed (%s); it is off from now on", e)
            self._shut()

    def close(self) -> None:
        """Write what is buffered and close the file; idempotent."""
        self.flush()
        self._shut()

    def _shut(self) -> None:
        self.on = False
        self._buf = []
        self._firsts = {}
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


OFF = Timeline(None)  # the shared instance of a connector half without a timeline (stateless: never written)


# ---- reading a timeline (benches, tests) ------------------------------------------------------------------
def read(path: str, offset: int = 0) -> tuple[dict[str, list[dict[str, object]]], int]:
    """The events of the file from byte ``offset`` on, by request in file order, and the offset after them
    (the last whole line: a line being written is read next time)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    by_req: dict[str, list[dict[str, object]]] = {}
    for line in data[:end].splitlines():
        ev = json.loads(line)
        by_req.setdefault(str(ev["req"]), []).append(ev)
    return by_req, offset + end


def firsts(events: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """Each event's first occurrence in ``events`` (a lookup may be sent again after a reconnect)."""
    out: dict[str, dict[str, object]] = {}
    for ev in sorted(events, key=lambda e: float(e["t"])):  # type: ignore[arg-type]
        out.setdefault(str(ev["event"]), ev)
    return out


def steps_to_forward(events: list[dict[str, object]]) -> int | None:
    """Scheduler steps from the request's first scheduling attempt to its first forward (0: in the same step);
    None when either is missing (the request never ran a forward)."""
    first = firsts(events)
    if "first_schedule" not in first or "first_forward" not in first:
        return None
    return int(first["first_forward"]["step"]) - int(first["first_schedule"]["step"])  # type: ignore[call-overload]
