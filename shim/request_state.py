# SPDX-License-Identifier: Apache-2.0
"""A request's life on the scheduler side, as named states and the events that move it.

Role
    ``RequestRecord`` is what the scheduler side (``hkvd.shim.scheduler``) knows of one request:
    its prompt and chunk keys, its lookup and lease, its next chunk to store, and its ``State``.
    Every event of vLLM's connector API that changes a request, and every daemon reply that does,
    is an ``Event``; ``TRANSITIONS`` says which state each event leads to from each state, and
    ``RequestRecord.fire`` applies it. ``LoadReports`` is the one place where a load is reported
    finished to vLLM: the worker's report and the scheduler's lease watch may both say so, and
    vLLM hears it once.

States (``State``)
    LOOKUP     waiting for the daemon's lookup reply (the hit is unknown)
    LOOKED_UP  the hit is known (a lookup reply, a miss, a timeout, or a prefill/decode plan);
               vLLM has not allocated the request's blocks yet
    LOADING    its load (a pull first, for prefill/decode) is in flight: the daemon may be
               writing into its blocks, vLLM keeps it in WAITING_FOR_REMOTE_KVS
    LOADED     the load was reported finished to vLLM; the request is about to run
    RUNNING    allocated and computing (no load, or after its load)
    FAILED     its load failed: vLLM recomputes it, and it is never offered a hit again
    STORING    finished; vLLM frees its blocks when the worker reports its copies done
    FINISHED   finished; nothing of it is left here

Contracts
    - A transition that ``TRANSITIONS`` does not list raises ``InvalidTransition``: it is a bug in
      the shim or a change in vLLM's call order. The scheduler side lets it raise in tests
      (``strict``) and otherwise logs it once and fails the request safely: it is recomputed,
      vLLM is never stopped.
    - A load is reported to vLLM once: ``LoadReports.report`` from either source returns whether
      vLLM is to hear it; the other source's report of the same load is taken out.

Threading
    vLLM's scheduler thread only, like the scheduler side.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hkvd.shim.hints import RequestHints
from hkvd.shim.jobs import PullSpec
from hkvd.shim.sessions import PinAsk

if TYPE_CHECKING:  # vLLM's type, for annotations only
    from vllm.v1.request import Request


class State(enum.Enum):
    LOOKUP = "waiting for lookup"
    LOOKED_UP = "looked up"
    LOADING = "loading"
    LOADED = "loaded"
    RUNNING = "running"
    FAILED = "failed"
    STORING = "storing"
    FINISHED = "finished"


class Event(enum.Enum):
    ANSWERED = "the hit is known"  # lookup reply, miss, timeout, no daemon, or a prefill/decode plan
    ASKED_AGAIN = "asked again after its lease was spent"  # get_num_new_matched_tokens after a preemption
    ALLOCATED = "allocated without a load"  # update_state_after_alloc, nothing external to load
    LOAD_PLANNED = "allocated with a load"  # update_state_after_alloc, a LoadJob planned
    LOADED_IN_STEP = "allocated with an in-step load"  # update_state_after_alloc, copied before its forward
    LOAD_DONE = "load reported finished"  # LoadReports: the worker's report or the lease watch's
    LOAD_FAILED = "load reported failed"  # update_connector_output: failed_recving
    FINISHED = "finished"  # request_finished: nothing to wait for here
    FINISHED_STORING = "finished with copies"  # request_finished: its free waits for its copies


_S, _E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (_S.LOOKUP, _E.ANSWERED): _S.LOOKED_UP,
    (_S.LOOKED_UP, _E.ANSWERED): _S.LOOKED_UP,  # a prefill/decode plan replaces a local lookup's answer
    (_S.LOOKED_UP, _E.ALLOCATED): _S.RUNNING,
    (_S.LOOKED_UP, _E.LOAD_PLANNED): _S.LOADING,
    (_S.LOOKED_UP, _E.LOADED_IN_STEP): _S.RUNNING,  # the worker copies it before the step's forward
    (_S.LOADING, _E.LOAD_DONE): _S.LOADED,
    (_S.LOADING, _E.LOAD_FAILED): _S.FAILED,
    (_S.LOADED, _E.ALLOCATED): _S.RUNNING,  # vLLM schedules it once its load is reported
    (_S.LOADED, _E.ASKED_AGAIN): _S.LOOKUP,  # preempted before it ran: its blocks are gone
    (_S.RUNNING, _E.ALLOCATED): _S.RUNNING,  # resumed after a preemption without a spent lease
    (_S.RUNNING, _E.LOAD_PLANNED): _S.LOADING,  # the same, with a prefill/decode hit still held
    (_S.RUNNING, _E.ASKED_AGAIN): _S.LOOKUP,  # preempted: look the prefix up afresh
    (_S.FAILED, _E.ALLOCATED): _S.FAILED,  # recomputed, never loaded again
    (_S.FAILED, _E.LOAD_FAILED): _S.FAILED,  # one load reported failed by more than one rank
}
for _state in (_S.LOOKUP, _S.LOOKED_UP, _S.LOADING, _S.LOADED, _S.RUNNING, _S.FAILED):
    TRANSITIONS[(_state, _E.FINISHED)] = _S.FINISHED
    if _state is not _S.LOADING:  # finished while loading: vLLM frees the blocks once the load is reported
        TRANSITIONS[(_state, _E.FINISHED_STORING)] = _S.STORING
del _state


class InvalidTransition(RuntimeError):
    def __init__(self, req_id: str, state: State, event: Event) -> None:
        super().__init__(f"hkvd: request {req_id}: no transition from '{state.value}' on '{event.value}' "
                         "(a shim bug, or vLLM changed its call order); the request is recomputed")
        self.req_id, self.state, self.event = req_id, state, event


@dataclass(slots=True)
class Probe:
    """A request's probes in flight (``hkvd.shim.partial.Probes``): the whole-chunk answer they may extend, each
    probe's (position, key) by lookup id, and the best partial hit so far (position, lease, key)."""

    hit_chunks: int
    lease_id: int
    waiting: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    best: tuple[int, int, bytes] | None = None


