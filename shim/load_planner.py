# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's load path: external tokens, load jobs, lease watches, finished loads for vLLM.

Role
    ``LoadPlanner`` is the one home of a hit's load on the scheduler side. Once the record is answered it
    tells vLLM how many tokens come from outside and how (``matched``: in the step, when the daemon placed the
    hit in its pool for workers that map it, ``hkvd.shim.pool_reads``; else asynchronous, so the request waits
    in WAITING_FOR_REMOTE_KVS; nothing for a hit sampled for verification, ``hkvd.shim.verify``); once vLLM
    allocated the request's blocks it turns the hit into a ``LoadJob`` for the workers (``allocated``;
    ``hkvd.shim.plans.load_items``), or releases the lease of a hit vLLM's own cache covered; it watches the
    lease a host-memory load retrieves under (``early_load_reports``) and reports the load finished to vLLM
    through ``LoadReports`` (``report``), from the workers' report or the watch's, whichever comes first.

Threading
    vLLM's scheduler thread only; watch replies are read by the scheduler side's polls.

Contracts
    - An in-step load is promised to vLLM as computed tokens: it is never reported, its lease is released
      once the step that copies it has run, and the worker has no way to fail it (its failure is a bug: the
      worker reports its blocks as load errors, which vLLM takes for a model of one KV-cache group only).
    - A load is reported to vLLM once (``LoadReports``); a failed one (``failed_recving``) fails the
      record: vLLM recomputes it and it is never offered an external hit again.
    - A load plan that names vLLM's null block (a window starting mid-chunk) or that the state machine
      refuses goes out with no items: the worker reports it failed, vLLM recomputes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from hkvd.shim import plans, verify
from hkvd.shim.jobs import LoadJob
from hkvd.shim.request_state import Event, LoadReports, RequestRecord, State
from hkvd.shim.results import Completion
from hkvd.shim.scheduler_context import SchedulerContext
from hkvd.transport.wire.kv import Item

if TYPE_CHECKING:  # vLLM's types, for annotations only
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hkvd.shim")


