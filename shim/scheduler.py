# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of the connector: vLLM's scheduler hooks over three parts, firing the requests' events.

Role
    Runs in vLLM's EngineCore scheduler thread. It asks the daemon how many chunks of a
    request's prompt are cached (the daemon applies the hybrid hit rule across groups),
    turns vLLM's block tables into load items (``update_state_after_alloc``) and, once per
    step, into store items for attention chunks that become complete and offer items for
    Mamba boundary states (``build_connector_meta``). It never copies: the worker does.

Parts
    ``SchedulerSide`` is the adapter to vLLM's hooks: it keeps the daemon link, routes the daemon's
    replies, and fires the state machine's events; the work is done by three parts sharing one
    ``SchedulerContext`` (settings, link, the records by request, counters):
    ``Lookups`` (``hkvd.shim.lookups``: submit, tails, probes, turn ends, the wait for an answer),
    ``StorePlanner`` (``hkvd.shim.store_planner``: the step's metadata, partial and turn-end stores,
    stores at finish, pins), and ``LoadPlanner`` (``hkvd.shim.load_planner``: external tokens,
    allocation into load jobs, lease watches, load reports), the one home of the load path. All
    per-request state is on the request's ``RequestRecord``, the partial hit included.

Threading model
    vLLM calls every method from one thread. The daemon link is polled from the hooks
    themselves (no background thread); a lookup is submitted when the request arrives
    (``on_new_request``) and normally answered before the scheduler first asks.

