# SPDX-License-Identifier: Apache-2.0
"""Worker side: loads into requests' blocks, ended by the daemon's replies, never waited for.

Role
    ``WorkerSide.start_load_kv`` hands each load of the step to ``Loads.start``: one Retrieve is
    submitted and the hook returns. The request waits in vLLM's WAITING_FOR_REMOTE_KVS (the
    scheduler side reports every hit as asynchronous) while every other request keeps stepping.
    The daemon's reply, read by whichever hook polls the client next, ends the load; the worker
    hands the ids collected here to vLLM in ``get_transfer_results`` (finished receiving, and a
    failed load also as failed receiving: vLLM recomputes it) and vLLM schedules the request in a
    later step. Prefill/decode pulls (``hkvd.shim.pd``) end with a load started here too.

Threading model
    vLLM's execute thread only; no threads of its own. Completions come in through ``absorb``
    from the worker's polls of the daemon client.

Contracts
    - A load is reported once, and only after the daemon's reply for it (RetrieveResult or Error) or the loss
      of the connection. Until then the daemon may be writing into the request's blocks, and vLLM
      keeps them: the request is not scheduled, and one aborted meanwhile is freed only when the
      load is reported (vLLM 0.32 ``Scheduler.finish_requests`` delays the free of a request in
      WAITING_FOR_REMOTE_KVS; the scheduler side then asks for no free of its own).
    - A load past its deadline (``load_timeout_s``, or what is left of ``pull_timeout_s`` after a
      pull) is aborted once and still waits for the reply. A RetrieveResult after the abort means every byte
      arrived (a daemon job completes whole or fails whole), so it counts as loaded.
    - GPU KV caches: a RetrieveResult carrying the daemon's done event goes through ``on_loaded`` (the engine's
      stream waits on the event) before the load counts as done, so the forward that reads the
      blocks, in a later step, is ordered after the daemon's copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from hkvd.shim.daemon_port import DaemonPort
from hkvd.shim.jobs import LoadJob
from hkvd.shim.results import Completion
from hkvd.shim.timeline import OFF, Timeline
from hkvd.transport.wire.kv import RetrieveResult

logger = logging.getLogger("hkvd.shim")


@dataclass(slots=True)
class _Load:
    job: LoadJob
    deadline: float
    budget: str  # the setting whose time ran out, for the warning
    started: float  # time.monotonic() at submission
    aborted: bool = False


class Loads:
    """Retrieves in flight, by the client's request id. See the module docstring."""

    def __init__(self, timeout_s: float, on_loaded: Callable[[RetrieveResult], None] | None = None,
                 timeline: Timeline = OFF) -> None:
        self.timeout_s = timeout_s
        self.timeline = timeline  # load_done / load_failed per request (hkvd.shim.timeline)
        self._on_loaded = on_loaded
        self._flying: dict[int, _Load] = {}
        self._done: set[str] = set()
        self._failed: set[str] = set()
        # Seconds per block of a load, smoothed over the engine's loads; None before the first. From
        # the daemon's own time for each (RetrieveResult.seconds); from submission to the reply being
        # read where an older daemon sends none. The latter is only an upper bound (a reply is read at
        # the next poll, a step later for a load not waited for), and one high figure would keep the
        # worker from ever waiting for a short load again.
        self._s_per_block: float | None = None
        # load_seconds: submission to the daemon's RetrieveResult being read, summed over the loads that succeeded.
        self.stats = {"loads_started": 0, "loads_ok": 0, "loads_failed": 0, "loaded_bytes": 0, "load_timeouts": 0,
                      "load_seconds": 0.0}

    @property
    def in_flight(self) -> int:
        return len(self._flying)

    def requests(self) -> set[str]:
        """The requests whose loads are in flight (the daemon may be writing into their blocks)."""
        return {p.job.req_id for p in self._flying.values()}

    def start(self, client: DaemonPort, job: LoadJob, lease_id: int, deadline: float = 0.0,
              budget: str = "load_timeout_s") -> None:
        """Submit ``job``'s Retrieve; the client's error (connection lost) propagates, nothing is kept."""
        rid = client.submit_retrieve(job.items, lease_id)
        now = time.monotonic()
        self._flying[rid] = _Load(job, deadline or now + self.timeout_s, budget, now)
        self.stats["loads_started"] += 1

    def absorb(self, c: Completion) -> bool:
        """Take one completion if it ends a load of ours; True when it did."""
        p = self._flying.pop(c.req_id, None)
        if p is None:
            return False
        if not c.ok:
            self.fail(p.job, f"the daemon answered {c.error}")
            return True
        loaded = c.get(RetrieveResult)
        if self._on_loaded is not None:
            # Raises if the engine's stream cannot be made to wait (a CUDA error): the step fails
            # rather than let a forward read blocks the daemon may still be writing.
            self._on_loaded(loaded)
        self.stats["loads_ok"] += 1
        self.stats["loaded_bytes"] += loaded.nbytes
        took = time.monotonic() - p.started
        self.stats["load_seconds"] += took
        if p.job.block_ids:
            per_block = (loaded.seconds or took) / len(p.job.block_ids)
            self._s_per_block = per_block if self._s_per_block is None else 0.7 * self._s_per_block + 0.3 * per_block
        self._done.add(p.job.req_id)
        self.timeline.note(p.job.req_id, "load_done")
        return True

    def due_within(self, horizon_s: float) -> bool:
        """Whether a load in flight is expected to end within ``horizon_s`` (by its blocks and the
        engine's past loads; True before the first load ended)."""
        if self._s_per_block is None:
            return bool(self._flying)
        end = time.monotonic() + horizon_s
        return any(p.started + self._s_per_block * len(p.job.block_ids) <= end for p in self._flying.values())

    def expire(self, client: DaemonPort | None) -> None:
        """Abort loads past their deadline, once each; each still ends with the daemon's reply."""
        now = time.monotonic()
        for rid, p in self._flying.items():
            if p.deadline > now or p.aborted:
                continue
            p.aborted = True
            self.stats["load_timeouts"] += 1
            logger.warning("hkvd: load for %s not done within %s; aborting it, the request waits for the "
                           "daemon to end the copy, then loads or recomputes", p.job.req_id, p.budget)
            if client is not None:
                try:
                    client.abort(rid)
                except Exception:  # the connection is gone: the worker's next poll forgets every load
                    logger.debug("hkvd: abort of load %d failed", rid, exc_info=True)

    def fail(self, job: LoadJob, why: str) -> None:
        """Report ``job`` failed (vLLM recomputes it) without a copy in flight."""
        self.stats["loads_failed"] += 1
        logger.info("hkvd: load for %s failed (%s); vLLM recomputes it", job.req_id, why)
        self._failed.add(job.req_id)
        self.timeline.note(job.req_id, "load_failed")

    def forget(self, why: str) -> None:
        """The daemon connection is gone: every load in flight failed."""
        for p in self._flying.values():
            self.fail(p.job, why)
        self._flying.clear()

    def take(self) -> tuple[set[str], set[str]]:
        """(finished, failed) since the last call; a failed load is in both, as vLLM wants it."""
        failed, self._failed = self._failed, set()
        done, self._done = self._done | failed, set()
        return done, failed
