# SPDX-License-Identifier: Apache-2.0
"""In-step loads inside real vLLM (CPU): the worker copies a leased hit from its map of the daemon's pool before
the forward of the step that plans it (``in_step_loads``; docs/design.md, "In-step loads").

Each model runs three engines (tests/shim/e2e_run.py, one process each, vLLM's local cache reset before every
prompt): one without the connector (the reference), then two with in-step loads on against one daemon. Every
hit's greedy tokens and logprobs must equal the reference's bit for bit (``_same_outputs``), so a state left
out, or a block zeroed after its copy (vLLM zeroes a synchronous load's new attention blocks on hybrid models),
fails the test. Steps are counted from the connector's timeline (tests/shim/step_counts.py): an in-step hit
runs its forward in its first scheduling, like a miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


BASE, ALT, OTHER = _seq(900, 7, 3), _seq(900, 13, 1), _seq(200, 11, 5)
P1 = BASE[:601]  # 4 full chunks + tail
P2 = BASE[:400] + OTHER[:150]  # shares 3 chunks with P1
P3 = ALT[:900]  # 7 full chunks
P4 = ALT[:300] + OTHER[:100]  # shares 2 chunks with P3 (its state at 256 needs retention)
PROMPTS = [P1, P2, P3, P4]


def _in_step(timeline: Path | None = None) -> dict[str, object]:
    extra: dict[str, object] = {"in_step_loads": True, "lookup_wait_s": 5.0, "lookup_wait_max_s": 5.0}
    if timeline is not None:
        extra["timeline_path"] = str(timeline)
    return extra


def _same_outputs(outputs, reference: dict, run: dict, what: str) -> None:  # type: ignore[no-untyped-def]
    """Greedy tokens and logprobs bit for bit: an in-step hit computes exactly what the reference computed (same
    chunk boundaries, the same bytes). The tiny models' random weights make a wrong state hard to see in the
    tokens: with the Qwen3-Next states left out of the copies entirely, every token still matched and the
    logprobs moved by one bf16 ulp (0.004 nats; 2-vCPU VM, 2026-12-03), within the tolerance of a comparison
    across chunk boundaries (``outputs.LOGPROB_TOL``) but not zero."""
    for i, (ref, got) in enumerate(zip(reference["results"], run["results"], strict=True)):
        assert got["tokens"] == ref["tokens"], f"{what} prompt {i}: greedy tokens differ from the reference"
        delta = outputs.compare(ref, got, f"{what} prompt {i}")
        assert delta == 0.0, f"{what} prompt {i}: logprobs differ from the reference by {delta:.5f}"


@pytest.mark.parametrize(("model", "cold_hits", "warm_hits", "extra_args"), [
    ("qwen3_next", [0, 384, 0, 256], [512, 512, 896, 384], {"retention": BLOCK}),
    ("gemma3", [0, 384, 0, 256], [512, 512, 896, 384], {}),
])
def test_in_step_hits_equal_the_reference_and_take_no_step(model, cold_hits, warm_hits, extra_args, tiny_models,
                                                           outputs, daemon_factory, engine_runner, step_counts,
                                                           tmp_path: Path) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    common = {"model": str(tiny_models[model]), "socket": d.socket, "max_num_batched_tokens": BLOCK, **extra_args}
    reference = engine_runner({**common, "prompts": PROMPTS, "connector": False})

    cold = engine_runner({**common, "prompts": PROMPTS, "extra": _in_step(tmp_path / "cold.jsonl"),
                          "vllm_metrics": True})
    assert outputs.hits(cold) == cold_hits, cold["log"][-3000:]
    steps = step_counts.check(str(tmp_path / "cold.jsonl"), cold["async_scheduling"])
    assert steps["in_step"] == [0, 0] and steps["hits"] == [], steps
    assert cold["vllm_metrics"]["vllm:hkvd_in_step_loads"] == 2, cold["vllm_metrics"]

    warm = engine_runner({**common, "prompts": PROMPTS, "extra": _in_step(), "vllm_metrics": True})
    assert outputs.hits(warm) == warm_hits, warm["log"][-3000:]
    wm = warm["vllm_metrics"]
    assert wm["vllm:hkvd_in_step_loads"] == 4 and wm["vllm:hkvd_loads{ok}"] == 0, wm
    assert wm["vllm:hkvd_loaded_bytes"] > 0, wm

    _same_outputs(outputs, reference, cold, f"{model} cold")
    _same_outputs(outputs, reference, warm, f"{model} warm")
