# SPDX-License-Identifier: Apache-2.0
"""The copies the scheduler side plans and the worker side runs: pure data, pickled by vLLM.

Role
    ``LoadJob`` (blocks to fill from the daemon, optionally after a prefill/decode pull described
    by ``PullSpec``) and ``StoreJob`` (complete chunks to copy out). ``hkvd.shim.metadata`` carries
    them to the workers; ``hkvd.shim.loads`` and ``hkvd.shim.pd`` run them. This module imports
    only the wire's types, so every shim module may import it without closing a circle.

An item is the wire's ``Item(group_id, chunk_index, key, block_ids, parent)`` (docs/design.md,
"Items"): full/swa items carry chunk_size / block_size block ids, a mamba item one block id
holding the state after ``(chunk_index + 1) * chunk_size`` tokens. Block id 0 (vLLM's null
block) never appears in an item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.kv import Item


def item_blocks(items: list[Item]) -> set[int]:
    return {b for it in items for b in it.block_ids}


@dataclass(frozen=True, slots=True)
class PullSpec:
    """What the worker pulls before loading (pickled to the workers with the LoadJob)."""

    peer: str
    keys: list[bytes]
    release_lease: int


@dataclass(slots=True)
class LoadJob:
    """A load: a Retrieve in this step's ``start_load_kv`` while its request waits (WAITING_FOR_REMOTE_KVS),
    or, with ``places``, the worker's own copy before this step's forward."""

    req_id: str
    lease_id: int
    items: list[Item]
    # Every block the load writes (a failed load is reported per request: vLLM recomputes it).
    block_ids: list[int]
    # Prefill/decode: pull these chunks from the prefill engine's daemon first (hkvd.shim.pd).
    pull: PullSpec | None = None
    # An in-step load (hkvd.shim.pool_reads): per rank, ``[group_id, chunk_index, extents]`` of every entry
    # in the pool of the daemon ``pool``; the worker copies them in handle_preemptions. None: a Retrieve.
    places: list[Any] | None = None
    pool: str = ""


@dataclass(slots=True)
class StoreJob:
    """Attention chunks that are complete after this step's forward (copied after it)."""

    req_id: str
    items: list[Item]
    # vLLM's names of the chunks, one per chunk key, sent with the store for KV events (docs/routing.md).
    notes: list[BlockNote] = field(default_factory=list)
    # The request's tenant (hkvd.shim.tenants): the daemon counts the entries against its quota.
    tenant: str = ""
    # A turn-end state: the offset inside its chunk where it ends (Store.turn_end); 0: not one.
    turn_end: int = 0
    # The tiers the request's kv_store_tiers leave out (Store.skip_tiers); 0: every tier.
    skip_tiers: int = 0


@dataclass(slots=True)
class VerifyJob:
    """Chunks a sampled hit's request computed instead of loading (the daemon holds them): sent as one
    ``Verify`` at the point, and with the ordering, a ``StoreJob`` of them would have had."""

    req_id: str
    items: list[Item]
    kind: str = "full"  # the group kind of every item (full | swa): one Verify per kind, so its reply's
    # max_error is that kind's (the daemon's tolerance is per kind too)