@dataclass(slots=True)
class RequestRecord:
    """One request as the scheduler side tracks it; ``state`` moves only through ``fire``."""

    req_id: str
    tokens: list[int]
    num_tokens: int
    request: Request | None = None  # its extra keys (LoRA, images, cache_salt) join the chunk keys
    state: State = State.LOOKUP
    lookup_id: int | None = None  # the lookup in flight (LOOKUP), None before it is sent or once lost
    lookup_sent_at: float = 0.0
    lookup_gen: int = 0  # the link generation it was sent on
    ends_retried: bool = False  # looked up again with the turn ends the daemon named (LookupReply.ends)
    hit_chunks: int = 0  # known from LOOKED_UP on; a partial hit's last chunk counts
    # A partial hit (hkvd.shim.partial): the tokens it serves and the partial key of its last chunk
    # (hit_chunks - 1), which is then not the whole chunk. None: the hit is whole chunks.
    partial: tuple[int, bytes] | None = None
    lookup_tails: list[tuple[int, bytes]] = field(default_factory=list)  # (position, key) the lookup sent
    probe: Probe | None = None  # probes of positions inside the next chunk, after the whole-chunk answer
    lease_id: int = 0
    lease_used: bool = False  # the lease was spent: a load retrieves under it, or it was released
    # In-step loads (hkvd.shim.pool_reads): the lookup reply's pool places of the leased hit, per rank, the
    # daemon whose pool they are in, and until when (time.monotonic()) the lease surely holds. None: none.
    places: list[Any] | None = None
    places_pool: str = ""
    places_lease: int = 0
    lease_until: float = 0.0
    in_step: bool = False  # what the last get_num_new_matched_tokens told vLLM: loaded in the step (synchronous)
    next_store_chunk: int = 0
    had_copies: bool = False  # stores or offers were planned: its free waits for the worker
    pd_checked: bool = False  # its kv_transfer_params were looked at (prefill/decode, hkvd.shim.pd)
    pull: PullSpec | None = None  # until the load job that carries it is planned
    # Chunk keys over the prompt's full chunks; with store_decode extended over known output tokens.
    keys: list[bytes] = field(default_factory=list)
    # Whether the chunks it generates are stored (hkvd.shim.decode_stores): None, the engine's store_decode; and
    # when they are not, why (template, request or config), for the counters.
    store_decode: bool | None = None
    decode_off: str = ""
    uncacheable: str = ""  # why it cannot be keyed (hkvd.shim.identity.Uncacheable): never looked up or stored
    # A sampled hit (hkvd.shim.verify): computed, not loaded; chunks [verify_from, verify_upto) that it
    # computes are compared with the daemon's entries instead of stored. verify_upto 0: not sampled.
    verify_from: int = 0
    verify_upto: int = 0
    tenant: str = ""  # whose quota its stores count against (hkvd.shim.tenants)
    pin: PinAsk | None = None  # the session pin its kv_transfer_params asked for (hkvd.shim.sessions)
    hints: RequestHints | None = None  # its KV hints (hkvd.shim.hints), sent when it finishes
    # The tiers its kv_load_tiers / kv_store_tiers leave out (hkvd.transport.tier_matchers bits); 0: every tier.
    skip_load: int = 0
    skip_store: int = 0
    # The partial chunks whose blocks went out as stores or offers, in the order they did (pinned with it).
    partials_stored: dict[bytes, None] = field(default_factory=dict)

    @property
    def answered(self) -> bool:
        return self.state is not State.LOOKUP

    @property
    def loading(self) -> bool:
        return self.state is State.LOADING

    @property
    def load_failed(self) -> bool:
        return self.state is State.FAILED

    def fire(self, event: Event) -> State:
        """Move to the state ``TRANSITIONS`` gives; raises ``InvalidTransition`` (state unchanged) if none."""
        to = TRANSITIONS.get((self.state, event))
        if to is None:
            raise InvalidTransition(self.req_id, self.state, event)
        self.state = to
        if to is State.LOOKUP:  # asked again: the old answer and its lease are spent
            self.hit_chunks, self.lookup_id, self.lease_id, self.lease_used = 0, None, 0, False
            self.places = None
            self.verify_from = self.verify_upto = 0
            self.partial = None
        elif to is State.FAILED:  # recomputed from scratch: store it again (a new daemon lacks it)
            self.hit_chunks, self.lease_id, self.next_store_chunk, self.partial = 0, 0, 0, None
            self.places = None
        return to

    def hit_tokens(self, chunk_size: int) -> int:
        """The tokens the hit serves: a partial hit's position, else its whole chunks'."""
        return self.partial[0] if self.partial is not None else self.hit_chunks * chunk_size

    @property
    def held_chunks(self) -> int:
        """The whole chunks the daemon holds of the hit (a partial last chunk is not the whole chunk)."""
        return self.hit_chunks - (self.partial is not None)

    def fail_safe(self, event: Event) -> None:
        """After an ``InvalidTransition`` on ``event``: recompute the request, never offer it a hit again.

        A load vLLM was promised (``LOAD_PLANNED``) still goes to the worker, with no items: the
        worker refuses it and reports it failed, so the request leaves WAITING_FOR_REMOTE_KVS (LOADING
        until then, then FAILED). Any other event fails the request at once."""
        self.state = State.LOADING if event is Event.LOAD_PLANNED else State.FAILED
        self.hit_chunks, self.lease_id, self.partial = 0, 0, None


