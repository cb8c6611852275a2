# SPDX-License-Identifier: Apache-2.0
"""What the scheduler side hands the worker side each step (pickled by vLLM).

The jobs it carries, and what an item holds, are in ``hkvd.shim.jobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hkvd.shim.jobs import LoadJob, StoreJob, VerifyJob
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.kv import Item


@dataclass(slots=True)
class HkvdConnectorMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    # Mamba boundary states offered this step: (req_id, item). Sent as one StepEvent.
    offers: list[tuple[str, Item]] = field(default_factory=list)
    offer_notes: list[BlockNote] = field(default_factory=list)  # the offered chunks' notes, as StoreJob.notes
    # The tenant of the requests whose states are offered (hkvd.shim.tenants), where not the unsalted share.
    offer_tenants: dict[str, str] = field(default_factory=dict)
    # The tiers the store tiers of those requests leave out (StepEvent.skip_tiers), where any.
    offer_skips: dict[str, int] = field(default_factory=dict)
    # Sampled hits (hkvd.shim.verify): attention chunks to compare instead of storing, one Verify per job,
    # and Mamba boundary states to compare instead of offering, (req_id, item), in this step's StepEvent.
    verifies: list[VerifyJob] = field(default_factory=list)
    boundary_verifies: list[tuple[str, Item]] = field(default_factory=list)
    # Blocks this step's forward (or vLLM's zeroing before it) may write: newly allocated ones.
    # In-flight copies out of them must finish first (handle_preemptions).
    fence_blocks: set[int] = field(default_factory=set)
    # Requests whose block free the scheduler delayed (request_finished_all_groups -> True);
    # the worker reports each in finished_sending once its copies are done or failed.
    delayed_free: list[str] = field(default_factory=list)
