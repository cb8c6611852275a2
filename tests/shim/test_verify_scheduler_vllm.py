# SPDX-License-Identifier: Apache-2.0
"""Sampled verification against vLLM's real ``Scheduler`` (CPU) and a real ``hkvd serve``; no model runs.

The setup of tests/shim/test_scheduler_vllm.py (trace A: one full-attention group, one Mamba group,
block 16, align mode, dense retention; the worker half writes a pattern derived from the prefix into
every block a step computes). A request whose prefix hkvd holds, sampled (``verify_fraction`` 1), is
scheduled at once with no external tokens, never waits for a load, and the chunks it computes go out
as Verify items (attention) and step-event verifies (Mamba states) naming its own blocks.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

sys.path.insert(0, str(Path(__file__).parent))  # pytest's importlib mode: the sibling harness by path
try:
    import test_scheduler_vllm as harness
finally:
    sys.path.pop(0)

BLOCK = harness.BLOCK


@pytest.fixture
def model_dir(tiny_models: dict) -> Any:
    return tiny_models["gemma3"]  # any local model dir: the KVCacheConfig is built by hand


def test_a_sampled_hit_is_computed_and_its_chunks_and_states_are_sent_to_verify(model_dir, daemon_factory) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    vcfg, kvc, sched = harness._make(model_dir, d.socket, extra={"verify_fraction": 1.0})
    run = harness.Runner(vcfg, kvc, sched)
    prompt = list(range(10, 80))  # 70 tokens: chunks 0-3 full
    run.add("r1", prompt)
    run.run()  # nothing cached yet: computed and stored, nothing to verify
    assert not any(m.verifies or m.boundary_verifies for m in run.metas)

    sched.reset_prefix_cache()  # vLLM's local cache is gone; hkvd holds chunks 0-3 and the state at 64
    run.metas.clear()
    run.add("r3", prompt)
    first = run.step()
    # Sampled: no load, no WAITING_FOR_REMOTE_KVS; vLLM schedules it now and computes from token 0.
    assert first.loads == [] and [r.req_id for r in run.last_so.scheduled_new_reqs] == ["r3"]
    assert run.last_so.scheduled_new_reqs[0].num_computed_tokens == 0
    run.step()  # tokens 32-64: chunks 2-3 and the state at 64
    table = sched.kv_cache_manager.get_block_ids("r3")
    run.run()
    checks = [(it.group_id, it.chunk_index, it.block_ids) for m in run.metas for v in m.verifies for it in v.items]
    states = [(r, it.group_id, it.chunk_index) for m in run.metas for r, it in m.boundary_verifies]
    # Every chunk of the hit, from r3's own blocks, where its stores would have gone; nothing of it stored.
    assert checks == [(0, i, [table[0][i]]) for i in range(4)]
    assert states == [("r3", 1, 1), ("r3", 1, 3)]  # the states at 32 and 64 tokens, vLLM's offers of them
    assert not any(it.chunk_index < 4 for m in run.metas for s in m.stores for it in s.items)
    assert not any(it.chunk_index < 4 for m in run.metas for _, it in m.offers)
    w = run.worker._worker  # type: ignore[union-attr]
    totals = w.transfer_totals()
    # Each Verify got an answer (a result, or an error from a daemon that cannot verify): none left behind,
    # and the request's blocks were freed once the daemon had read them.
    jobs = sum(len(m.verifies) for m in run.metas)  # one per step that completed chunks of the hit
    assert jobs >= 1 and totals["verifies"] + totals["verifies_failed"] == jobs
    assert totals["verify_boundary_states"] == 2
    assert "r3" not in sched.requests
    # The daemon compared them with what r1 stored: the same bytes (the pattern of the same prefix).
    assert totals["verifies_failed"] == 0
    assert (totals["verify_checks"], totals["verify_divergences"], totals["verify_missing"]) == (4, 0, 0)
    assert totals["verify_max_error"] == 0.0
    # The Mamba states, compared by the daemon once their step events were confirmed (hkvd status).
    from hkvd.daemon.cli import query_status

    deadline = time.monotonic() + 10
    while True:
        rows = {r["kind"]: r for r in query_status(d.socket, 5.0)["verify"]["groups"]}
        if ("mamba" in rows and rows["mamba"]["checks"] == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (rows["mamba"]["checks"], rows["mamba"]["divergences"], rows["mamba"]["max_error"]) == (2, 0, 0.0), rows
    assert (rows["full"]["checks"], rows["full"]["divergences"]) == (4, 0), rows
