# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's lookups: what of a request's prompt the daemon holds, answered on its record.

Role
    ``Lookups`` submits a request's lookup when it arrives (``submit``), with the partial chunks that may
    end its hit as tails (``Lookup.tails``: remembered turn ends and vLLM's checkpoints, longest first),
    takes the daemon's replies (``on_completion``), probes the positions inside the next chunk the tails
    did not try (``hkvd.shim.partial.Probes``), looks up once more with the turn ends another engine
    stored (``LookupReply.ends``), and answers the record (``SchedulerContext.answer``): hit chunks,
    lease, and a partial hit where one won. ``await_answer`` waits for the reply within the scheduling's
    wait budget (``budget``, from the engine's pace) and ``lookup_timeout_s`` in all. A prefill/decode
    consumer's request is answered by the producer's plan instead (``plan_pull``).

Threading
    vLLM's scheduler thread only; replies are read by the scheduler side's polls.

Failure handling
    A lookup that fails, is lost with the connection, or stays unanswered past ``lookup_timeout_s`` is a
    miss (recompute). A reply naming a tail that does not fit the hit is a daemon bug: logged, the lease
    released, a miss. A probe that fails is a miss for its position; the whole-chunk hit stands.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from hkvd.shim import partial, pd
from hkvd.shim.daemon_port import DaemonPort
from hkvd.shim.request_state import Event, RequestRecord
from hkvd.shim.results import Completion
from hkvd.shim.scheduler_context import SchedulerContext
from hkvd.transport.errors import DaemonUnavailable
from hkvd.transport.wire.kv import MAX_TAILS, LookupReply

if TYPE_CHECKING:  # vLLM's type, for annotations only
    from vllm.v1.request import Request

logger = logging.getLogger("hkvd.shim")

STEP_HISTORY = 4  # scheduling intervals the lookup wait looks back on (budget)


class Lookups:
    def __init__(self, ctx: SchedulerContext, connect: Callable[[], DaemonPort | None]) -> None:
        self.ctx = ctx
        self._connect = connect  # connect again now (the scheduler side's chunk-size checks): the port or None
        self.by_lookup: dict[int, str] = {}  # the lookups in flight: the port's request id -> request
        self._probes = partial.Probes()
        # The engine's pace: the last four intervals from a scheduling with tokens to the next scheduling, and
        # what is left of this scheduling's lookup wait (budget).
        self._step_intervals: deque[float] = deque(maxlen=STEP_HISTORY)
        self._meta_at: float | None = None
        self._wait_left_s = ctx.cfg.lookup_wait_s

    # ---- submitting ---------------------------------------------------------------------------
    def submit(self, st: RequestRecord) -> None:
        """Look the request's prompt up; a miss at once when the daemon is down."""
        ctx, C = self.ctx, self.ctx.chunk_size
        port = self._port()
        if port is None:
            ctx.answer(st, 0)
            return
        keys = ctx.keys.prompt(st)
        # Leave at least the last prompt token to compute: vLLM needs logits for it.
        n = min(len(keys), (st.num_tokens - 1) // C)
        if n <= 0:
            ctx.answer(st, 0)
            return

        def submit(port: DaemonPort) -> tuple[int, list[tuple[int, bytes]]]:
            tails = self.tails(st, keys, n)  # per connection: a daemon may not take them
            sent = [(pos // C, key) for pos, key in tails]
            ack = ctx.link.ack
            ends = bool(ack is not None and ack.turn_ends and ctx.cfg.turn_end_states and not st.ends_retried
                        and self._tails_apply(st))
            places = bool(ack is not None and ack.in_step and ctx.cfg.in_step_loads)
            tiers = bool(ack is not None and ack.request_tiers)  # an older daemon takes none (said once: scheduler)
            return port.submit_lookup(keys[:n], lease=True, tails=sent, ends=ends, places=places,
                                      skip_tiers=st.skip_load if tiers else 0), tails

        try:
            rid, tails = submit(port)
        except Exception as e:
            # The connection died since the last call (daemon restarted?): reconnect once now.
            ctx.link.lost(e)
            again = self._connect()
            try:
                if again is None:
                    raise ConnectionError("daemon unavailable") from e
                rid, tails = submit(again)
            except Exception as e2:
                ctx.link.lost(e2)
                ctx.answer(st, 0)
                return
        st.lookup_id, st.lookup_sent_at, st.lookup_gen = rid, time.monotonic(), ctx.link.generation
        st.lookup_tails = tails
        self.by_lookup[rid] = st.req_id
        ctx.timeline.note(st.req_id, "lookup_sent")
        ctx.stats["lookups"] += 1

    def _port(self) -> DaemonPort | None:
        """The daemon, connecting again first if it is down."""
        return self.ctx.port if self.ctx.link.up else self._connect()

    def await_answer(self, st: RequestRecord, pump: Callable[[float], None]) -> bool:
        """Wait for the record's answer within this scheduling's budget, reading replies with ``pump``;
        False while it may still come (vLLM asks again next step). Past ``lookup_timeout_s``: a miss."""
        ctx = self.ctx
        if st.answered:
            return True
        if st.lookup_id is None or st.lookup_gen != ctx.link.generation:
            self.submit(st)
        began = time.monotonic()
        deadline = began + max(ctx.cfg.lookup_wait_s, self._wait_left_s)
        while not st.answered and ctx.link.client is not None:
            # Other replies (other requests' lookups, lease watches) may come first: wait on for this one.
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pump(left)
        self._wait_left_s = max(0.0, self._wait_left_s - (time.monotonic() - began))
        if st.answered:
            return True
        if time.monotonic() - st.lookup_sent_at < ctx.cfg.lookup_timeout_s:
            ctx.stats["lookups_deferred"] += 1
            return False
        logger.warning("hkvd: lookup for %s unanswered after %.1f s; recomputing", st.req_id,
                       ctx.cfg.lookup_timeout_s)
        self.by_lookup.pop(st.lookup_id or 0, None)
        ctx.answer(st, 0)
        return True

    # ---- the engine's pace --------------------------------------------------------------------
    def budget(self) -> float:
        """Seconds one scheduling may wait for lookup replies in all: ``lookup_wait_fraction`` of the longest of
        the engine's last four steps, at least ``lookup_wait_s`` and at most ``lookup_wait_max_s`` (see
        ``ShimConfig``). A deferred request waits for the next step, whose length is not known yet: the longest
        recent one stands for it (a long prefill among short decodes). An idle engine's gap before a request
        counts as a long step: waiting then holds no running request."""
        cfg = self.ctx.cfg
        step_s = max(self._step_intervals, default=0.0)
        return max(cfg.lookup_wait_s, min(cfg.lookup_wait_max_s, cfg.lookup_wait_fraction * step_s))

    def on_step(self, scheduled_tokens: int) -> None:
        """A scheduling ran (``build_connector_meta``): the engine's pace, and a fresh wait budget."""
        now = time.monotonic()
        if self._meta_at is not None:  # a step that scheduled nothing is not the engine's pace (it loops at once)
            self._step_intervals.append(now - self._meta_at)
        self._meta_at = now if scheduled_tokens else None
        self._wait_left_s = self.budget()

    # ---- replies ------------------------------------------------------------------------------
    def on_completion(self, c: Completion) -> bool:
        """Take a lookup's or a probe's reply; False when ``c`` is neither. The lease of a lookup whose
        request finished (or was answered otherwise) meanwhile is released."""
        if c.req_id in self._probes:
            self._probe_done(c.req_id, c.get(LookupReply) if c.ok else None)
            return True
        req_id = self.by_lookup.pop(c.req_id, None)
        st = self.ctx.reqs.get(req_id) if req_id is not None else None
        if st is None:
            if c.ok and isinstance(c.result, LookupReply) and c.result.lease_id:
                self.ctx.release(c.result.lease_id)
            return isinstance(c.result, LookupReply) or req_id is not None
        tails, st.lookup_tails = st.lookup_tails, []
        if c.ok:
            self._looked_up(st, c.get(LookupReply), tails if st.lookup_id == c.req_id else [])
            return True
        self.ctx.answer(st, 0)
        if isinstance(c.error, DaemonUnavailable):
            self.ctx.link.lost(c.error)
        else:
            logger.debug("hkvd: lookup for %s failed: %s", req_id, c.error)
        return True

    def _looked_up(self, st: RequestRecord, found: LookupReply, tails: list[tuple[int, bytes]]) -> None:
        """The whole-chunk lookup's answer, extended by one of its ``tails`` where the daemon says so; the
        request is answered now, or once the probes of positions no tail tried reply (``_probe``)."""
        ctx, C = self.ctx, self.ctx.chunk_size
        st.partial = None  # a lookup afresh (preempted): its partial hit is decided anew
        if found.tail and (found.tail > len(tails) or found.hit_chunks != tails[found.tail - 1][0] // C + 1):
            # A daemon bug: the hit's last chunk is not the tail named, so serve none of it.
            logger.error("hkvd: the daemon's lookup reply names tail %d of %d sent for a hit of %d chunks; "
                         "recomputing %s", found.tail, len(tails), found.hit_chunks, st.req_id)
            ctx.release(found.lease_id)
            ctx.answer(st, 0)
            return
        if found.ends and not found.tail and not st.ends_retried and self._learn_ends(st, found.ends, tails):
            # Turn ends the daemon knows and the tails missed (another engine's): once more, with them as tails.
            st.ends_retried = True
            ctx.release(found.lease_id)
            ctx.stats["lookups_for_turn_ends"] += 1
            self.submit(st)
            return
        st.hit_chunks, st.lease_id = found.hit_chunks, found.lease_id
        st.places = found.places or None  # a probe's partial hit, later, has a lease of its own: then unused
        st.places_pool = ctx.link.client.server_id if ctx.link.client is not None else ""
        st.places_lease = found.lease_id
        st.lease_until = st.lookup_sent_at + found.lease_ttl_s * (1.0 - ctx.cfg.in_step_lease_margin)
        if found.tail:
            ctx.answer(st, found.hit_chunks, tails[found.tail - 1])
        elif not self._probe(st, tried={pos for pos, _ in tails}):
            ctx.fire(st, Event.ANSWERED)

    def _learn_ends(self, st: RequestRecord, ends: list[list[int]], tails: list[tuple[int, bytes]]) -> bool:
        """Remember the turn ends a lookup's reply named (``LookupReply.ends``); whether any of them is a
        position of this prompt the lookup's tails did not try."""
        keys, C = self.ctx.keys.prompt(st), self.ctx.chunk_size
        tried = {pos for pos, _ in tails}
        new = False
        for j, off in ends:
            pos = j * C + off
            if j > len(keys) or pos >= st.num_tokens or off >= C:
                continue
            self.ctx.turn_ends.add(partial.before(keys, j), off)
            new = new or pos not in tried
        return new

    # ---- partial chunks (hkvd.shim.partial) ------------------------------------------------------
    def _positions(self, st: RequestRecord, keys: list[bytes], j: int, checkpoints: bool) -> list[int]:
        """Where inside chunk ``j`` a partial chunk of this prompt may be stored, longest first: the positions
        turns ended at after chunk j - 1, and with ``checkpoints`` the h multiples vLLM checkpoints."""
        ctx, C = self.ctx, self.ctx.chunk_size
        positions = (partial.candidates(j, st.num_tokens, C, ctx.hash_unit)
                     if checkpoints and partial.checkpoints(ctx.block_size, ctx.hash_unit) else [])
        if ctx.cfg.turn_end_states:
            ends = ctx.turn_ends.positions(partial.before(keys, j), j * C, st.num_tokens)
            positions = partial.merge(positions, ends)
        return positions

    def tails(self, st: RequestRecord, keys: list[bytes], n: int) -> list[tuple[int, bytes]]:
        """(position, key) of the partial chunks that may end the hit of a lookup of ``n`` whole chunks
        (``Lookup.tails``, longest first): every remembered turn end inside chunks 0 .. n, and the h
        multiples inside chunk n; [] for a daemon that does not take them, or a request that gets none."""
        if not self._tails_apply(st):
            return []
        positions = [p for j in range(n + 1) for p in self._positions(st, keys, j, checkpoints=j == n)]
        tails = []
        for pos in sorted(positions, reverse=True)[:MAX_TAILS]:
            key = partial.key_at(keys, st.tokens, pos, self.ctx.chunk_size)
            if key is not None:
                tails.append((pos, key))
        return tails

    def _tails_apply(self, st: RequestRecord) -> bool:
        """Whether a lookup of this request may carry tails: the daemon takes them, and the request can be served
        partial chunks."""
        ack = self.ctx.link.ack
        return not (ack is None or not ack.lookup_tails or not self.ctx.partial_on() or st.request is None
                    or bool(st.uncacheable) or self.ctx.keys.has_extras(st.request))

    def _probe(self, st: RequestRecord, tried: set[int]) -> bool:
        """After the whole-chunk answer: probe the positions inside the next chunk where a partial chunk may be
        stored, but those ``tried`` (the lookup's tails). True when probes went out (the request is answered
        once they all reply)."""
        ctx = self.ctx
        if not ctx.partial_on() or st.request is None or st.uncacheable:
            return False
        C, keys = ctx.chunk_size, ctx.keys.prompt(st)
        if st.hit_chunks > len(keys) or ctx.keys.has_extras(st.request):
            return False
        port = ctx.port
        submitted: dict[int, tuple[int, bytes]] = {}
        skip = st.skip_load if ctx.link.ack is not None and ctx.link.ack.request_tiers else 0
        positions = [p for p in self._positions(st, keys, st.hit_chunks, checkpoints=True) if p not in tried]
        for pos in positions:
            key = partial.key_at(keys, st.tokens, pos, C)
            if key is None or port is None:
                continue
            try:
                submitted[port.submit_lookup([*keys[:st.hit_chunks], key], lease=True, skip_tiers=skip)] = (pos, key)
            except Exception as e:  # the whole-chunk answer stands; the link recovers on a later call
                ctx.link.lost(e)
                break
        if not submitted:
            return False
        self._probes.begin(st, submitted)
        return True

    def _probe_done(self, lookup_id: int, found: LookupReply | None) -> None:
        st, choice, release = self._probes.reply(lookup_id, found.hit_chunks if found else 0,
                                                 found.lease_id if found else 0)
        if choice is not None and st.answered:  # answered otherwise meanwhile
            release += [x for x in (choice.lease_id,) if x and x != st.lease_id]
            choice = None
        for lease in release:
            self.ctx.release(lease)
        if choice is None:
            return
        st.lease_id = choice.lease_id
        self.ctx.answer(st, choice.hit_chunks, (choice.tokens, choice.key) if choice.tokens else None)

    # ---- prefill/decode (hkvd.shim.pd) ---------------------------------------------------------
    def plan_pull(self, request: Request, st: RequestRecord, kv_role: str) -> None:
        """A consumer's request carrying a producer's params: claim its chunks, pull them first."""
        ctx, C = self.ctx, self.ctx.chunk_size
        if kv_role == "kv_producer" or not C:
            return
        plan = pd.consumer_plan(getattr(request, "kv_transfer_params", None), ctx.keys.prompt(st),
                                (st.num_tokens - 1) // C, C)
        if plan is None:
            return
        if st.lookup_id is not None:  # a local lookup is moot now; its lease is released on arrival
            self.by_lookup.pop(st.lookup_id, None)
        if st.lease_id and not st.lease_used:
            ctx.release(st.lease_id)
        st.lease_id, st.pull = 0, plan[1]
        ctx.answer(st, plan[0])

    # ---- connection and request ends -----------------------------------------------------------
    def forget(self) -> None:
        """A new connection: the old one's lookups and probes never complete; unanswered records ask again."""
        self.by_lookup.clear()
        self._probes.clear()
        for st in self.ctx.reqs.values():
            st.lookup_tails = []
            if not st.answered:
                st.lookup_id = None

    def finished(self, st: RequestRecord) -> None:
        """The request finished: its probes' leases released, its lookup's reply no longer awaited."""
        for lease in self._probes.drop(st):
            self.ctx.release(lease)
        if st.lookup_id is not None:
            self.by_lookup.pop(st.lookup_id, None)
