# SPDX-License-Identifier: Apache-2.0
"""How the shim's vLLM tests read and compare engine runs (the results of tests/shim/e2e_run.py).

Greedy tokens are compared strictly; logprobs within ``LOGPROB_TOL``. With random weights a restored
state may differ from a recomputed one by one bf16 ulp (0.0039 nats at these magnitudes), so the
tolerance is a few ulps, not zero. Loaded through the ``outputs`` fixture (tests/shim/conftest.py).
"""

from __future__ import annotations

LOGPROB_TOL = 0.02  # nats; ~5 bf16 ulps at |logprob| ~ 5.5


def hits(res: dict) -> list[int]:
    """Prompt tokens each prompt of a run got from hkvd (vLLM's own cache is reset before each)."""
    return [r["num_cached_tokens"] for r in res["results"]]


def compare(ref: dict, got: dict, what: str) -> float:
    """Assert ``got`` has ``ref``'s greedy tokens and logprobs within the tolerance; return the largest delta."""
    assert got["tokens"] == ref["tokens"], f"{what}: greedy tokens differ: {got['tokens']} vs {ref['tokens']}"
    delta = max((abs(x - y) for x, y in zip(ref["logprobs"], got["logprobs"], strict=True)), default=0.0)
    assert delta <= LOGPROB_TOL, f"{what}: logprob delta {delta:.5f} > {LOGPROB_TOL}"
    return delta
