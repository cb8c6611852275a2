"""KV events as vLLM publishes them, numbered and batched, with a ring of recent batches.

Format
    A batch is the msgpack of ``[ts, [event, ...]]`` (vLLM's ``KVEventBatch``, array-like; the
    data-parallel rank is left out); an event is a map tagged ``"type": "BlockStored" |
    "BlockRemoved" | "AllBlocksCleared"`` with vLLM's field names, fields at their default left
    out. vLLM's own classes (``vllm.distributed.kv_events``) decode it; this module never imports
    vLLM. Each batch gets the next sequence number (from 0, one per batch, as vLLM's publisher
    numbers them) and a topic.

Batching
    ``add`` stages events; the first staged event schedules ``flush`` on the event loop, so the
    events of one loop turn go out together, one batch per (engine layout, topic). Consecutive
    ``BlockStored`` events of the same group, medium and adapter whose blocks continue each other's
    chain are merged into one event, and consecutive ``BlockRemoved`` events of the same group and
    medium too (``merge``): a prompt of 40 chunks stored at once is one event per group, as in vLLM.

Ring
    The last ``ring_batches`` batches stay in memory, each tagged with the layout (the rank-0
    fingerprint) whose chunks it names. ``since`` serves an engine's scheduler its layout's batches
    from a sequence number on (the connector's path, ``KVEventsPoll``). Batches without a layout
    (``AllBlocksCleared`` when the daemon starts) are for the node-level subscribers only.

Threading
    Event loop only. ``sink`` gets each batch as it is made (the ZMQ publisher's queue: it must not
    block).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

# Media names: hkvd's tiers, beside vLLM's "GPU" / "CPU" (docs/routing.md).
MEDIUM_POOL = "HKVD_POOL"
MEDIUM_DISK = "HKVD_DISK"
MEDIUM_CLUSTER = "HKVD_CLUSTER"
MEDIA = (MEDIUM_POOL, MEDIUM_DISK, MEDIUM_CLUSTER)

DEFAULT_RING_BATCHES = 10_000  # vLLM's buffer_steps default
POLL_MAX_BYTES = 4 << 20  # one KVEvents reply: well under the 16 MiB frame


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; encoded as a map with a "type" tag (vLLM's KVCacheEvent encoding)."""


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class Batch(NamedTuple):
    seq: int
    world: bytes  # the layout (rank-0 fingerprint) whose chunks it names; b"" for none
    topic: bytes
    payload: bytes  # msgpack of the KVEventBatch
    events: int


class PollAnswer(NamedTuple):
    next: int
    lost: int
    payloads: list[bytes]


def merge(events: list[Event]) -> list[Event]:
    """Events that continue each other, as one (see the module docstring); mutates ``events``' lists.

    The events are first grouped by (group, medium), stably: each group and medium is its own chain
    of stores and removals, so only their order among themselves matters, and it is kept."""
    events = sorted(events, key=_stream)
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, BlockStored) and isinstance(last, BlockStored) and _continues(last, ev):
            n_last, n_ev = len(last.block_hashes), len(ev.block_hashes)
            last.block_hashes.extend(ev.block_hashes)
            last.token_ids.extend(ev.token_ids)
            if last.extra_keys is not None or ev.extra_keys is not None:
                last.extra_keys = (last.extra_keys or [None] * n_last) + (ev.extra_keys or [None] * n_ev)
            continue
        if (isinstance(ev, BlockRemoved) and isinstance(last, BlockRemoved) and last.medium == ev.medium
                and last.group_idx == ev.group_idx):
            last.block_hashes.extend(ev.block_hashes)
            continue
        out.append(ev)
    return out


def _stream(ev: Event) -> tuple[int, str]:
    if isinstance(ev, AllBlocksCleared):
        return (-1, "")
    return (ev.group_idx if ev.group_idx is not None else -1, ev.medium or "")


def _continues(a: BlockStored, b: BlockStored) -> bool:
    return (b.parent_block_hash == a.block_hashes[-1] and a.group_idx == b.group_idx and a.medium == b.medium
            and a.block_size == b.block_size and a.lora_id == b.lora_id and a.lora_name == b.lora_name
            and a.kv_cache_spec_kind == b.kv_cache_spec_kind
            and a.kv_cache_spec_sliding_window == b.kv_cache_spec_sliding_window
            and len(a.token_ids) == a.block_size * len(a.block_hashes))


class EventLog:
    def __init__(self, ring_batches: int = DEFAULT_RING_BATCHES, *,
                 sink: Callable[[Batch], None] | None = None,
                 schedule: Callable[[Callable[[], object]], object] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``schedule(fn)`` runs ``fn`` soon on the event loop (``loop.call_soon``); None: the owner
        calls ``flush`` itself (tests)."""
        self.sink = sink
        self.schedule = schedule
        self.clock = clock
        self._ring: collections.deque[Batch] = collections.deque(maxlen=max(ring_batches, 1))
        self._staged: dict[tuple[bytes, bytes], list[Event]] = {}
        self._flush_scheduled = False
        self._encoder = msgspec.msgpack.Encoder()
        self.next_seq = 0
        self.events = 0  # published since start
        self.batches = 0

    # ---- writing -------------------------------------------------------------------------------
    def add(self, world: bytes, topic: bytes, event: Event) -> None:
        """Stage ``event`` for the next batch of ``(world, topic)``."""
        staged = self._staged.get((world, topic))
        if staged is None:
            staged = self._staged[(world, topic)] = []
        staged.append(event)
        if not self._flush_scheduled and self.schedule is not None:
            self._flush_scheduled = True
            self.schedule(self.flush)

    def flush(self) -> list[Batch]:
        """Number, encode and keep every staged batch; hand each to ``sink``. The owner may call it any time
        (a store flushes before its reply); a flush already scheduled then finds nothing."""
        self._flush_scheduled = False
        staged, self._staged = self._staged, {}
        out = []
        ts = self.clock()
        for (world, topic), events in staged.items():
            events = merge(events)
            payload = self._encoder.encode(_EventBatch(ts, events))
            batch = Batch(self.next_seq, world, topic, payload, len(events))
            self.next_seq += 1
            self.events += len(events)
            self.batches += 1
            self._ring.append(batch)
            out.append(batch)
            if self.sink is not None:
                self.sink(batch)
        return out

    # ---- reading (the connector's path) ---------------------------------------------------------
    def since(self, world: bytes, since: int, max_batches: int, max_bytes: int = POLL_MAX_BYTES) -> PollAnswer:
        """``world``'s batches numbered ``since`` and later, oldest first, at most ``max_batches`` and
        about ``max_bytes``. ``since`` past the newest (a poller of an earlier daemon run) reads from
        the oldest kept."""
        ring = self._ring
        if not ring:
            return PollAnswer(self.next_seq if since > self.next_seq else since, 0, [])
        oldest = ring[0].seq
        if since > self.next_seq:
            since = 0
        lost = max(oldest - since, 0)
        start = max(since, oldest)
        payloads: list[bytes] = []
        size = 0
        nxt = start
        for batch in itertools.islice(ring, start - oldest, None):
            if batch.world == world:
                if len(payloads) >= max_batches or (payloads and size + len(batch.payload) > max_bytes):
                    break
                payloads.append(batch.payload)
                size += len(batch.payload)
            nxt = batch.seq + 1
        return PollAnswer(nxt, lost, payloads)

    def kept(self, since: int = 0) -> list[Batch]:
        """The kept batches numbered ``since`` and later, of every layout."""
        return [b for b in self._ring if b.seq >= since]

    def __len__(self) -> int:
        return len(self._ring)
