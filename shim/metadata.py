# SPDX-License-Identifier: Apache-2.0
"""What the scheduler side hands the worker side each step (pickled by vLLM).

An item is the wire's ``Item(group_id, chunk_index, key, block_ids, parent)`` (docs/design.md,
"Items"): full/swa items carry chunk_size / block_size block ids, a mamba item one block id
holding the state after ``(chunk_index + 1) * chunk_size`` tokens. Block id 0 (vLLM's null
block) never appears in an item.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hkvd.shim.pd import PullSpec
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.kv import Item


def item_blocks(items: list[Item]) -> set[int]:
    return {b for it in items for b in it.block_ids}


@dataclass(slots=True)
class LoadJob:
    """A load, done in this step's ``start_load_kv`` while its request waits (WAITING_FOR_REMOTE_KVS)."""

    req_id: str
    lease_id: int
    items: list[Item]
    # Every block the load writes (a failed load is reported per request: vLLM recomputes it).
    block_ids: list[int]
    # Prefill/decode: pull these chunks from the prefill engine's daemon first (hkvd.shim.pd).
    pull: PullSpec | None = None


@dataclass(slots=True)
class StoreJob:
    """Attention chunks that are complete after this step's forward (copied after it)."""

    req_id: str
    items: list[Item]
    # vLLM's names of the chunks, one per chunk key, sent with the store for KV events (docs/routing.md).
    notes: list[BlockNote] = field(default_factory=list)


@dataclass(slots=True)
class HkvdConnectorMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    # Mamba boundary states offered this step: (req_id, item). Sent as one StepEvent.
    offers: list[tuple[str, Item]] = field(default_factory=list)
    offer_notes: list[BlockNote] = field(default_factory=list)  # the offered chunks' notes, as StoreJob.notes
    # Blocks this step's forward (or vLLM's zeroing before it) may write: newly allocated ones.
    # In-flight copies out of them must finish first (handle_preemptions).
    fence_blocks: set[int] = field(default_factory=set)
    # Requests whose block free the scheduler delayed (request_finished_all_groups -> True);
    # the worker reports each in finished_sending once its copies are done or failed.
    delayed_free: list[str] = field(default_factory=list)
