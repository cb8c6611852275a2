# SPDX-License-Identifier: Apache-2.0
"""What the scheduler side's parts share: settings, the layout, the daemon link, the records, the counters.

Role
    One ``SchedulerContext`` per scheduler side (``hkvd.shim.scheduler``), handed to its three parts
    (``Lookups``, ``StorePlanner``, ``LoadPlanner``). It holds every request vLLM announced and has not
    finished, each a ``RequestRecord`` with all of that request's state, and is the one place a record's
    state moves (``fire``): a transition the table lacks raises with ``strict`` (tests), and otherwise is
    logged once and the request is recomputed, its unspent lease released.

Threading
    vLLM's scheduler thread only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from hkvd.shim import partial
from hkvd.shim.daemon_port import DaemonPort
from hkvd.shim.decode_stores import DecodeStores
from hkvd.shim.identity import Uncacheable
from hkvd.shim.link import DaemonLink
from hkvd.shim.request_keys import ChunkKeys
from hkvd.shim.request_state import Event, InvalidTransition, RequestRecord
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.spec import GroupInfo
from hkvd.shim.timeline import OFF, Timeline
from hkvd.transport.turn_ends import TurnEnds

if TYPE_CHECKING:  # vLLM's type, for annotations only
    from vllm.config import ModelConfig

logger = logging.getLogger("hkvd.shim")

# Set to 1 (tests): a request state transition the table lacks raises instead of recomputing the request.
STRICT_ENV = "HKVD_STRICT_STATES"

# The scheduler side's counters (reported through the connector's stats). lookups_deferred: passes over a
# waiting request whose lookup's reply had not come yet. loads_reported_early: loads this side reported
# finished before any worker did (lease watches). in_step_loads: hits the workers copy from the pool in the
# step that plans them (hkvd.shim.pool_reads).
STAT_NAMES = ("lookups", "lookups_deferred", "hit_tokens", "load_jobs", "store_items", "offer_items",
              "uncacheable", "notes", "loads_reported_early", "lookups_for_turn_ends", "verify_sampled",
              "verify_items", "pins_sent", "pins_refused", "in_step_loads", "tiers_refused")


class SchedulerContext:
    def __init__(self, cfg: ShimConfig, link: DaemonLink, groups: list[GroupInfo], block_size: int,
                 hash_unit: int, model_config: ModelConfig | None = None,
                 chunk_bytes: Callable[[int], int] | None = None) -> None:
        self.cfg = cfg
        self.link = link
        self.groups = groups
        self.block_size = block_size
        self.hash_unit = hash_unit  # vLLM's prefix_match_unit h (KVCacheConfig.hash_block_size); 0 if none
        self.reqs: dict[str, RequestRecord] = {}  # announced and not finished, each in its state
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        # Whether decode chunks are stored (store_decode; "auto" reads the model's chat template once, here).
        self.decode = DecodeStores(cfg.store_decode, model_config, self.stats)
        # Bytes of one chunk's entries, every group and rank, at a chunk size (the counters of chunks not stored).
        self.chunk_bytes = chunk_bytes or (lambda _c: 0)
        self.keys = ChunkKeys(cfg.chunk_size, self.decode.store, self._uncacheable)
        self.turn_ends = TurnEnds()  # where finished requests' stored states lie (turn_end_states)
        self.strict = os.environ.get(STRICT_ENV) == "1"
        # Per-request events (timeline_path; hkvd.shim.timeline): its step is kept by the scheduler side.
        self.timeline = Timeline(cfg.timeline_path) if cfg.timeline_path else OFF
        self._invalid_logged = False

    @property
    def chunk_size(self) -> int:
        """The daemon's chunk size C (from its RegisterAck; the setting's until the first connection)."""
        return self.keys.chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        self.keys.chunk_size = value

    @property
    def port(self) -> DaemonPort | None:
        """The daemon, while connected."""
        return self.link.client

    def partial_on(self) -> bool:
        return partial.enabled(self.groups, self.block_size, self.chunk_size)

    def fire(self, st: RequestRecord, event: Event) -> bool:
        """Apply ``event`` to ``st``. A transition the table lacks raises with ``strict``; otherwise it is
        logged (once at ERROR) and the request fails safely: recomputed, never loaded. False then."""
        try:
            st.fire(event)
            if event is Event.ANSWERED:  # every path to an answer (reply, probe, miss, timeout) passes here
                self.timeline.note(st.req_id, "lookup_answered")
            return True
        except InvalidTransition as e:
            if self.strict:
                raise
            log = logger.debug if self._invalid_logged else logger.error
            self._invalid_logged = True
            log("%s", e)
            if st.lease_id and not st.lease_used:
                self.release(st.lease_id)
            st.fail_safe(event)
            return False

    def answer(self, st: RequestRecord, hit_chunks: int, part: tuple[int, bytes] | None = None) -> None:
        """The hit is known: ``hit_chunks`` (the last one partial where ``part`` says so)."""
        st.hit_chunks, st.partial = hit_chunks, part
        self.fire(st, Event.ANSWERED)

    def release(self, lease_id: int) -> None:
        port = self.port
        if not lease_id or port is None:
            return
        try:
            port.release(lease_id)
        except Exception as e:
            self.link.lost(e)

    def _uncacheable(self, st: RequestRecord, exc: Uncacheable) -> None:
        self.stats["uncacheable"] += 1
        port = self.port
        if port is None:
            return
        try:
            port.uncacheable(exc.reason)
        except Exception as e:
            self.link.lost(e)