class LoadReports:
    """The one source of "load finished" for vLLM: the workers' reports and the lease watches'.

    ``watched(req_id)``: the daemon said every rank's retrieve wrote the request's blocks (the lease
    watch); it is reported with the next output (``take_watched``). ``reported_by_watch(req_id)``: it
    was, so the worker's later report of the same load is taken out (``from_workers``).
    """

    def __init__(self) -> None:
        self._written: set[str] = set()  # watch said written: reported with the next output
        self._early: Counter[str] = Counter()  # reported by a watch; the worker's report still to come

    def watched(self, req_id: str) -> None:
        self._written.add(req_id)

    def from_workers(self, recving: set[str], failed: set[str]) -> None:
        """Take out of ``recving`` and ``failed`` the loads a watch reported already (vLLM must not
        hear a load twice); a load the workers report first needs no watch's report."""
        for req_id in [r for r in recving if self._early[r]]:
            self._early[req_id] -= 1
            if not self._early[req_id]:
                del self._early[req_id]
            recving.discard(req_id)
            failed.discard(req_id)
        self._written -= recving

    def take_watched(self) -> list[str]:
        """The loads watches said written since the last call."""
        out = list(self._written)
        self._written.clear()
        return out

    def reported_by_watch(self, req_id: str) -> None:
        self._early[req_id] += 1

    @property
    def awaiting_workers(self) -> Counter[str]:
        """Loads a watch reported whose workers' reports are still to come (taken out when they do)."""
        return self._early
