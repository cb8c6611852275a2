# SPDX-License-Identifier: Apache-2.0
"""Loads never hold the engine: real vLLM (CPU), a real ``hkvd serve``, a long prefix loading while
another request decodes.

One engine process (``bench.load_overlap_engine``, the bench's driver) computes and stores two
prompts of 4096 + 1 tokens on ``wide_kv`` (32 KiB of KV per token: each prefix is a 128 MiB load),
resets vLLM's prefix cache, then decodes request A while the two prompts arrive one after the other
and load their prefixes from hkvd. Between steps the driver reads the worker's loads in flight.

What must hold (ordering, never wall-clock time):

- every load is still in flight when the step that submitted it ends: ``start_load_kv`` returns
  before the daemon's reply (a load that blocked its step would end inside it);
- A is scheduled, and gets a token, in a step that begins while each load is in flight;
- every loaded prompt hit all 4096 tokens in hkvd (``loaded_bytes`` is both prefixes' bytes), and its
  answer equals the one computed without hkvd (greedy tokens, logprobs within the tolerance).

~2 minutes on 2 cores: the engine start and the two 4096-token prefills.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
# bench/ is a folder of the checkout, not a package: on sys.path only while it imports.
sys.path.insert(0, str(ROOT))
try:
    from bench import load_overlap
finally:
    sys.path.remove(str(ROOT))

PREFIX = 4096
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 128 * 2  # wide_kv: layers x (K, V) x KV heads x head dim x bf16


def _loads(steps: list[dict]) -> list[list[dict]]:
    """The steps of each load, from the one that submitted it to the one that read its reply."""
    out: list[list[dict]] = []
    for s in steps:
        if s["started"]:
            assert s["started"] == 1, "one prompt loads at a time in this run"
            out.append([s])
        elif out and s["busy"] and out[-1][-1]["in_flight"]:
            out[-1].append(s)
    return out


def test_a_decoding_request_steps_while_a_long_prefix_loads(tiny_lib, models_root, outputs, daemon_factory) -> None:
    model = tiny_lib.build("wide_kv", models_root)
    d = daemon_factory(128, "--l1-size-gb", "0.5")
    args = load_overlap.engine_args(str(model), d.socket, rounds=1, per_round=2, prefix_tokens=PREFIX,
                                    answer_tokens=4)
    res = load_overlap.run_engine(args, os.environ.get("HKVD_TEST_OMP_BIND", "0-1"), log=print)
    log = res.pop("log")

    load_overlap.check(res, PREFIX)  # every prompt hit its 4096 tokens and answered as computed
    for p in res["rounds"][0]["prefixes"]:
        outputs.compare(p["reference"], p["loaded"], "loaded prompt")
    stats = res["loads"]
    assert stats["loads_ok"] == 2 and stats["loads_failed"] == 0, log[-3000:]
    assert stats["loaded_bytes"] == 2 * PREFIX * KV_BYTES_PER_TOKEN  # from hkvd, not vLLM's own cache

    loads = _loads(res["rounds"][0]["steps"])
    assert len(loads) == 2
    for i, span in enumerate(loads):
        submit, later = span[0], span[1:]
        assert submit["in_flight"] == 1, f"load {i} ended inside the step that submitted it: it held the step"
        assert later and later[-1]["in_flight"] == 0, f"load {i}: no step read its reply"
        assert all(s["busy"] for s in later)
        # A's forward ran while the daemon was still copying (or before its reply was read).
        assert sum(s["a"] for s in later) >= 1, f"load {i}: A got no token while it was in flight"
    print("A's tokens in steps begun with a load in flight:", [sum(s["a"] for s in span[1:]) for span in loads],
          "; steps wholly inside:", [sum(1 for s in span[1:] if s["in_flight"]) for span in loads])
