# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of the connector: lookups, load plans, store and offer descriptors.

Role
    Runs in vLLM's EngineCore scheduler thread. It asks the daemon how many chunks of a
    request's prompt are cached (the daemon applies the hybrid hit rule across groups),
    turns vLLM's block tables into load items (``update_state_after_alloc``) and, once per
    step, into store items for attention chunks that become complete and offer items for
    Mamba boundary states (``build_connector_meta``). It never copies: the worker does.

Threading model
    vLLM calls every method from one thread. The daemon link is polled from the hooks
    themselves (no background thread); a lookup is submitted when the request arrives
    (``on_new_request``) and normally answered before the scheduler first asks.

Contracts (vLLM 0.32 ``KVConnectorBase_V1``; see shared/reference/vllm-connector.md)
    - ``get_num_new_matched_tokens`` is repeatable: it returns ``None`` while the lookup is in
      flight (at most ``lookup_timeout_s``, then a miss), afterwards the same answer. Hits are
      whole chunks (chunk_size is a multiple of vLLM's block size N, so block-aligned) and
      never reach the last prompt token (vLLM must compute at least one token). Loads are
      reported as asynchronous (``True``): the request waits in WAITING_FOR_REMOTE_KVS while
      the daemon loads its blocks and the other requests keep stepping (the worker's
      ``start_load_kv`` only submits), and the worker reports it finished (or failed) in
      ``get_transfer_results`` of a later step, once the daemon has replied. With
      ``early_load_reports`` this side watches the load's lease and reports a host-memory load
      itself once the daemon says every rank's retrieve wrote its blocks, a step sooner under
      async scheduling (``_report_early``); the workers' later report of it is taken out.
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
import os
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hkvd.shim import partial, pd, plans, sessions, tenants, verify
from hkvd.shim.client import DaemonClient
from hkvd.shim.identity import ChunkIdentity, Uncacheable, prompt_tokens
from hkvd.shim.jobs import LoadJob, StoreJob, VerifyJob
from hkvd.shim.kv_event_feed import EventFeed
from hkvd.shim.kv_event_notes import NoteMaker
from hkvd.shim.link import DaemonLink
from hkvd.shim.metadata import HkvdConnectorMetadata
from hkvd.shim.request_state import Event, InvalidTransition, LoadReports, RequestRecord
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.spec import GroupInfo, build_engine_spec, group_infos, validate_vllm
from hkvd.transport.errors import DaemonUnavailable, ProtocolViolation
from hkvd.transport.keys import ROOT_KEY, chunk_keys
from hkvd.transport.turn_ends import TurnEnds
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.control import KV_EVENTS_ACCEPTED, KV_EVENTS_PUBLISHED
from hkvd.transport.wire.kv import MAX_PIN_PARTIALS, MAX_TAILS, Item, LookupReply
from hkvd.transport.wire.message import MAX_KEYS

if TYPE_CHECKING:  # vLLM's types, for annotations only
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hkvd.shim")

# Set to 1 (tests): a request state transition the table lacks raises instead of recomputing the request.
STRICT_ENV = "HKVD_STRICT_STATES"
STEP_HISTORY = 4  # scheduling intervals the lookup wait looks back on (lookup_wait_budget)


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ShimConfig) -> None:
        validate_vllm(vllm_config, kv_cache_config, cfg)
        self.cfg = cfg
        self.groups: list[GroupInfo] = group_infos(kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.link = DaemonLink(
            cfg, "scheduler", "vllm-scheduler",
            lambda: build_engine_spec(vllm_config, kv_cache_config, cfg, regions=[], layer_addr=None),
        )
        self.chunk_size = cfg.chunk_size
        self.kv_role = str(getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both")
        self._producer = pd.ProducerSide(self.link, self.kv_role, cfg.peer_address, self._client)
        # Every request vLLM announced and has not finished, each in its state (hkvd.shim.request_state).
        self._reqs: dict[str, RequestRecord] = {}
        self._by_lookup: dict[int, str] = {}  # the lookups in flight: client request id -> request
        # The lease watches in flight (early_load_reports): watch id -> (request, lease).
        self._watches: dict[int, tuple[str, int]] = {}
        self._reports = LoadReports()  # the one source of "load finished" (workers' reports, lease watches)
        # An invalid transition raises instead of failing the request safely (hkvd.shim.request_state): for tests.
        self.strict = os.environ.get(STRICT_ENV) == "1"
        self._invalid_logged = False
        self._loads: list[LoadJob] = []
        self._delayed: list[str] = []
        self._finish_stores: list[StoreJob] = []  # chunks keyed only when their request finished
        self._said_no_verify = False  # warned that the daemon compares no sampled hits
        self._said_no_pins = False  # warned that the daemon takes no session pins
        self._finish_verifies: list[VerifyJob] = []  # the same, of sampled hits (hkvd.shim.verify)
        self._step = 0
        # The engine's pace: the last four intervals from a scheduling with tokens to the next scheduling, and
        # what is left of this scheduling's lookup wait (lookup_wait_budget).
        self._step_intervals: deque[float] = deque(maxlen=STEP_HISTORY)
        self._meta_at: float | None = None
        self._wait_left_s = cfg.lookup_wait_s
        self._identity = ChunkIdentity()
        # lookups_deferred: passes over a waiting request whose lookup's reply had not come yet.
        # loads_reported_early: loads this side reported finished before any worker did (lease watches).
        self.stats = {"lookups": 0, "lookups_deferred": 0, "hit_tokens": 0, "load_jobs": 0, "store_items": 0,
                      "offer_items": 0, "uncacheable": 0, "notes": 0, "loads_reported_early": 0,
                      "lookups_for_turn_ends": 0,
                      "verify_sampled": 0, "verify_items": 0, "pins_sent": 0, "pins_refused": 0}
        # KV events: this engine publishes (vLLM's kv_events_config), so the connector's path is on.
        events_cfg = getattr(vllm_config, "kv_events_config", None)
        self.engine_events = bool(events_cfg is not None and getattr(events_cfg, "enable_kv_cache_events", False))
        self._notes = NoteMaker(self.block_size, getattr(kv_cache_config, "hash_block_size", None))
        # Partial chunks (hkvd.shim.partial): probes in flight, and each request's partial hit (tokens, key).
        self._hash_unit = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
        self._probes = partial.Probes()
        self._lookup_tails: dict[int, list[tuple[int, bytes]]] = {}  # lookup id -> (position, key) of its tails
        self._partial: dict[str, tuple[int, bytes]] = {}
        # request -> the partial keys whose blocks went out, in the order they did
        self._partial_stored: dict[str, dict[bytes, None]] = {}
        self._turn_ends = TurnEnds()  # where finished requests' stored states lie (turn_end_states)
        self.feed = EventFeed()
        self._connect(startup=True)

    # ---- link ----------------------------------------------------------------------------------
    def _connect(self, startup: bool = False) -> DaemonClient | None:
        gen = self.link.generation
        client = self.link.ensure(startup=startup)
        ack = self.link.ack
        if client is not None and ack is not None and self.link.generation != gen:
            chunk = int(ack.chunk_size)
            if chunk % self.block_size:
                self.link.close()
                if not startup:  # a daemon restarted with another chunk size: stay down, recompute
                    logger.error("hkvd: the daemon's chunk size %d is not a multiple of vLLM's block size %d; "
                                 "external caching is off until it is restarted with --chunk-size %d",
                                 chunk, self.block_size, self.block_size)
                    return None
                raise ValueError(
                    f"hkvd: the daemon's chunk size {chunk} is not a multiple of vLLM's block size "
                    f"N={self.block_size}; restart `hkvd serve --chunk-size {self.block_size}` (or a multiple "
                    f"of {self.block_size}), or set kv_connector_extra_config chunk_size")
            if self.chunk_size and chunk != self.chunk_size:
                logger.warning("hkvd: chunk size changed from %d to %d after reconnecting", self.chunk_size, chunk)
                for st in self._reqs.values():
                    st.keys = []
            self.chunk_size = chunk
            self._by_lookup.clear()  # lookups and watches of the old connection never complete
            self._lookup_tails.clear()
            self._probes.clear()
            self._watches.clear()
            for st in self._reqs.values():
                if not st.answered:
                    st.lookup_id = None
        return client

    def _client(self) -> DaemonClient | None:
        return self._connect() if not self.link.up else self.link.client

    def _keys(self, st: RequestRecord) -> list[bytes]:
        """The prompt's chunk keys, extra keys mixed in; [] for a request that cannot be keyed (never cached)."""
        if not st.keys and self.chunk_size and not st.uncacheable:

            n = len(st.tokens) // self.chunk_size
            try:
                extras = self._identity.extras(st.request, self.chunk_size, n) if st.request is not None else None
            except Uncacheable as e:
                self._note_uncacheable(st, e)
                return []
            st.keys = chunk_keys(st.tokens, self.chunk_size, extras=extras)
        return st.keys

    def _keys_through(self, st: RequestRecord, n: int) -> list[bytes]:
        """The chunk keys, extended past the prompt up to ``n`` chunks over the tokens vLLM knows.

        Only with ``store_decode``; the extension continues the prompt's rolling keys, so the next
        turn's prompt, which repeats these tokens, computes the same keys.
        """
        keys = self._keys(st)
        C = self.chunk_size
        if len(keys) >= n or not C or not self.cfg.store_decode or st.request is None or st.uncacheable:
            return keys
        tokens = st.request.all_token_ids  # prompt + output tokens sampled so far (no placeholders)
        n = min(n, len(tokens) // C)
        first = len(keys)
        if n <= first:
            return keys
        try:
            extras = self._identity.extras(st.request, C, n, first)
        except Uncacheable as e:
            self._note_uncacheable(st, e)
            return keys
        keys.extend(chunk_keys(list(tokens[first * C:n * C]), C, parent=keys[-1] if keys else ROOT_KEY,
                               extras=extras))
        return keys

    def _known_tokens(self, st: RequestRecord) -> int:
        """Tokens a stored chunk may end at: the prompt's, and with store_decode the output tokens known."""
        if self.cfg.store_decode and st.request is not None:
            return max(st.num_tokens, int(st.request.num_tokens))
        return st.num_tokens

    def _note_uncacheable(self, st: RequestRecord, exc: Uncacheable) -> None:
        st.uncacheable = exc.reason
        self.stats["uncacheable"] += 1
        self._identity.note(str(getattr(st.request, "request_id", "?")), exc)
        client = self.link.client
        if client is None:
            return
        try:
            client.uncacheable(exc.reason)
        except Exception as e:
            self.link.lost(e)

    def _pump(self, timeout_s: float = 0.0) -> None:
        """Read completions: lookups, lease watches (``_report_early``) and KV event polls."""
        client = self.link.client
        if client is None:
            return
        try:
            done = client.poll(timeout_s)
        except Exception as e:  # transport trouble: down, recompute
            self.link.lost(e)
            return
        for c in done:
            if self.feed.on_completion(c):
                continue
            watched = self._watches.pop(c.req_id, None)
            if watched is not None:
                st = self._reqs.get(watched[0])
                if c.ok and st is not None and st.loading and st.lease_id == watched[1]:
                    self._reports.watched(watched[0])
                continue
            if c.req_id in self._probes:
                self._probe_done(c.req_id, c.get(LookupReply) if c.ok else None)
                continue
            req_id = self._by_lookup.pop(c.req_id, None)
            tails = self._lookup_tails.pop(c.req_id, [])
            st = self._reqs.get(req_id) if req_id is not None else None
            if st is None:
                if c.ok and c.get(LookupReply).lease_id:
                    self._release(c.get(LookupReply).lease_id)
                continue
            if c.ok:
                self._looked_up(st, c.get(LookupReply), tails)
            else:
                self._answer(st, 0)
                if isinstance(c.error, DaemonUnavailable):
                    self.link.lost(c.error)
                else:
                    logger.debug("hkvd: lookup for %s failed: %s", req_id, c.error)
        if not client.connected:
            self.link.lost(ConnectionError("connection lost"))
            self.feed.lost_connection()

    def _looked_up(self, st: RequestRecord, found: LookupReply, tails: list[tuple[int, bytes]]) -> None:
        """The whole-chunk lookup's answer, extended by one of its ``tails`` where the daemon says so; the
        request is answered now, or once the probes of positions no tail tried reply (``_probe``)."""
        self._partial.pop(st.req_id, None)  # a lookup afresh (preempted): its partial hit is decided anew
        C = self.chunk_size
        if found.tail and (found.tail > len(tails) or found.hit_chunks != tails[found.tail - 1][0] // C + 1):
            # A daemon bug: the hit's last chunk is not the tail named, so serve none of it.
            logger.error("hkvd: the daemon's lookup reply names tail %d of %d sent for a hit of %d chunks; "
                         "recomputing %s", found.tail, len(tails), found.hit_chunks, st.req_id)
            self._release(found.lease_id)
            self._answer(st, 0)
            return
        if found.ends and not found.tail and not st.ends_retried and self._learn_ends(st, found.ends, tails):
            # Turn ends the daemon knows and the tails missed (another engine's): once more, with them as tails.
            st.ends_retried = True
            self._release(found.lease_id)
            self.stats["lookups_for_turn_ends"] += 1
            self._submit_lookup(st.req_id, st)
            return
        st.hit_chunks, st.lease_id = found.hit_chunks, found.lease_id
        if found.tail:
            self._partial[st.req_id] = tails[found.tail - 1]
        elif self._probe(st.req_id, st, tried={pos for pos, _ in tails}):
            return
        self._fire(st, Event.ANSWERED)

    def _learn_ends(self, st: RequestRecord, ends: list[list[int]], tails: list[tuple[int, bytes]]) -> bool:
        """Remember the turn ends a lookup's reply named (``LookupReply.ends``); whether any of them is a
        position of this prompt the lookup's tails did not try."""
        keys, C = self._keys(st), self.chunk_size
        tried = {pos for pos, _ in tails}
        new = False
        for j, off in ends:
            pos = j * C + off
            if j > len(keys) or pos >= st.num_tokens or off >= C:
                continue
            self._turn_ends.add(partial.before(keys, j), off)
            new = new or pos not in tried
        return new

    def _release(self, lease_id: int) -> None:
        if not lease_id or self.link.client is None:
            return
        try:
            self.link.client.release(lease_id)
        except Exception as e:
            self.link.lost(e)

    def _submit_lookup(self, req_id: str, st: RequestRecord) -> None:
        client = self._client()
        if client is None:
            self._answer(st, 0)
            return
        keys = self._keys(st)
        # Leave at least the last prompt token to compute: vLLM needs logits for it.
        n = min(len(keys), (st.num_tokens - 1) // self.chunk_size)
        if n <= 0:
            self._answer(st, 0)
            return

        def submit(client: DaemonClient) -> tuple[int, list[tuple[int, bytes]]]:
            tails = self._tails(st, keys, n)  # per connection: a daemon may not take them
            sent = [(pos // self.chunk_size, key) for pos, key in tails]
            ack = self.link.ack
            ends = bool(ack is not None and ack.turn_ends and self.cfg.turn_end_states and not st.ends_retried
                        and self._tails_apply(st))
            return client.submit_lookup(keys[:n], lease=True, tails=sent, ends=ends), tails

        try:
            rid, tails = submit(client)
        except Exception as e:
            # The connection died since the last call (daemon restarted?): reconnect once now.
            self.link.lost(e)
            client = self._connect()
            try:
                if client is None:
                    raise ConnectionError("daemon unavailable")
                rid, tails = submit(client)
            except Exception as e2:
                self.link.lost(e2)
                self._answer(st, 0)
                return
        st.lookup_id, st.lookup_sent_at, st.lookup_gen = rid, time.monotonic(), self.link.generation
        self._by_lookup[rid] = req_id
        if tails:
            self._lookup_tails[rid] = tails
        self.stats["lookups"] += 1

    # ---- vLLM hooks ----------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        tokens = prompt_tokens(request)
        st = RequestRecord(request.request_id, tokens, len(tokens), request=request, tenant=tenants.tenant(request))
        st.pin, problem = sessions.parse(getattr(request, "kv_transfer_params", None))
        if problem:
            self.stats["pins_refused"] += 1
            logger.warning("%s (request %s)", problem, request.request_id)
        self._reqs[request.request_id] = st
        if tokens:
            self._submit_lookup(request.request_id, st)
        if st.pin is not None and self.chunk_size:
            # Its prompt's chunks are pinned from the start: each is stored in the step that completes it, and
            # until the request finishes (its decode may take seconds) other traffic could evict them.
            self._send_pin(st, st.pin, len(tokens) // self.chunk_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:  # a request vLLM never announced (resumed after a reset): look it up now
            self.on_new_request(request)
            st = self._reqs[request.request_id]
        if st.load_failed:  # vLLM recomputes it; a second load could fail the same way
            return 0, False
        # Asked again after its load was planned: the request was preempted and its blocks freed. The
        # lease is spent (a retrieve releases it), so look the prefix up afresh.
        if st.lease_used and not self._fire(st, Event.ASKED_AGAIN):
            return 0, False
        if not st.pd_checked:
            st.pd_checked = True
            self._plan_pull(request, st)
        if not st.answered:
            if st.lookup_id is None or st.lookup_gen != self.link.generation:
                self._submit_lookup(request.request_id, st)
            began = time.monotonic()
            deadline = began + max(self.cfg.lookup_wait_s, self._wait_left_s)
            while not st.answered and self.link.client is not None:
                # Other replies (other requests' lookups, lease watches) may come first: wait on for this one.
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._pump(left)
            self._wait_left_s = max(0.0, self._wait_left_s - (time.monotonic() - began))
            if not st.answered:
                if time.monotonic() - st.lookup_sent_at < self.cfg.lookup_timeout_s:
                    self.stats["lookups_deferred"] += 1
                    return None, False
                logger.warning("hkvd: lookup for %s unanswered after %.1f s; recomputing", request.request_id,
                               self.cfg.lookup_timeout_s)
                self._by_lookup.pop(st.lookup_id or 0, None)
                self._lookup_tails.pop(st.lookup_id or 0, None)
                self._answer(st, 0)
        hit_tokens = self._hit_tokens(st)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        if (st.pull is None and verify.sampled(request.request_id, self.cfg.verify_fraction, self.cfg.verify_seed)
                and self._daemon_verifies()):
            # Sampled: the engine computes it (its answer never depends on the entries under test) and the
            # chunks it computes are compared, not stored; its lease is released once it is allocated. A
            # partial last chunk cannot be compared (the computing request holds no state where it ends): it
            # is dropped from the hit, and the whole chunks before it are compared.
            if self._partial.pop(st.req_id, None) is not None:
                st.hit_chunks -= 1
            st.verify_upto = st.hit_chunks
            st.verify_from = -(-num_computed_tokens // self.chunk_size)  # chunks vLLM's own cache holds whole
            return 0, False
        st.verify_from = st.verify_upto = 0
        return hit_tokens - num_computed_tokens, True  # async: see "Contracts" above

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        held = st.hit_chunks - (st.req_id in self._partial)  # a partial last chunk is not the whole chunk
        if st.hit_chunks:
            # The daemon holds chunks [0, hit) for every group the hit rule needs: never store them again.
            # A sampled hit's chunks from verify_from on are computed here and compared instead.
            st.next_store_chunk = max(st.next_store_chunk, st.verify_from if st.verify_upto else held)
            if st.verify_upto:
                self.stats["verify_sampled"] += 1
        if num_external_tokens <= 0 or not st.hit_chunks:
            if st.lease_id and not st.lease_used:
                self._release(st.lease_id)
                st.lease_used = True
            st.pull = None  # nothing external to load (vLLM's own cache covered it)
            self._fire(st, Event.ALLOCATED)
            return
        n = st.hit_chunks
        keys = self._keys(st)
        if st.req_id in self._partial:  # chunk n - 1 is partial: its own key, loaded into block n - 1 all the same
            keys = [*keys[:n - 1], self._partial[st.req_id][1]]
        items, bad = plans.load_items(self.groups, keys, n, self._hit_tokens(st) - num_external_tokens,
                                      blocks.get_block_ids(), self.chunk_size)
        all_blocks = sorted({b for it in items for b in it.block_ids if b})
        if bad:
            logger.warning("hkvd: load plan for %s names vLLM's null block (window starts mid-chunk?); "
                           "recomputing it", request.request_id)
            items = []
        if not self._fire(st, Event.LOAD_PLANNED):
            items, st.pull = [], None  # the worker refuses it, reports the load failed: vLLM recomputes
        self._loads.append(LoadJob(request.request_id, st.lease_id, items, all_blocks, pull=st.pull))
        if items and st.pull is None and st.lease_id:
            self._watch(request.request_id, st.lease_id)
        if st.pull is not None:
            st.pull = None
            self.stats["pull_jobs"] = self.stats.get("pull_jobs", 0) + 1
        st.lease_used = True
        st.next_store_chunk = max(st.next_store_chunk, held)
        self.stats["load_jobs"] += 1
        self.stats["hit_tokens"] += num_external_tokens

    def lookup_wait_budget(self) -> float:
        """Seconds one scheduling may wait for lookup replies in all: ``lookup_wait_fraction`` of the longest of
        the engine's last four steps, at least ``lookup_wait_s`` and at most ``lookup_wait_max_s`` (see
        ``ShimConfig``). A deferred request waits for the next step, whose length is not known yet: the longest
        recent one stands for it (a long prefill among short decodes). An idle engine's gap before a request
        counts as a long step: waiting then holds no running request."""
        cfg = self.cfg
        step_s = max(self._step_intervals, default=0.0)
        return max(cfg.lookup_wait_s, min(cfg.lookup_wait_max_s, cfg.lookup_wait_fraction * step_s))

    def build_connector_meta(self, so: SchedulerOutput) -> HkvdConnectorMetadata:
        self._step += 1
        now = time.monotonic()
        if self._meta_at is not None:  # a step that scheduled nothing is not the engine's pace (it loops at once)
            self._step_intervals.append(now - self._meta_at)
        self._meta_at = now if so.total_num_scheduled_tokens else None
        self._wait_left_s = self.lookup_wait_budget()
        self._pump()
        meta = HkvdConnectorMetadata(step=self._step, loads=self._loads, delayed_free=self._delayed,
                                     stores=self._finish_stores, verifies=self._finish_verifies)
        self._loads, self._delayed, self._finish_stores, self._finish_verifies = [], [], [], []
        # Blocks that may be written in this step: newly allocated ones (vLLM zeroes them and
        # the forward fills them). Copies still reading them must finish first.
        for r in so.scheduled_new_reqs:
            for ids in r.block_ids or ():
                meta.fence_blocks.update(b for b in ids if b)
        cached = so.scheduled_cached_reqs
        for new_ids in cached.new_block_ids:
            for ids in new_ids or ():
                meta.fence_blocks.update(b for b in ids if b)
        block_state = so.kv_connector_block_state
        if not self.chunk_size or block_state is None:
            return meta
        C = self.chunk_size
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        attn = [g for g in self.groups if g.kind != "mamba"]
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or not attn:
                continue
            # KV computed once this step's forward ran, and every token of the chunk known (see Contracts).
            done_after = min(computed.get(req_id, 0) + n_sched, self._known_tokens(st))
            last = done_after // C
            if last <= st.next_store_chunk:
                continue
            table = block_state.get_block_ids(req_id)
            if table is None:
                continue
            items = plans.store_items(self.groups, self._keys_through(st, last), table, st.next_store_chunk, last, C)
            st.next_store_chunk = last
            self._plan_copies(st, items, meta.stores, meta.verifies)
        for req_id, offers in (block_state.boundary_state_offloads or {}).items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for group_id, block_id, boundary in offers:
                if block_id and boundary > 0 and boundary % C and self._partial_on():
                    self._partial_offer(st, int(group_id), int(block_id), boundary, block_state, meta)
                    continue
                if not block_id or boundary % C or boundary <= 0:
                    continue
                ci = boundary // C - 1
                keys = self._keys_through(st, ci + 1)
                if ci >= len(keys):
                    continue  # no key: past the prompt with store_decode off, or tokens not known
                offer = Item(int(group_id), ci, keys[ci], [int(block_id)], plans.parent(keys, ci))
                st.had_copies = True
                if ci < st.verify_upto:  # a sampled hit's recomputed state: compare it, never store it
                    meta.boundary_verifies.append((req_id, offer))
                    self.stats["verify_items"] += 1
                    continue
                self._add_offer(meta, st, offer)
                meta.offer_notes.extend(self._notes_for(st, [offer], skip={n.key for n in meta.offer_notes}))
        return meta

    def _add_offer(self, meta: HkvdConnectorMetadata, st: RequestRecord, item: Item) -> None:
        """One state offered this step (a StepEvent offer), under its request's tenant."""
        meta.offers.append((st.req_id, item))
        if st.tenant:
            meta.offer_tenants[st.req_id] = st.tenant
        self.stats["offer_items"] += 1

    def _daemon_verifies(self) -> bool:
        """Whether the daemon compares sampled hits (``RegisterAck.verify``); an older one does not, and is told
        nothing it cannot parse: verification is off against it, said once."""
        ack = self.link.ack
        if ack is not None and ack.verify:
            return True
        if not self._said_no_verify:
            self._said_no_verify = True
            logger.warning("hkvd: the daemon does not compare sampled hits (an older hkvd); verify_fraction %s "
                           "has no effect until hkvd serve on this node is upgraded", self.cfg.verify_fraction)
        return False

    # ---- partial chunks (hkvd.shim.partial) ------------------------------------------------------
    def _partial_on(self) -> bool:
        return partial.enabled(self.groups, self.block_size, self.chunk_size)

    def _hit_tokens(self, st: RequestRecord) -> int:
        got = self._partial.get(st.req_id)
        return got[0] if got is not None else st.hit_chunks * self.chunk_size

    def _has_extras(self, request: Request) -> bool:
        """Whether vLLM may key the request's blocks by extra keys (LoRA, multimodal, salt, embeddings): partial
        keys carry none, so such a request gets no partial chunks."""
        try:
            return self._identity.extras(request, self.chunk_size, 0) is not None
        except Uncacheable:
            return True

    def _positions(self, st: RequestRecord, keys: list[bytes], j: int, checkpoints: bool) -> list[int]:
        """Where inside chunk ``j`` a partial chunk of this prompt may be stored, longest first: the positions
        turns ended at after chunk j - 1, and with ``checkpoints`` the h multiples vLLM checkpoints."""
        C = self.chunk_size
        positions = (partial.candidates(j, st.num_tokens, C, self._hash_unit)
                     if checkpoints and partial.checkpoints(self.block_size, self._hash_unit) else [])
        if self.cfg.turn_end_states:
            ends = self._turn_ends.positions(partial.before(keys, j), j * C, st.num_tokens)
            positions = partial.merge(positions, ends)
        return positions

    def _tails(self, st: RequestRecord, keys: list[bytes], n: int) -> list[tuple[int, bytes]]:
        """(position, key) of the partial chunks that may end the hit of a lookup of ``n`` whole chunks
        (``Lookup.tails``, longest first): every remembered turn end inside chunks 0 .. n, and the h
        multiples inside chunk n; [] for a daemon that does not take them, or a request that gets none."""
        if not self._tails_apply(st):
            return []
        positions = [p for j in range(n + 1) for p in self._positions(st, keys, j, checkpoints=j == n)]
        tails = []
        for pos in sorted(positions, reverse=True)[:MAX_TAILS]:
            key = partial.key_at(keys, st.tokens, pos, self.chunk_size)
            if key is not None:
                tails.append((pos, key))
        return tails

    def _tails_apply(self, st: RequestRecord) -> bool:
        """Whether a lookup of this request may carry tails: the daemon takes them, and the request can be served
        partial chunks."""
        ack = self.link.ack
        return not (ack is None or not ack.lookup_tails or not self._partial_on() or st.request is None
                    or bool(st.uncacheable) or self._has_extras(st.request))

    def _probe(self, req_id: str, st: RequestRecord, tried: set[int] | frozenset[int] = frozenset()) -> bool:
        """After the whole-chunk answer: probe the positions inside the next chunk where a partial chunk may be
        stored, but those ``tried`` (the lookup's tails). True when probes went out (the request is answered
        once they all reply)."""
        if not self._partial_on() or st.request is None or st.uncacheable:
            return False
        C, keys = self.chunk_size, self._keys(st)
        if st.hit_chunks > len(keys) or self._has_extras(st.request):
            return False
        client = self.link.client
        submitted: dict[int, tuple[int, bytes]] = {}
        positions = [p for p in self._positions(st, keys, st.hit_chunks, checkpoints=True) if p not in tried]
        for pos in positions:
            key = partial.key_at(keys, st.tokens, pos, C)
            if key is None or client is None:
                continue
            try:
                submitted[client.submit_lookup([*keys[:st.hit_chunks], key], lease=True)] = (pos, key)
            except Exception as e:  # the whole-chunk answer stands; the link recovers on a later call
                self.link.lost(e)
                break
        if not submitted:
            return False
        self._probes.begin(req_id, st.hit_chunks, st.lease_id, submitted)
        return True

    def _probe_done(self, lookup_id: int, found: LookupReply | None) -> None:
        req_id, choice, release = self._probes.reply(lookup_id, found.hit_chunks if found else 0,
                                                     found.lease_id if found else 0)
        st = self._reqs.get(req_id)
        if choice is not None and (st is None or st.answered):  # finished or answered otherwise meanwhile
            release += [x for x in (choice.lease_id,) if x and (st is None or x != st.lease_id)]
            choice = None
        for lease in release:
            self._release(lease)
        if choice is None or st is None:
            return
        st.hit_chunks, st.lease_id = choice.hit_chunks, choice.lease_id
        if choice.tokens:
            self._partial[req_id] = (choice.tokens, choice.key)
        self._fire(st, Event.ANSWERED)

    def _partial_offer(self, st: RequestRecord, group_id: int, block_id: int, boundary: int,
                       block_state: KVConnectorBlockState, meta: HkvdConnectorMetadata) -> None:
        """vLLM's state at ``boundary``, inside a chunk: offered under the partial chunk's key, with the
        attention blocks of that chunk stored under the same key (once per request and boundary)."""
        C = self.chunk_size
        j = boundary // C
        if st.request is None or st.uncacheable or self._has_extras(st.request):
            return
        keys = self._keys_through(st, j)
        key = partial.key_at(keys, list(st.request.all_token_ids[:boundary]), boundary, C)
        table = block_state.get_block_ids(st.req_id)
        if key is None or table is None:
            return
        parent_key = plans.parent(keys, j)
        stored = self._partial_stored.setdefault(st.req_id, {})
        noted = any(n.key == key for n in meta.offer_notes)  # another Mamba group's offer of it, this step
        notes = self._partial_notes(st, key, boundary) if key not in stored or not noted else []
        if key not in stored:
            stored[key] = None
            items = [Item(g.group_id, j, key, [int(table[g.group_id][j])], parent_key)
                     for g in self.groups if g.kind == "full" and len(table[g.group_id]) > j
                     and table[g.group_id][j]]
            if items:
                meta.stores.append(StoreJob(st.req_id, items, notes, st.tenant))
                self.stats["store_items"] += len(items)
        self._add_offer(meta, st, Item(group_id, j, key, [block_id], parent_key))
        if not noted:
            meta.offer_notes.extend(notes)
        st.had_copies = True

    def _store_turn_end(self, request: Request, st: RequestRecord,
                        block_ids: list[int] | tuple[list[int], ...]) -> bytes | None:
        """A finished request's state after its last computed token L, when L is inside a chunk j: stored as a
        partial chunk (block j of every group: the full-attention page and, in align mode, the Mamba block
        (L - 1) // N that holds the running state), and remembered as a position later lookups probe. Only
        once the whole prompt ran, with no output placeholder in flight (then the block holds exactly L
        tokens' state), and without speculative decoding (whose drafts share the state blocks). The caller
        delays the blocks' free (``had_copies``). Returns the partial chunk's key, or None when none was stored."""
        C = self.chunk_size
        speculative = getattr(self._vllm_config, "speculative_config", None) is not None
        if (not self.cfg.turn_end_states or not self._partial_on() or st.request is None or st.uncacheable
                or st.loading or speculative or not block_ids or not isinstance(block_ids[0], list)
                or int(getattr(request, "num_output_placeholders", 0) or 0)):
            return None
        end = int(request.num_computed_tokens)
        j = end // C
        if end % C == 0 or end < st.num_tokens or end > len(request.all_token_ids) or self._has_extras(st.request):
            return None
        keys = self._keys_through(st, j)
        key = partial.key_at(keys, list(request.all_token_ids[:end]), end, C)
        if key is None:
            return None
        items: list[Item] = []
        for g in self.groups:
            ids = block_ids[g.group_id]
            blk = int(ids[j]) if len(ids) > j else 0
            if not blk:  # every group or none: a partial chunk without its state (or page) serves nothing
                return None
            items.append(Item(g.group_id, j, key, [blk], plans.parent(keys, j)))
        self._finish_stores.append(StoreJob(st.req_id, items, self._partial_notes(st, key, end), st.tenant,
                                            turn_end=end - j * C))
        self.stats["store_items"] += len(items)
        st.had_copies = True
        self._turn_ends.add(partial.before(keys, j), end - j * C)
        return key

    def _watch(self, req_id: str, lease_id: int) -> None:
        """Watch the lease a load retrieves under (``early_load_reports``): see ``_report_early``."""
        client, ack = self.link.client, self.link.ack
        if not self.cfg.early_load_reports or client is None or ack is None or not ack.lease_watch:
            return
        try:
            self._watches[client.submit_watch(lease_id)] = (req_id, lease_id)
        except Exception as e:  # the workers report the load, as without the watch
            self.link.lost(e)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        recving = set(getattr(output, "finished_recving", None) or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        self._reports.from_workers(recving, failed)  # vLLM must not hear a load a watch reported
        for req_id in recving | failed:
            st = self._reqs.get(req_id)
            if st is not None:
                self._fire(st, Event.LOAD_FAILED if req_id in failed else Event.LOAD_DONE)
        self._pump()
        self._report_early(recving)
        if recving or getattr(output, "finished_recving", None) is not None:
            output.finished_recving = recving

    def _report_early(self, recving: set[str]) -> None:
        """Add to ``recving`` the loads whose lease the daemon says every rank's retrieve wrote.

        Under vLLM's async scheduling the output handed here is the previous step's, read after the
        current step ran: a worker's report of a load that ended during the current step reaches vLLM
        with the next output, a step later than this one. The worker still reports it; that report is
        then taken out (``LoadReports.from_workers``). Never for GPU KV caches (the engine's stream must
        first wait for the daemon's copy, which only the worker does: the daemon does not count it
        written) nor for prefill/decode pulls (not watched)."""
        for req_id in self._reports.take_watched():
            st = self._reqs.get(req_id)
            if st is None or not st.loading:  # finished meanwhile (its blocks wait for the worker's report)
                continue
            self._fire(st, Event.LOAD_DONE)
            recving.add(req_id)
            self._reports.reported_by_watch(req_id)
            self.stats["loads_reported_early"] += 1

    @property
    def _reported_early(self) -> Counter[str]:
        """Loads this side reported whose workers' reports are still to come."""
        return self._reports.awaiting_workers

    # ---- request states (hkvd.shim.request_state) -------------------------------------------------
    def _answer(self, st: RequestRecord, hit_chunks: int) -> None:
        st.hit_chunks = hit_chunks
        self._fire(st, Event.ANSWERED)

    def _fire(self, st: RequestRecord, event: Event) -> bool:
        """Apply ``event`` to ``st``. A transition the table lacks raises with ``strict``; otherwise it is
        logged (once at ERROR) and the request fails safely: recomputed, never loaded. False then."""
        try:
            st.fire(event)
            return True
        except InvalidTransition as e:
            if self.strict:
                raise
            log = logger.debug if self._invalid_logged else logger.error
            self._invalid_logged = True
            log("%s", e)
            if st.lease_id and not st.lease_used:
                self._release(st.lease_id)
            st.fail_safe(event)
            return False

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._partial.pop(request.request_id, None)
        partials = self._partial_stored.pop(request.request_id, {})
        for lease in self._probes.drop(request.request_id):
            self._release(lease)
        if st is None:
            return False, None
        self._store_on_finish(request, st, block_ids)
        turn_end = self._store_turn_end(request, st, block_ids)
        if st.pin is not None:
            # The partial chunks it stored (vLLM's checkpoints inside blocks, its turn's end) are held with it.
            self._send_pin(st, st.pin, st.next_store_chunk, [*partials, *([turn_end] if turn_end else [])])
        if st.lookup_id is not None:
            self._by_lookup.pop(st.lookup_id, None)
        if st.lease_id and not st.lease_used:
            self._release(st.lease_id)
        params = None
        if pd.wants_params(self.kv_role, getattr(request, "kv_transfer_params", None)):
            params = self._producer_params(st)
        if st.loading:
            # Aborted while its load runs (vLLM schedules nothing else of a request that waits for
            # remote KV): vLLM frees its blocks when the worker reports the load, after the daemon's
            # reply. Never also in delayed_free: a second report would free them twice.
            self._fire(st, Event.FINISHED)
            return True, params
        if st.had_copies:
            self._fire(st, Event.FINISHED_STORING)
            self._delayed.append(request.request_id)
            return True, params
        self._fire(st, Event.FINISHED)
        return False, params

    def _store_on_finish(self, request: Request, st: RequestRecord,
                         block_ids: list[int] | tuple[list[int], ...]) -> None:
        """Store the computed chunks not stored yet, from the blocks the finished request hands back.

        Under async scheduling a chunk whose last token was still a placeholder when it filled, and
        whose request was not scheduled again, is keyed here. Only tokens up to vLLM's materialized
        frontier count (``num_computed_tokens`` less the placeholders of steps still in flight); a
        preempted request has none beyond its recomputed prefix. The caller delays the blocks' free
        (``had_copies``).
        """
        C = self.chunk_size
        if not (self.cfg.store_decode and C and block_ids) or not isinstance(block_ids[0], list):
            return
        computed = int(request.num_computed_tokens) - int(getattr(request, "num_output_placeholders", 0) or 0)
        last = min(computed, self._known_tokens(st)) // C
        if last <= st.next_store_chunk:
            return
        items = plans.store_items(self.groups, self._keys_through(st, last), block_ids, st.next_store_chunk, last, C)
        st.next_store_chunk = last
        self._plan_copies(st, items, self._finish_stores, self._finish_verifies)

    def _plan_copies(self, st: RequestRecord, items: list[Item], stores: list[StoreJob],
                     verifies: list[VerifyJob]) -> None:
        """Chunks complete in the engine's blocks: stored, or for a sampled hit's chunks, compared."""
        items, checks = plans.split_verified(items, st.verify_upto)
        if items:
            stores.append(StoreJob(st.req_id, items, self._notes_for(st, items), st.tenant))
            self.stats["store_items"] += len(items)
        kinds = {g.group_id: g.kind for g in self.groups}
        for kind in sorted({kinds[it.group_id] for it in checks}):  # one Verify per group kind
            verifies.append(VerifyJob(st.req_id, [it for it in checks if kinds[it.group_id] == kind], kind))
        self.stats["verify_items"] += len(checks)
        st.had_copies |= bool(items or checks)

    def _send_pin(self, st: RequestRecord, ask: sessions.PinAsk, n: int,
                  partial_keys: Sequence[bytes] = ()) -> None:
        """Pin the request's first ``n`` chunks: its prompt's when it arrives, and when it finishes every chunk
        it stored or found stored, which supersedes the first pin (the daemon holds a pinned key whether its
        entry is in yet or not), with the partial chunks it stored (``partial_keys``; only where the daemon
        takes them: ``RegisterAck.pin_partials``). No reply is awaited."""
        keys = self._keys_through(st, n)[:n]
        client, ack = self.link.client, self.link.ack
        if not keys or client is None or ack is None:
            logger.debug("hkvd: no pin for %s (%d chunks; daemon %s)", st.req_id, len(keys),
                         "connected" if client is not None else "unavailable")
            return
        if not ack.pins:
            if not self._said_no_pins:
                self._said_no_pins = True
                logger.warning("hkvd: requests ask for session pins, but the daemon at %s takes none (an older "
                               "hkvd); they run unpinned until hkvd serve on this node is upgraded",
                               self.cfg.socket_path)
            return
        try:
            partial_keys = partial_keys[-MAX_PIN_PARTIALS:] if ack.pin_partials else ()
            client.pin(ask.session, st.tenant, ask.ttl_s, keys[:MAX_KEYS], partial_keys)
        except ProtocolViolation as e:  # parse checked every field: a bug here, never the connection's fault
            logger.error("hkvd: no pin for %s: %s", st.req_id, e)
            return
        except Exception as e:
            self.link.lost(e)
            return
        self.stats["pins_sent"] += 1

    # ---- prefill/decode (hkvd.shim.pd) ---------------------------------------------------------
    def _plan_pull(self, request: Request, st: RequestRecord) -> None:
        """A consumer's request carrying a producer's params: claim its chunks, pull them first."""
        if self.kv_role == "kv_producer" or not self.chunk_size:
            return
        plan = pd.consumer_plan(getattr(request, "kv_transfer_params", None), self._keys(st),
                                (st.num_tokens - 1) // self.chunk_size, self.chunk_size)
        if plan is None:
            return
        if st.lookup_id is not None:  # a local lookup is moot now; its lease is released on arrival
            self._by_lookup.pop(st.lookup_id, None)
        if st.lease_id and not st.lease_used:
            self._release(st.lease_id)
        st.lease_id, st.pull = 0, plan[1]
        self._answer(st, plan[0])

    def _producer_params(self, st: RequestRecord) -> dict[str, Any] | None:
        C = self.chunk_size
        keys = self._keys(st)
        return self._producer.params(keys, min(len(keys), (st.num_tokens - 1) // C) if C else 0, C)

    # ---- KV events (docs/routing.md) ------------------------------------------------------------
    def _wants_notes(self) -> bool:
        """Notes go with stores when the daemon publishes node-wide, or this engine publishes (and polls)."""
        mode = int(getattr(self.link.ack, "kv_events", 0) or 0) if self.link.up else 0
        return mode >= KV_EVENTS_PUBLISHED or (mode >= KV_EVENTS_ACCEPTED and self.engine_events)

    def _notes_for(self, st: RequestRecord, items: list[Item], skip: set[bytes] | frozenset[bytes] = frozenset()
                   ) -> list[BlockNote]:
        """One note per chunk key of ``items`` (vLLM's hashes for its blocks), or none."""
        if not items or st.request is None or not self._wants_notes():
            return []
        out: list[BlockNote] = []
        seen = set(skip)
        for it in items:
            if it.key in seen:
                continue
            seen.add(it.key)
            note = self._notes.note(st.request, it.key, it.chunk_index, self.chunk_size)
            if note is not None:
                out.append(note)
        self.stats["notes"] += len(out)
        return out

    def _partial_notes(self, st: RequestRecord, key: bytes, end: int) -> list[BlockNote]:
        """The note of the partial chunk ``key`` ending at ``end`` (vLLM's partial entry there), or none."""
        if st.request is None or not self._wants_notes() or not getattr(self.link.ack, "partial_notes", False):
            return []
        note = self._notes.partial_note(st.request, key, end)
        if note is None:
            return []
        self.stats["notes"] += 1
        return [note]

    def take_events(self) -> list[KVCacheEvent]:
        """The daemon's KV events for this engine's layout that arrived since the last call (see
        hkvd.shim.kv_event_feed); polls again. Nothing unless the engine publishes KV events."""
        if not self.engine_events:
            return []
        self._pump()
        client = self.link.client
        if client is not None and int(getattr(self.link.ack, "kv_events", 0) or 0) >= KV_EVENTS_ACCEPTED:
            try:
                self.feed.maybe_poll(client)
            except Exception as e:
                self.link.lost(e)
                self.feed.lost_connection()
        return self.feed.take()

    def shutdown(self) -> None:
        self.link.close()

