"""The ``fast`` tier (``make test-fast``, ``pytest -m fast tests``): the unit modules that run in-process.

A module is listed here when none of its tests starts a subprocess (``hkvd serve``, a child engine,
``python -c``), imports vLLM, or needs a network namespace: together they run in well under a
minute on two cores. The unit modules left out (a subprocess each, or vLLM) run in ``make test-unit``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

FAST_MODULES = frozenset({
    "test_bench_report.py",
    "test_bench_serving.py",
    "test_chains.py",
    "test_client_io.py",
    "test_control_server.py",
    "test_disk_tier.py",
    "test_engine_metrics.py",
    "test_heap.py",
    "test_hybrid.py",
    "test_index_writes.py",
    "test_layers.py",
    "test_layout.py",
    "test_leases.py",
    "test_options.py",
    "test_pd.py",
    "test_peer_links.py",
    "test_peer_units.py",
    "test_pool.py",
    "test_pool_sizing.py",
    "test_prefault.py",
    "test_promotion.py",
    "test_rank_siblings.py",
    "test_replies.py",
    "test_service.py",
    "test_snapshots.py",
    "test_stat_fields.py",
    "test_usable_prefix.py",
    "test_validation.py",
    "test_wire.py",
})
# Left out: test_bench, test_cluster_value, test_cma, test_descriptors, test_packaging (subprocesses),
# test_identity (vLLM and a subprocess), test_routing_keys (vLLM), test_results (a real hkvd serve).
# test_connector_metadata, test_connector_stats (vLLM).

missing = sorted(m for m in FAST_MODULES if not (HERE / m).is_file())
if missing:  # a renamed module would leave the tier silently
    raise pytest.UsageError(f"tests/unit/conftest.py lists fast modules that do not exist: {', '.join(missing)}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    fast = pytest.mark.fast
    for item in items:
        if item.path.parent == HERE and item.path.name in FAST_MODULES:
            item.add_marker(fast)