class LoadPlanner:
    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx
        self.watches: dict[int, tuple[str, int]] = {}  # lease watches in flight: watch id -> (request, lease)
        self.reports = LoadReports()  # the one source of "load finished" (workers' reports, lease watches)
        self._jobs: list[LoadJob] = []  # planned since the last step's metadata
        self._said_no_verify = False  # warned that the daemon compares no sampled hits
        self._builds = 0  # step metadata built so far (take_jobs)
        self._in_step_leases: deque[tuple[int, int]] = deque()  # (builds when planned, lease) of in-step loads

    # ---- what vLLM loads ----------------------------------------------------------------------
    def matched(self, request: Request, st: RequestRecord, num_computed_tokens: int) -> tuple[int, bool]:
        """External tokens for an answered record beyond vLLM's own ``num_computed_tokens``, and whether they
        load asynchronously (see the scheduler side's Contracts)."""
        ctx = self.ctx
        hit_tokens = st.hit_tokens(ctx.chunk_size)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        if (st.pull is None and verify.sampled(request.request_id, ctx.cfg.verify_fraction, ctx.cfg.verify_seed)
                and self._daemon_verifies()):
            # Sampled: the engine computes it (its answer never depends on the entries under test) and the
            # chunks it computes are compared, not stored; its lease is released once it is allocated. A
            # partial last chunk cannot be compared (the computing request holds no state where it ends): it
            # is dropped from the hit, and the whole chunks before it are compared.
            if st.partial is not None:
                st.partial = None
                st.hit_chunks -= 1
            st.verify_upto = st.hit_chunks
            st.verify_from = -(-num_computed_tokens // ctx.chunk_size)  # chunks vLLM's own cache holds whole
            return 0, False
        st.verify_from = st.verify_upto = 0
        st.in_step = self._in_step(st)
        return hit_tokens - num_computed_tokens, not st.in_step

    def _in_step(self, st: RequestRecord) -> bool:
        """Whether the hit loads in the step that plans it (``hkvd.shim.pool_reads``): the daemon placed it in
        its pool under the record's lease, and most of that lease's time is left (the lease keeps the
        entries; the worker copies them before this step's forward)."""
        return (st.places is not None and st.pull is None and st.state is State.LOOKED_UP
                and st.lease_id == st.places_lease and time.monotonic() < st.lease_until)

    def _daemon_verifies(self) -> bool:
        """Whether the daemon compares sampled hits (``RegisterAck.verify``); an older one does not, and is told
        nothing it cannot parse: verification is off against it, said once."""
        ack = self.ctx.link.ack
        if ack is not None and ack.verify:
            return True
        if not self._said_no_verify:
            self._said_no_verify = True
            logger.warning("hkvd: the daemon does not compare sampled hits (an older hkvd); verify_fraction %s "
                           "has no effect until hkvd serve on this node is upgraded", self.ctx.cfg.verify_fraction)
        return False

    def allocated(self, request: Request, st: RequestRecord, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: its load job, or its lease released when nothing loads."""
        ctx = self.ctx
        held = st.held_chunks
        if st.hit_chunks:
            # The daemon holds chunks [0, hit) for every group the hit rule needs: never store them again.
            # A sampled hit's chunks from verify_from on are computed here and compared instead.
            st.next_store_chunk = max(st.next_store_chunk, st.verify_from if st.verify_upto else held)
            if st.verify_upto:
                ctx.stats["verify_sampled"] += 1
        if num_external_tokens <= 0 or not st.hit_chunks:
            if st.lease_id and not st.lease_used:
                ctx.release(st.lease_id)
                st.lease_used = True
            st.pull = None  # nothing external to load (vLLM's own cache covered it)
            ctx.fire(st, Event.ALLOCATED)
            return
        n = st.hit_chunks
        keys = ctx.keys.prompt(st)
        if st.partial is not None:  # chunk n - 1 is partial: its own key, loaded into block n - 1 all the same
            keys = [*keys[:n - 1], st.partial[1]]
        items, bad = plans.load_items(ctx.groups, keys, n, st.hit_tokens(ctx.chunk_size) - num_external_tokens,
                                      blocks.get_block_ids(), ctx.chunk_size)
        all_blocks = sorted({b for it in items for b in it.block_ids if b})
        if st.in_step:
            self._in_step_job(request, st, items, all_blocks, num_external_tokens)
            return
        if bad:
            logger.warning("hkvd: load plan for %s names vLLM's null block (window starts mid-chunk?); "
                           "recomputing it", request.request_id)
            items = []
        if not ctx.fire(st, Event.LOAD_PLANNED):
            items, st.pull = [], None  # the worker refuses it, reports the load failed: vLLM recomputes
        self._jobs.append(LoadJob(request.request_id, st.lease_id, items, all_blocks, pull=st.pull))
        ctx.timeline.note(request.request_id, "load_planned")
        if items and st.pull is None and st.lease_id:
            self._watch(request.request_id, st.lease_id)
        if st.pull is not None:
            st.pull = None
            ctx.stats["pull_jobs"] = ctx.stats.get("pull_jobs", 0) + 1
        st.lease_used = True
        st.next_store_chunk = max(st.next_store_chunk, held)
        ctx.stats["load_jobs"] += 1
        ctx.stats["hit_tokens"] += num_external_tokens

    def _in_step_job(self, request: Request, st: RequestRecord, items: list[Item], all_blocks: list[int],
                     num_external_tokens: int) -> None:
        """The worker copies the hit before this step's forward: vLLM counts its tokens computed already. A
        sliding window's null blocks are skipped (``pool_reads.copy_in_step``); the lease is released once the
        step that copies has run (``in_step_ran``)."""
        ctx = self.ctx
        ctx.fire(st, Event.LOADED_IN_STEP)
        self._jobs.append(LoadJob(request.request_id, st.lease_id, items, all_blocks, places=st.places,
                                  pool=st.places_pool))
        self._in_step_leases.append((self._builds + 1, st.lease_id))  # in the metadata built next
        ctx.timeline.note(request.request_id, "load_planned")
        st.lease_used, st.places = True, None
        st.next_store_chunk = max(st.next_store_chunk, st.held_chunks)
        ctx.stats["load_jobs"] += 1
        ctx.stats["in_step_loads"] += 1
        ctx.stats["hit_tokens"] += num_external_tokens

    def in_step_ran(self) -> None:
        """A step's output came back: release the leases of in-step loads in the metadata built before the last
        one (under async scheduling the last one may not have run yet; without it, a lease is held one step
        longer than needed). An engine that stops stepping leaves its last leases to expire."""
        leases = self._in_step_leases
        while leases and leases[0][0] < self._builds:
            self.ctx.release(leases.popleft()[1])

    def take_jobs(self) -> list[LoadJob]:
        """The load jobs planned since the last call, for this step's metadata."""
        jobs, self._jobs = self._jobs, []
        self._builds += 1
        return jobs

    # ---- lease watches and reports -------------------------------------------------------------
    def _watch(self, req_id: str, lease_id: int) -> None:
        """Watch the lease a load retrieves under (``early_load_reports``): see ``_report_early``."""
        port, ack = self.ctx.port, self.ctx.link.ack
        if not self.ctx.cfg.early_load_reports or port is None or ack is None or not ack.lease_watch:
            return
        try:
            self.watches[port.submit_watch(lease_id)] = (req_id, lease_id)
        except Exception as e:  # the workers report the load, as without the watch
            self.ctx.link.lost(e)

    def on_completion(self, c: Completion) -> bool:
        """Take a lease watch's reply; False when ``c`` is none."""
        watched = self.watches.pop(c.req_id, None)
        if watched is None:
            return False
        st = self.ctx.reqs.get(watched[0])
        if c.ok and st is not None and st.loading and st.lease_id == watched[1]:
            self.reports.watched(watched[0])
        return True

    def from_workers(self, output: KVConnectorOutput) -> set[str]:
        """The workers' load reports: each record moved, those a watch reported already taken out (vLLM must
        not hear a load twice). The loads vLLM is to hear of as finished receiving."""
        recving = set(getattr(output, "finished_recving", None) or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        self.reports.from_workers(recving, failed)
        for req_id in recving | failed:
            st = self.ctx.reqs.get(req_id)
            if st is not None:
                self.ctx.fire(st, Event.LOAD_FAILED if req_id in failed else Event.LOAD_DONE)
        return recving

    def report_early(self, recving: set[str]) -> None:
        """Add to ``recving`` the loads whose lease the daemon says every rank's retrieve wrote.

        Under vLLM's async scheduling the output handed here is the previous step's, read after the
        current step ran: a worker's report of a load that ended during the current step reaches vLLM
        with the next output, a step later than this one. The worker still reports it; that report is
        then taken out (``LoadReports.from_workers``). Never for GPU KV caches (the engine's stream must
        first wait for the daemon's copy, which only the worker does: the daemon does not count it
        written) nor for prefill/decode pulls (not watched)."""
        for req_id in self.reports.take_watched():
            st = self.ctx.reqs.get(req_id)
            if st is None or not st.loading:  # finished meanwhile (its blocks wait for the worker's report)
                continue
            self.ctx.fire(st, Event.LOAD_DONE)
            recving.add(req_id)
            self.reports.reported_by_watch(req_id)
            self.ctx.stats["loads_reported_early"] += 1

    @property
    def reported_early(self) -> Counter[str]:
        """Loads this side reported whose workers' reports are still to come."""
        return self.reports.awaiting_workers

    def forget(self) -> None:
        """A new connection: the old one's watches never complete (the workers report those loads), and its
        leases ended with it."""
        self.watches.clear()
        self._in_step_leases.clear()
