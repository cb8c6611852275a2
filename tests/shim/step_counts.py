# SPDX-License-Identifier: Apache-2.0
"""Scheduler steps a request spent from its first scheduling to its first forward, read from the connector's
timeline (``hkvd.shim.timeline``), checked against docs/design.md ("Steps a hit costs").

Steps, never time: each event carries the number of the scheduler step it belongs to. For a request hkvd loads
(asynchronously: its first scheduling returns ``(n, True)``):

- the load is planned in the request's first scheduling and issued by the worker in that step (an engine run
  whose lookup wait covers the daemon's reply: ``lookup_wait_s`` in the test's extra config);
- vLLM hears of it with the output of the step in which a worker read the daemon's reply (or the scheduler
  side's lease watch saw it sooner): ``load_reported`` is at most 1 step (plain ``step()``) or 2 (async
  scheduling, whose next step is scheduled before the output is read) after that step;
- its forward runs in the scheduling right after the report: ``first_forward`` is in ``load_reported``'s step;
- so a hit takes ``FLOOR`` steps (1 plain, 2 async) when the reply is read in the step that issued the load, and
  one more per step the reply came later: never more.

A request that loads nothing (a miss, or vLLM's own cache) runs its forward in its first scheduling: 0 steps; so
does an in-step load (``in_step_loads``: planned, issued and copied in its first scheduling, never reported),
counted under ``in_step``.
"""

from __future__ import annotations

from typing import Any

from hkvd.shim import timeline

# docs/design.md, "Steps a hit costs": vLLM 0.32's fewest steps from an async load's first scheduling to its
# forward. Plain step(): the finished load is read after step N, the forward runs in N + 1 (scheduler.py
# 978-981, 1320-1338, 3226-3227, 915-929). Async scheduling: step_with_batch_queue schedules N + 1 before it
# reads N's output (core.py 725-760), so N + 2. vLLM's CPU platform turns async scheduling off (cpu.py 331).
FLOOR = {False: 1, True: 2}


def check(path: str, async_scheduling: bool) -> dict[str, Any]:
    """Check every request of the timeline at ``path``; return the steps of the hits and the misses, and the
    steps the daemon's replies took past the step that issued their load, in file order."""
    by_req, _ = timeline.read(path)
    floor = FLOOR[async_scheduling]
    hits: list[int] = []
    misses: list[int] = []
    late: list[int] = []
    in_step: list[int] = []
    for req, events in by_req.items():
        first = timeline.firsts(events)
        steps = timeline.steps_to_forward(events)
        assert steps is not None, f"{req}: no first scheduling or forward in its timeline: {events}"
        at = {name: int(ev["step"]) for name, ev in first.items()}
        if "load_planned" not in at:
            assert steps == 0, f"{req} loaded nothing yet took {steps} steps to its first forward: {events}"
            misses.append(steps)
            continue
        assert at["load_planned"] == at["first_schedule"], f"{req}: the load was planned a step late: {at}"
        if "load_reported" not in at and "load_done" in at and at["load_done"] == at["load_planned"]:
            # An in-step load (in_step_loads): copied by the workers before the forward of the step that planned
            # it, never reported: the request runs in its first scheduling, like a miss.
            assert at.get("load_issued") == at["load_planned"], f"{req}: in-step load issued late: {at}"
            # Its copies in order, in that step: the states (handle_preemptions), then the attention blocks
            # (start_load_kv), as the first worker to copy wrote them.
            pid = first["load_issued"]["pid"]
            order = [e["event"] for e in sorted(events, key=lambda e: float(e["t"]))  # type: ignore[arg-type]
                     if e["pid"] == pid and e["event"] in ("load_issued", "states_copied", "attention_copy",
                                                           "load_done")]
            assert order[:4] == ["load_issued", "states_copied", "attention_copy", "load_done"], \
                f"{req}: an in-step load's copies out of order: {order}"
            assert at["states_copied"] == at["attention_copy"] == at["load_planned"], f"{req}: {at}"
            assert steps == 0, f"{req}: an in-step load took {steps} steps to its first forward: {events}"
            in_step.append(steps)
            continue
        assert at.get("load_issued") == at["load_planned"], f"{req}: the worker did not issue the load in the " \
            f"step that planned it: {at}"
        read = at.get("load_done", at.get("load_failed"))
        assert read is not None and "load_reported" in at, f"{req}: the load never ended or was never reported: {at}"
        assert at["load_reported"] <= read + floor, f"{req}: the load was reported later than the step after " \
            f"its reply was read: {at}"
        assert at["first_forward"] == at["load_reported"], f"{req}: the forward did not run in the step after " \
            f"the load was reported: {at}"
        slack = read - at["load_issued"]  # steps the daemon's reply came after the step that issued the load
        assert floor <= steps <= floor + slack, f"{req}: a hit took {steps} steps to its first forward; " \
            f"docs/design.md says {floor} (plus {slack} for a reply read that many steps late): {at}"
        hits.append(steps)
        late.append(slack)
    return {"hits": hits, "misses": misses, "late_replies": late, "in_step": in_step}