Contracts (vLLM 0.32 ``KVConnectorBase_V1``; see shared/reference/vllm-connector.md)
    - ``get_num_new_matched_tokens`` is repeatable: it returns ``None`` while the lookup is in
      flight (at most ``lookup_timeout_s``, then a miss), afterwards the same answer. Hits are
      whole chunks (chunk_size is a multiple of vLLM's block size N, so block-aligned) and
      never reach the last prompt token (vLLM must compute at least one token). A hit the daemon
      placed in its pool for workers that map it (``in_step_loads``, ``hkvd.shim.pool_reads``) is
      synchronous (``False``): the workers copy it before the forward of the step that plans it,
      and nothing reports it. Other loads are
      reported as asynchronous (``True``): the request waits in WAITING_FOR_REMOTE_KVS while
      the daemon loads its blocks and the other requests keep stepping (the worker's
      ``start_load_kv`` only submits), and the worker reports it finished (or failed) in
      ``get_transfer_results`` of a later step, once the daemon has replied. With
      ``early_load_reports`` this side watches the load's lease and reports a host-memory load
      itself once the daemon says every rank's retrieve wrote its blocks, a step sooner under
      async scheduling (``LoadPlanner.report_early``); the workers' later report of it is taken out.
      vLLM 0.32 accepts a failed load of a model with several KV-cache groups (every hybrid)
      only as a failed request (``failed_recving``); a block-level load error (the sync-load
      path) stops the engine. A request whose load failed is recomputed from scratch and never
      offered an external hit again.
    - Attention stores cover full chunks, from the blocks vLLM holds in the step that completes
      them (sliding-window blocks are freed soon after): the prompt's, and with ``store_decode``
      (the default) also those that fill while the request generates. A chunk is stored once its
      KV is computed (it ends at or before ``num_computed_tokens`` after the step) and every token
      of it is known to the scheduler (it ends at or before ``request.num_tokens``; under async
      scheduling the token a step feeds is still a placeholder, so its chunk waits a step), and
      when the request finishes at the latest (``request_finished``: from the blocks it hands
      back, whose free is delayed until the copies are done). Mamba stores come only from
      ``boundary_state_offloads`` at chunk boundaries, prompt or output, and become visible only
      through the step events' confirms (``hkvd.shim.worker``). Keys past the prompt continue its
      rolling keys over the output tokens, with the same extra keys vLLM gives its own blocks
      there (``ChunkIdentity.extras``), so the next turn of a chat (prompt + answer + new message)
      hits them.
    - ``request_finished_all_groups`` delays the free of every request that had copies, until
      the worker reports it in ``finished_sending`` (stores done or failed). A producer
      (``kv_producer``) returns ``kv_transfer_params`` for a decode engine; a consumer given them
      claims the chunks and its worker pulls them from the producer's daemon first
      (``hkvd.shim.pd``). A request finished while its load (or pull) runs keeps its blocks until
      the worker reports it in ``finished_recving``, once the daemon has ended the copy.
    - Sampled verification (``verify_fraction``, ``hkvd.shim.verify``): a request whose hit is
      sampled is reported with no external tokens and computed; the chunks of its hit that it
      computes go out as ``VerifyJob`` items (and Mamba states as the step event's verifies) where
      they would have been stored, and are compared by the daemon, never stored.
    - Session pins and tenants (docs/agents.md): a request's ``kv_transfer_params`` may ask for a pin
      (``hkvd.shim.sessions``; bad input: one warning, the request runs unpinned). When it arrives, one
      ``kv.Pin`` names its prompt's whole chunks (stored during the request, they are held from the
      start); when it finishes, another names every chunk it stored or found stored
      (``next_store_chunk``) and supersedes the first. Each is sent without waiting for a reply, and
      only to a daemon whose ``RegisterAck.pins`` says it takes pins
      (else said once). Every store carries the request's tenant (``hkvd.shim.tenants``); the Mamba
      states of step events carry none (they count as the unsalted share's).
    - Leases the daemon granted for hits that are not loaded (local cache won, request
      finished before allocation) are released at once; a retrieve releases its own lease.
    - KV events (docs/routing.md): when the daemon publishes them node-wide, or the engine runs
      with ``kv_events_config``, every store and offer carries a note per chunk with vLLM's own
      block hashes for it (``hkvd.shim.kv_event_notes``); with ``kv_events_config``,
      ``take_events`` also returns the daemon's events for this engine's layout
      (``hkvd.shim.kv_event_feed``).

Timeline (``timeline_path``; ``hkvd.shim.timeline``)
    Off by default. On, this side notes each request's arrival, lookup sent and answered, first scheduling,
    load planned and reported, first forward (the first step whose ``num_scheduled_tokens`` names it) and finish
    under the number of the step being scheduled, and writes them once per ``build_connector_meta`` and at each
    request's end; the workers note their loads issued and done.

Request states (``hkvd.shim.request_state``)
    Each request's record moves through named states (waiting for lookup, looked up, loading,
    loaded, running, failed, storing, finished) on the events of vLLM's hooks and the daemon's
    replies, by one table. A load is reported finished to vLLM by one path (``LoadReports``), from
    the worker's report or the lease watch, whichever comes first. An event the table does not
    allow is a bug: it raises with ``HKVD_STRICT_STATES=1`` (tests), and otherwise is logged once
    and the request is recomputed (a load vLLM already waits for is sent empty, so it fails).

Failure handling
    Daemon down: every lookup is a miss (recompute) and the link retries in the background of
    later calls; see ``DaemonLink``. A failed load is reported by the worker and vLLM
    recomputes (``kv_load_failure_policy='recompute'``, set at startup).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hkvd.shim import decode_stores, hints, pd, sessions, tenants
from hkvd.shim.client import DaemonClient
from hkvd.shim.identity import prompt_tokens
from hkvd.shim.kv_event_feed import EventFeed
from hkvd.shim.kv_event_notes import NoteMaker
from hkvd.shim.link import DaemonLink
from hkvd.shim.load_planner import LoadPlanner
from hkvd.shim.lookups import Lookups
from hkvd.shim.metadata import HkvdConnectorMetadata
from hkvd.shim.request_state import Event, RequestRecord
from hkvd.shim.scheduler_context import SchedulerContext
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.spec import build_engine_spec, group_infos, validate_vllm
from hkvd.shim.store_planner import StorePlanner
from hkvd.transport import tier_matchers
from hkvd.transport.layout import entry_bytes
from hkvd.transport.wire.control import KV_EVENTS_ACCEPTED, EngineSpec

if TYPE_CHECKING:  # vLLM's types, for annotations only
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hkvd.shim")


class SchedulerSide:
    """vLLM's scheduler hooks: each routed to ``Lookups``, ``LoadPlanner`` or ``StorePlanner``, the daemon's
    replies routed to the part that waits for them (``_pump``), and the records' events fired here."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ShimConfig) -> None:
        validate_vllm(vllm_config, kv_cache_config, cfg)
        self.cfg = cfg
        block_size = int(vllm_config.cache_config.block_size)
        self.link = DaemonLink(
            cfg, "scheduler", "vllm-scheduler",
            lambda: build_engine_spec(vllm_config, kv_cache_config, cfg, regions=[], layer_addr=None),
        )
        hash_unit = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
        self.ctx = SchedulerContext(cfg, self.link, group_infos(kv_cache_config), block_size, hash_unit,
                                    getattr(vllm_config, "model_config", None),
                                    _chunk_bytes(lambda: build_engine_spec(vllm_config, kv_cache_config, cfg,
                                                                           regions=[], layer_addr=None)))
        self.kv_role = str(getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both")
        self._producer = pd.ProducerSide(self.link, self.kv_role, cfg.peer_address, self._client)
        # KV events: this engine publishes (vLLM's kv_events_config), so the connector's path is on.
        events_cfg = getattr(vllm_config, "kv_events_config", None)
        self.engine_events = bool(events_cfg is not None and getattr(events_cfg, "enable_kv_cache_events", False))
        self.lookups = Lookups(self.ctx, self._connect)
        self.loads = LoadPlanner(self.ctx)
        notes = NoteMaker(block_size, getattr(kv_cache_config, "hash_block_size", None))
        speculative = getattr(vllm_config, "speculative_config", None) is not None
        self.stores = StorePlanner(self.ctx, notes, self.engine_events, speculative)
        self._step = 0
        self._tiers_said = False  # a daemon older than the connector takes no request tiers: said once
        # The timeline (hkvd.shim.timeline): events carry the number of the step being scheduled (the next
        # build_connector_meta call); first_schedule and first_forward are noted once per request.
        self.timeline = self.ctx.timeline
        self.timeline.step = 1
        self.feed = EventFeed()
        self._connect(startup=True)

    # The context's settings and counters, where the connector and the tests read them.
    @property
    def stats(self) -> dict[str, int]:
        return self.ctx.stats

    @property
    def chunk_size(self) -> int:
        return self.ctx.chunk_size

    @property
    def strict(self) -> bool:
        return self.ctx.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.ctx.strict = value

    # ---- link ----------------------------------------------------------------------------------
    def _connect(self, startup: bool = False) -> DaemonClient | None:
        gen = self.link.generation
        client = self.link.ensure(startup=startup)
        ack = self.link.ack
        if client is None or ack is None or self.link.generation == gen:
            return client
        chunk, N = int(ack.chunk_size), self.ctx.block_size
        if chunk % N:
            self.link.close()
            if not startup:  # a daemon restarted with another chunk size: stay down, recompute
                logger.error("hkvd: the daemon's chunk size %d is not a multiple of vLLM's block size %d; "
                             "external caching is off until it is restarted with --chunk-size %d", chunk, N, N)
                return None
            raise ValueError(
                f"hkvd: the daemon's chunk size {chunk} is not a multiple of vLLM's block size "
                f"N={N}; restart `hkvd serve --chunk-size {N}` (or a multiple "
                f"of {N}), or set kv_connector_extra_config chunk_size")
        if self.ctx.chunk_size and chunk != self.ctx.chunk_size:
            logger.warning("hkvd: chunk size changed from %d to %d after reconnecting", self.ctx.chunk_size, chunk)
            for st in self.ctx.reqs.values():
                st.keys = []
        self.ctx.chunk_size = chunk
        self.lookups.forget()  # lookups and watches of the old connection never complete
        self.loads.forget()
        return client

    def _client(self) -> DaemonClient | None:
        return self._connect() if not self.link.up else self.link.client

    def _pump(self, timeout_s: float = 0.0) -> None:
        """Read completions: lookups and probes, lease watches and KV event polls, each to its part."""
        client = self.link.client
        if client is None:
            return
        try:
            done = client.poll(timeout_s)
        except Exception as e:  # transport trouble: down, recompute
            self.link.lost(e)
            return
        for c in done:
            if not (self.feed.on_completion(c) or self.loads.on_completion(c) or self.lookups.on_completion(c)):
                logger.debug("hkvd: a reply to no request of the scheduler side: %s", c.req_id)
        if not client.connected:
            self.link.lost(ConnectionError("connection lost"))
            self.feed.lost_connection()

    # ---- vLLM hooks ----------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self.timeline.on:
            self.timeline.note(request.request_id, "arrival")
        tokens = prompt_tokens(request)
        st = RequestRecord(request.request_id, tokens, len(tokens), request=request, tenant=tenants.tenant(request))
        st.pin, problem = sessions.parse(getattr(request, "kv_transfer_params", None))
        if problem:
            self.ctx.stats["pins_refused"] += 1
            logger.warning("%s (request %s)", problem, request.request_id)
        asked, problem = decode_stores.parse(getattr(request, "kv_transfer_params", None))
        if problem:
            logger.warning("%s (request %s)", problem, request.request_id)
        st.store_decode, st.decode_off = self.ctx.decode.for_request(asked)
        # KV hints (docs/hints.md), the pin above counted among them; sent when the request finishes.
        params = getattr(request, "kv_transfer_params", None)
        st.hints, problem = hints.parse(params, hints.pin_outcome(st.pin is not None, params))
        if problem:
            logger.warning("%s (request %s)", problem, request.request_id)
        # Load and store tiers (vLLM's kv_load_tiers / kv_store_tiers, docs/hints.md): a bad one is every tier.
        st.skip_load, load_problem = tier_matchers.parse(params, tier_matchers.LOAD_KEY)
        st.skip_store, store_problem = tier_matchers.parse(params, tier_matchers.STORE_KEY)
        if load_problem or store_problem:
            self.ctx.stats["tiers_refused"] += 1
            for problem in filter(None, (load_problem, store_problem)):
                logger.warning("%s (request %s)", problem, request.request_id)
        ack = self.link.ack
        if (st.skip_load or st.skip_store) and ack is not None and not ack.request_tiers and not self._tiers_said:
            self._tiers_said = True
            logger.warning("hkvd: the daemon is older than the connector and takes no load or store tiers "
                           "(kv_load_tiers, kv_store_tiers): requests use every tier; upgrade hkvd serve")
        self.ctx.reqs[request.request_id] = st
        if tokens:
            self.lookups.submit(st)
        if st.pin is not None and self.ctx.chunk_size:
            # Its prompt's chunks are pinned from the start: each is stored in the step that completes it, and
            # until the request finishes (its decode may take seconds) other traffic could evict them.
            self.stores.send_pin(st, st.pin, len(tokens) // self.ctx.chunk_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.timeline.on:
            self.timeline.note_first(request.request_id, "first_schedule")
        st = self.ctx.reqs.get(request.request_id)
        if st is None:  # a request vLLM never announced (resumed after a reset): look it up now
            self.on_new_request(request)
            st = self.ctx.reqs[request.request_id]
        if st.load_failed:  # vLLM recomputes it; a second load could fail the same way
            return 0, False
        # Asked again after its load was planned: the request was preempted and its blocks freed. The
        # lease is spent (a retrieve releases it), so look the prefix up afresh.
        if st.lease_used and not self.ctx.fire(st, Event.ASKED_AGAIN):
            return 0, False
        if not st.pd_checked:
            st.pd_checked = True
            self.lookups.plan_pull(request, st, self.kv_role)
        if not self.lookups.await_answer(st, self._pump):
            return None, False
        return self.loads.matched(request, st, num_computed_tokens)  # see "Contracts" above

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.ctx.reqs.get(request.request_id)
        if st is not None:
            self.loads.allocated(request, st, blocks, num_external_tokens)

    def lookup_wait_budget(self) -> float:
        """Seconds one scheduling may wait for lookup replies in all (``Lookups.budget``)."""
        return self.lookups.budget()

    def build_connector_meta(self, so: SchedulerOutput) -> HkvdConnectorMetadata:
        self._step += 1
        self.lookups.on_step(so.total_num_scheduled_tokens)
        self._pump()
        stores, verifies, delayed = self.stores.take()
        meta = HkvdConnectorMetadata(step=self._step, loads=self.loads.take_jobs(), delayed_free=delayed,
                                     stores=stores, verifies=verifies)
        self.stores.plan_step(so, meta)
        if self.timeline.on:
            self._step_timeline(so)
        return meta

    def _step_timeline(self, so: SchedulerOutput) -> None:
        """Note the requests this step computes tokens of for the first time, write the step's events, and
        move the timeline on to the next step."""
        tl = self.timeline
        scheduled = so.num_scheduled_tokens  # request id -> tokens computed this step (none: not scheduled)
        for req_id, n in scheduled.items():
            if n:
                tl.note_first(req_id, "first_forward")
        tl.flush()
        tl.step = self._step + 1

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        recving = self.loads.from_workers(output)  # vLLM must not hear a load a watch reported
        self.loads.in_step_ran()
        self._pump()
        self.loads.report_early(recving)
        if self.timeline.on:
            for req_id in recving:
                self.timeline.note(req_id, "load_reported")
        if recving or getattr(output, "finished_recving", None) is not None:
            output.finished_recving = recving

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self.timeline.on:
            self.timeline.note(request.request_id, "finished")
            self.timeline.forget(request.request_id)
            self.timeline.flush()
        st = self.ctx.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self.lookups.finished(st)
        self.stores.finished(request, st, block_ids)
        if st.lease_id and not st.lease_used:
            self.ctx.release(st.lease_id)
        params = None
        if pd.wants_params(self.kv_role, getattr(request, "kv_transfer_params", None)):
            keys, C = self.ctx.keys.prompt(st), self.ctx.chunk_size
            params = self._producer.params(keys, min(len(keys), (st.num_tokens - 1) // C) if C else 0, C)
        if st.loading:
            # Aborted while its load runs (vLLM schedules nothing else of a request that waits for
            # remote KV): vLLM frees its blocks when the worker reports the load, after the daemon's
            # reply. Never also in delayed_free: a second report would free them twice.
            self.ctx.fire(st, Event.FINISHED)
            return True, params
        if st.had_copies:
            self.ctx.fire(st, Event.FINISHED_STORING)
            self.stores.delayed.append(request.request_id)
            return True, params
        self.ctx.fire(st, Event.FINISHED)
        return False, params

    def take_events(self) -> list[KVCacheEvent]:
        """The daemon's KV events for this engine's layout that arrived since the last call (see
        hkvd.shim.kv_event_feed); polls again. Nothing unless the engine publishes KV events."""
        if not self.engine_events:
            return []
        self._pump()
        client = self.link.client
        if client is not None and self.stores.kv_events_mode() >= KV_EVENTS_ACCEPTED:
            try:
                self.feed.maybe_poll(client)
            except Exception as e:
                self.link.lost(e)
                self.feed.lost_connection()
        return self.feed.take()

    def shutdown(self) -> None:
        self.link.close()
        self.timeline.close()


def _chunk_bytes(spec: Callable[[], EngineSpec]) -> Callable[[int], int]:
    """Bytes of one chunk's entries at a chunk size, every group and rank, from the engine's spec (built once,
    when first asked)."""
    memo: dict[int, int] = {}
    built: list[EngineSpec] = []

    def of(chunk_size: int) -> int:
        if chunk_size not in memo:
            try:
                if not built:
                    built.append(spec())
                s = built[0]
                memo[chunk_size] = sum(entry_bytes(g, chunk_size) for g in s.groups) * int(s.world_size)
            except Exception as e:  # only counters depend on it
                logger.debug("hkvd: no chunk size in bytes at %d tokens: %s", chunk_size, e)
                memo[chunk_size] = 0
        return memo[chunk_size]

    return of
