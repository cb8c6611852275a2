# SPDX-License-Identifier: Apache-2.0
"""The connector's path of KV events: hkvd's events for this engine, handed to vLLM's publisher.

Role
    An engine started with ``kv_events_config`` publishes its own GPU events and whatever its
    connector's ``take_events`` returns, in the same batches. The scheduler side polls the daemon
    (``KVEventsPoll``) for the event batches of its layout: what hkvd's tiers hold of the chunks
    this engine can load (stored by it, by an earlier run of it, or by another engine of the same
    layout on the node), decodes them with vLLM's own classes and returns them from
    ``take_events``. The events carry hkvd's media (``HKVD_POOL``, ``HKVD_DISK``,
    ``HKVD_CLUSTER``), never ``GPU``, so a consumer keeps them apart from vLLM's own.

Polling
    At most one poll is in flight; a new one is sent from ``take_events`` (once per engine step)
    at most every ``interval_s``, and its answer is read by the scheduler side's next pump. The
    first poll of a daemon run asks from sequence number 0: the daemon's ring then replays what it
    still keeps of this layout's history. A later poll continues from the answer's ``next``;
    batches the daemon no longer kept (``lost``) are counted.

Daemon restarts
    The feed remembers the hashes it announced per (medium, group). When the daemon it reads from
    changes (a new ``server_id``), everything the old one announced is withdrawn with
    ``BlockRemoved`` (its pool is gone) before the new one's events follow.

Threading
    vLLM's scheduler thread. Never blocks: polls are submitted and their answers collected by the
    caller's non-blocking pumps.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hkvd.shim.client import DaemonClient
from hkvd.shim.results import Completion
from hkvd.transport.wire.events import KVEvents

if TYPE_CHECKING:  # vLLM's and msgspec's types, for annotations only
    import msgspec
    from vllm.distributed.kv_events import KVCacheEvent, KVEventBatch
    from vllm.v1.core.kv_cache_utils import ExternalBlockHash

logger = logging.getLogger("hkvd.shim")

DEFAULT_INTERVAL_S = 0.02


class EventFeed:
    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._since = 0
        self._server = ""  # the daemon run the feed reads from
        self._inflight: int | None = None
        self._inflight_client: DaemonClient | None = None
        self._last_poll = -1e9
        self._events: list[KVCacheEvent] = []
        self._held: dict[tuple[str, int | None], set[ExternalBlockHash]] = {}
        self._decoder: msgspec.msgpack.Decoder[KVEventBatch] | None = None
        self.stats = {"polls": 0, "batches": 0, "events": 0, "lost": 0, "errors": 0}

    def maybe_poll(self, client: DaemonClient) -> None:
        """Submit a poll if none is in flight and ``interval_s`` passed; ``client`` is the live connection."""
        server = str(getattr(client, "server_id", ""))
        if server != self._server:
            self._withdraw_all()
            self._server, self._since = server, 0
            self._inflight = None
        if self._inflight is not None and self._inflight_client is client:
            return
        now = time.monotonic()
        if now - self._last_poll < self.interval_s:
            return
        self._last_poll = now
        self._inflight = client.submit_events_poll(self._since)
        self._inflight_client = client
        self.stats["polls"] += 1

    def on_completion(self, c: Completion) -> bool:
        """Take a completion if it answers the feed's poll (True); others are the caller's."""
        if self._inflight is None or c.req_id != self._inflight:
            return False
        self._inflight = None
        if not c.ok:
            self.stats["errors"] += 1
            logger.debug("hkvd: KV events poll failed: %s", c.error)
            return True
        res = c.get(KVEvents)
        if res.lost:
            self.stats["lost"] += res.lost
            logger.warning("hkvd: %d KV event batches were gone from the daemon's buffer before this engine read "
                           "them (raise hkvd serve --kv-events-buffer)", res.lost)
        self._since = res.next
        for payload in res.batches:
            self._take_batch(payload)
        return True

    def lost_connection(self) -> None:
        """The poll in flight will not be answered; the next ``maybe_poll`` sends another."""
        self._inflight = None

    def take(self) -> list[KVCacheEvent]:
        out, self._events = self._events, []
        return out

    # ---- internals -----------------------------------------------------------------------------
    def _take_batch(self, payload: bytes) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        if self._decoder is None:
            import msgspec

            self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            batch = self._decoder.decode(payload)
        except Exception as e:  # a daemon of another version: skip the batch, say so once in a while
            self.stats["errors"] += 1
            logger.debug("hkvd: undecodable KV event batch: %s", e)
            return
        self.stats["batches"] += 1
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                continue  # node-wide; on this engine's stream it would also clear vLLM's own GPU blocks
            if isinstance(ev, BlockStored):
                self._held.setdefault((str(ev.medium), ev.group_idx), set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self._held.get((str(ev.medium), ev.group_idx), set()).difference_update(ev.block_hashes)
            self._events.append(ev)
            self.stats["events"] += 1

    def _withdraw_all(self) -> None:
        if not any(self._held.values()):
            self._held.clear()
            return
        from vllm.distributed.kv_events import BlockRemoved

        for (medium, group), hashes in sorted(self._held.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            if hashes:
                self._events.append(BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group))
        self._held.clear()
