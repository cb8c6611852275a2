# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's stores: the step's connector metadata, partial and turn-end stores, stores at finish.

Role
    ``StorePlanner`` turns what vLLM computed into copies for the workers. Once per step (``plan_step``,
    from ``build_connector_meta``) it fences the blocks the step may write, stores the attention chunks the
    step completes (``hkvd.shim.plans.store_items``), offers Mamba boundary states as step-event offers,
    and stores a state inside a chunk as a partial chunk (``hkvd.shim.partial``). When a request finishes
    (``finished``) it stores the chunks not stored yet from the blocks vLLM hands back, the state after its
    last computed token as a turn end (``turn_end_states``), and sends its session pin. A sampled hit's
    chunks are compared instead of stored (``VerifyJob``). Every store carries the request's tenant and,
    when KV events are on, vLLM's block hashes for each chunk (``hkvd.shim.kv_event_notes``).

Threading
    vLLM's scheduler thread only.

Contracts
    See the scheduler side's Contracts (``hkvd.shim.scheduler``): a chunk is stored once its KV is
    computed and every token of it known; a record with copies has its blocks' free delayed until the
    worker reports them (``RequestRecord.had_copies``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hkvd.shim import partial, plans, sessions
from hkvd.shim.hints import RequestHints
from hkvd.shim.jobs import StoreJob, VerifyJob
from hkvd.shim.kv_event_notes import NoteMaker
from hkvd.shim.metadata import HkvdConnectorMetadata
from hkvd.shim.request_state import RequestRecord
from hkvd.shim.scheduler_context import SchedulerContext
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.control import KV_EVENTS_ACCEPTED, KV_EVENTS_PUBLISHED
from hkvd.transport.wire.kv import MAX_PIN_PARTIALS, Item
from hkvd.transport.wire.message import MAX_KEYS

if TYPE_CHECKING:  # vLLM's types, for annotations only
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hkvd.shim")

BlockIds = list[int] | tuple[list[int], ...]


class StorePlanner:
    def __init__(self, ctx: SchedulerContext, notes: NoteMaker, engine_events: bool, speculative: bool) -> None:
        self.ctx = ctx
        self.notes = notes
        self.engine_events = engine_events  # this engine publishes KV events (vLLM's kv_events_config)
        self.speculative = speculative  # drafts share the state blocks: no turn-end states
        self.finish_stores: list[StoreJob] = []  # chunks keyed only when their request finished
        self.finish_verifies: list[VerifyJob] = []  # the same, of sampled hits (hkvd.shim.verify)
        self.delayed: list[str] = []  # requests whose free waits for their copies, for the next step
        self._said_no_pins = False  # warned that the daemon takes no session pins
        self._said_no_hints = False  # warned that the daemon takes no KV hints

    def take(self) -> tuple[list[StoreJob], list[VerifyJob], list[str]]:
        """What finished requests left for the next step's metadata: stores, verifies, delayed frees."""
        out = self.finish_stores, self.finish_verifies, self.delayed
        self.finish_stores, self.finish_verifies, self.delayed = [], [], []
        return out

    # ---- the step ------------------------------------------------------------------------------
    def plan_step(self, so: SchedulerOutput, meta: HkvdConnectorMetadata) -> None:
        """This step's fences, chunk stores and state offers, into ``meta``."""
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
        if not self.ctx.chunk_size or block_state is None:
            return
        self._store_chunks(so, block_state, meta)
        for req_id, offers in (block_state.boundary_state_offloads or {}).items():
            st = self.ctx.reqs.get(req_id)
            if st is not None:
                for group_id, block_id, boundary in offers:
                    self._offer(st, int(group_id), int(block_id), int(boundary), block_state, meta)

    def _store_chunks(self, so: SchedulerOutput, block_state: KVConnectorBlockState,
                      meta: HkvdConnectorMetadata) -> None:
        """The attention chunks this step completes, from the blocks vLLM holds now."""
        ctx, C = self.ctx, self.ctx.chunk_size
        cached = so.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        if not any(g.kind != "mamba" for g in ctx.groups):
            return
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = ctx.reqs.get(req_id)
            if st is None:
                continue
            # KV computed once this step's forward ran, and every token of the chunk known (see Contracts).
            done_after = min(computed.get(req_id, 0) + n_sched, ctx.keys.known_tokens(st))
            last = done_after // C
            if last <= st.next_store_chunk:
                continue
            table = block_state.get_block_ids(req_id)
            if table is None:
                continue
            items = plans.store_items(ctx.groups, ctx.keys.through(st, last), table, st.next_store_chunk, last, C)
            st.next_store_chunk = last
            self._plan_copies(st, items, meta.stores, meta.verifies)

    def _offer(self, st: RequestRecord, group_id: int, block_id: int, boundary: int,
               block_state: KVConnectorBlockState, meta: HkvdConnectorMetadata) -> None:
        """vLLM's offer of a state at ``boundary``: a whole chunk's, a partial chunk's, or none."""
        C = self.ctx.chunk_size
        if block_id and boundary > 0 and boundary % C and self.ctx.partial_on():
            self._partial_offer(st, group_id, block_id, boundary, block_state, meta)
            return
        if not block_id or boundary % C or boundary <= 0:
            return
        ci = boundary // C - 1
        keys = self.ctx.keys.through(st, ci + 1)
        if ci >= len(keys):
            return  # no key: past the prompt with store_decode off, or tokens not known
        offer = Item(group_id, ci, keys[ci], [block_id], plans.parent(keys, ci))
        st.had_copies = True
        if ci < st.verify_upto:  # a sampled hit's recomputed state: compare it, never store it
            meta.boundary_verifies.append((st.req_id, offer))
            self.ctx.stats["verify_items"] += 1
            return
        self._add_offer(meta, st, offer)
        meta.offer_notes.extend(self._notes_for(st, [offer], skip={n.key for n in meta.offer_notes}))

    def _add_offer(self, meta: HkvdConnectorMetadata, st: RequestRecord, item: Item) -> None:
        """One state offered this step (a StepEvent offer), under its request's tenant."""
        meta.offers.append((st.req_id, item))
        if st.tenant:
            meta.offer_tenants[st.req_id] = st.tenant
        if st.skip_store:
            meta.offer_skips[st.req_id] = st.skip_store
        self.ctx.stats["offer_items"] += 1

    def _partial_offer(self, st: RequestRecord, group_id: int, block_id: int, boundary: int,
                       block_state: KVConnectorBlockState, meta: HkvdConnectorMetadata) -> None:
        """vLLM's state at ``boundary``, inside a chunk: offered under the partial chunk's key, with the
        attention blocks of that chunk stored under the same key (once per request and boundary)."""
        ctx, C = self.ctx, self.ctx.chunk_size
        j = boundary // C
        if st.request is None or st.uncacheable or ctx.keys.has_extras(st.request):
            return
        if boundary > st.num_tokens and not ctx.keys.decode(st):  # it holds output tokens: a decode chunk's
            return
        keys = ctx.keys.through(st, j)
        key = partial.key_at(keys, list(st.request.all_token_ids[:boundary]), boundary, C)
        table = block_state.get_block_ids(st.req_id)
        if key is None or table is None:
            return
        parent_key = plans.parent(keys, j)
        stored = st.partials_stored
        noted = any(n.key == key for n in meta.offer_notes)  # another Mamba group's offer of it, this step
        notes = self._partial_notes(st, key, boundary) if key not in stored or not noted else []
        if key not in stored:
            stored[key] = None
            items = [Item(g.group_id, j, key, [int(table[g.group_id][j])], parent_key)
                     for g in ctx.groups if g.kind == "full" and len(table[g.group_id]) > j
                     and table[g.group_id][j]]
            if items:
                meta.stores.append(StoreJob(st.req_id, items, notes, st.tenant, skip_tiers=st.skip_store))
                ctx.stats["store_items"] += len(items)
        self._add_offer(meta, st, Item(group_id, j, key, [block_id], parent_key))
        if not noted:
            meta.offer_notes.extend(notes)
        st.had_copies = True

    def _plan_copies(self, st: RequestRecord, items: list[Item], stores: list[StoreJob],
                     verifies: list[VerifyJob]) -> None:
        """Chunks complete in the engine's blocks: stored, or for a sampled hit's chunks, compared."""
        items, checks = plans.split_verified(items, st.verify_upto)
        if items:
            stores.append(StoreJob(st.req_id, items, self._notes_for(st, items), st.tenant,
                                   skip_tiers=st.skip_store))
            self.ctx.stats["store_items"] += len(items)
        kinds = {g.group_id: g.kind for g in self.ctx.groups}
        for kind in sorted({kinds[it.group_id] for it in checks}):  # one Verify per group kind
            verifies.append(VerifyJob(st.req_id, [it for it in checks if kinds[it.group_id] == kind], kind))
        self.ctx.stats["verify_items"] += len(checks)
        st.had_copies |= bool(items or checks)

    # ---- a request's end -----------------------------------------------------------------------
    def finished(self, request: Request, st: RequestRecord, block_ids: BlockIds) -> None:
        """The request finished: its chunks not stored yet, its turn end, and its session pin."""
        self._store_on_finish(request, st, block_ids)
        turn_end = self.store_turn_end(request, st, block_ids)
        if st.pin is not None:
            # The partial chunks it stored (vLLM's checkpoints inside blocks, its turn's end) are held with it.
            self.send_pin(st, st.pin, st.next_store_chunk,
                          [*st.partials_stored, *([turn_end] if turn_end else [])])
        if st.hints is not None:
            self.send_hints(st, st.hints, st.next_store_chunk)

    def _store_on_finish(self, request: Request, st: RequestRecord, block_ids: BlockIds) -> None:
        """Store the computed chunks not stored yet, from the blocks the finished request hands back.

        Under async scheduling a chunk whose last token was still a placeholder when it filled, and
        whose request was not scheduled again, is keyed here. Only tokens up to vLLM's materialized
        frontier count (``num_computed_tokens`` less the placeholders of steps still in flight); a
        preempted request has none beyond its recomputed prefix. The caller delays the blocks' free
        (``had_copies``).
        """
        ctx, C = self.ctx, self.ctx.chunk_size
        computed = int(request.num_computed_tokens) - int(getattr(request, "num_output_placeholders", 0) or 0)
        if not ctx.keys.decode(st):
            self._count_not_stored(request, st, computed)
            return
        if not (C and block_ids) or not isinstance(block_ids[0], list):
            return
        last = min(computed, ctx.keys.known_tokens(st)) // C
        if last <= st.next_store_chunk:
            return
        items = plans.store_items(ctx.groups, ctx.keys.through(st, last), block_ids, st.next_store_chunk, last, C)
        st.next_store_chunk = last
        self._plan_copies(st, items, self.finish_stores, self.finish_verifies)

    def _count_not_stored(self, request: Request, st: RequestRecord, computed: int) -> None:
        """Count the decode chunks a request whose decode chunks are not stored computed (``hkvd.shim.decode_stores``):
        the whole chunks past its prompt's, up to its computed and known tokens."""
        C = self.ctx.chunk_size
        if not C or st.uncacheable or not st.decode_off:
            return
        n = min(computed, int(request.num_tokens)) // C - st.num_tokens // C
        self.ctx.decode.not_stored(st.decode_off, n, self.ctx.chunk_bytes(C))

    def _turn_end_allowed(self, request: Request, st: RequestRecord, block_ids: BlockIds) -> bool:
        return not (not self.ctx.cfg.turn_end_states or not self.ctx.partial_on() or st.request is None
                    or bool(st.uncacheable) or st.loading or self.speculative or not block_ids
                    or not isinstance(block_ids[0], list)
                    or int(getattr(request, "num_output_placeholders", 0) or 0))

    def store_turn_end(self, request: Request, st: RequestRecord, block_ids: BlockIds) -> bytes | None:
        """A finished request's state after its last computed token L, when L is inside a chunk j: stored as a
        partial chunk (block j of every group: the full-attention page and, in align mode, the Mamba block
        (L - 1) // N that holds the running state), and remembered as a position later lookups probe. Only
        once the whole prompt ran, with no output placeholder in flight (then the block holds exactly L
        tokens' state), and without speculative decoding (whose drafts share the state blocks). The caller
        delays the blocks' free (``had_copies``). Returns the partial chunk's key, or None when none was stored."""
        ctx, C = self.ctx, self.ctx.chunk_size
        if not self._turn_end_allowed(request, st, block_ids) or st.request is None:
            return None
        end = int(request.num_computed_tokens)
        j = end // C
        if end % C == 0 or end < st.num_tokens or end > len(request.all_token_ids) or ctx.keys.has_extras(st.request):
            return None
        if end > st.num_tokens and not ctx.keys.decode(st):  # past the prompt: a decode chunk's state
            return None
        keys = ctx.keys.through(st, j)
        key = partial.key_at(keys, list(request.all_token_ids[:end]), end, C)
        if key is None:
            return None
        items: list[Item] = []
        for g in ctx.groups:
            ids = block_ids[g.group_id]
            blk = int(ids[j]) if isinstance(ids, list) and len(ids) > j else 0
            if not blk:  # every group or none: a partial chunk without its state (or page) serves nothing
                return None
            items.append(Item(g.group_id, j, key, [blk], plans.parent(keys, j)))
        self.finish_stores.append(StoreJob(st.req_id, items, self._partial_notes(st, key, end), st.tenant,
                                           turn_end=end - j * C, skip_tiers=st.skip_store))
        ctx.stats["store_items"] += len(items)
        st.had_copies = True
        ctx.turn_ends.add(partial.before(keys, j), end - j * C)
        return key

    def send_pin(self, st: RequestRecord, ask: sessions.PinAsk, n: int, partial_keys: Sequence[bytes] = ()) -> None:
        """Pin the request's first ``n`` chunks: its prompt's when it arrives, and when it finishes every chunk
        it stored or found stored, which supersedes the first pin (the daemon holds a pinned key whether its
        entry is in yet or not), with the partial chunks it stored (``partial_keys``; only where the daemon
        takes them: ``RegisterAck.pin_partials``). No reply is awaited."""
        ctx = self.ctx
        keys = ctx.keys.through(st, n)[:n]
        port, ack = ctx.port, ctx.link.ack
        if not keys or port is None or ack is None:
            logger.debug("hkvd: no pin for %s (%d chunks; daemon %s)", st.req_id, len(keys),
                         "connected" if port is not None else "unavailable")
            return
        if not ack.pins:
            if not self._said_no_pins:
                self._said_no_pins = True
                logger.warning("hkvd: requests ask for session pins, but the daemon at %s takes none (an older "
                               "hkvd); they run unpinned until hkvd serve on this node is upgraded",
                               ctx.cfg.socket_path)
            return
        try:
            partial_keys = partial_keys[-MAX_PIN_PARTIALS:] if ack.pin_partials else ()
            port.pin(ask.session, st.tenant, ask.ttl_s, keys[:MAX_KEYS], partial_keys)
        except ProtocolViolation as e:  # parse checked every field: a bug here, never the connection's fault
            logger.error("hkvd: no pin for %s: %s", st.req_id, e)
            return
        except Exception as e:
            ctx.link.lost(e)
            return
        ctx.stats["pins_sent"] += 1

    def send_hints(self, st: RequestRecord, asks: RequestHints, n: int) -> None:
        """Send the request's KV hints about its first ``n`` chunks (those it stored or found stored) and the
        outcomes counted here (``kv.Hints``; docs/hints.md). No reply is awaited; a daemon that takes no hints
        (an older hkvd) gets none, said once."""
        ctx = self.ctx
        port, ack = ctx.port, ctx.link.ack
        if port is None or ack is None:
            return
        if not ack.hints:
            if not self._said_no_hints:
                self._said_no_hints = True
                logger.warning("hkvd: requests carry KV hints, but the daemon at %s takes none (an older hkvd); "
                               "they are dropped until hkvd serve on this node is upgraded", ctx.cfg.socket_path)
            return
        keys = ctx.keys.through(st, n)[:n][:MAX_KEYS] if asks.asks else []
        if asks.asks and not keys:
            asks.reject_asks()  # no whole chunk of the request is stored: nothing to hold, move or count
        try:
            port.hints(st.tenant, keys, [(a.action, a.ttl_s, a.session) for a in asks.asks], asks.counted)
        except ProtocolViolation as e:  # parse checked every field: a bug here, never the connection's fault
            logger.error("hkvd: no hints for %s: %s", st.req_id, e)
        except Exception as e:
            ctx.link.lost(e)

    # ---- KV events (docs/routing.md) ------------------------------------------------------------
    def kv_events_mode(self) -> int:
        """What the daemon does with KV events (``RegisterAck.kv_events``); 0 while it is down."""
        ack = self.ctx.link.ack
        return int(ack.kv_events) if ack is not None and self.ctx.link.up else 0

    def _wants_notes(self) -> bool:
        """Notes go with stores when the daemon publishes node-wide, or this engine publishes (and polls)."""
        mode = self.kv_events_mode()
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
            note = self.notes.note(st.request, it.key, it.chunk_index, self.ctx.chunk_size)
            if note is not None:
                out.append(note)
        self.ctx.stats["notes"] += len(out)
        return out

    def _partial_notes(self, st: RequestRecord, key: bytes, end: int) -> list[BlockNote]:
        """The note of the partial chunk ``key`` ending at ``end`` (vLLM's partial entry there), or none."""
        ack = self.ctx.link.ack
        if st.request is None or not self._wants_notes() or ack is None or not ack.partial_notes:
            return []
        note = self.notes.partial_note(st.request, key, end)
        if note is None:
            return []
        self.ctx.stats["notes"] += 1
        return [note]
