# SPDX-License-Identifier: Apache-2.0
"""Multi-turn chat inside real vLLM (CPU): what hkvd serves each turn against vLLM's own prefix cache.

Each turn's prompt is the previous prompt, plus the engine's answer, plus a new user message
(tests/shim/e2e_run.py, conversation mode). One engine per case runs the conversations twice:

1. hkvd phase: vLLM's local cache is emptied before every turn, so every hit comes from hkvd.
2. reference phase: the daemon is stopped (every lookup misses) and vLLM's local cache is kept, so
   every hit comes from vLLM's own prefix cache, as in an engine without hkvd.

Later turns must get at least vLLM's hits from hkvd, which needs the answer's chunks (stored while
the engine decodes), and the same greedy tokens: where the hit boundaries are the same, the restored
bytes are the same decode-time bytes. The daemon runs at ``hkvd serve``'s default chunk size (256
tokens, twice vLLM's block): the shim registers vLLM's block size instead, else the short-answer
conversation's third turn gets 768 tokens where vLLM's own cache serves 896 (its second prompt, 940
tokens, ends in a 256-token chunk that its 40-token answer does not fill).

Cases: Qwen3-Next (GDN, align mode) at one block per step with a state retained every block, and at
vLLM's defaults (4096-token budget, retention 0); Gemma3 (sliding window) at vLLM's default budget with
sliding-window tails retained every block. Each costs one engine (~40 s start) plus two phases of
about 500 decode steps. Qwen3-Next runs with ``turn_end_states`` off: with it, hkvd resumes each turn at
the previous turn's end, beyond vLLM's own cache, where the bytes are compared with a no-cache run's
instead (tests/shim/test_prefix_match_unit_vllm.py).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

BLOCK = 128
DAEMON_DEFAULT_CHUNK = 256  # hkvd serve --chunk-size default


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


# Answers of 200 tokens (the last turn's answer is never reused: 16 tokens to compare are enough).
CONVERSATIONS = [
    {"first": _seq(600, 7, 3), "users": [_seq(150, 11, 5), _seq(150, 11, 9)], "max_tokens": [200, 200, 16]},
    # Short answers: the second prompt (940 tokens) ends inside a 256-token chunk the answer does not fill.
    {"first": _seq(600, 19, 4), "users": [_seq(300, 23, 1), _seq(300, 23, 8)], "max_tokens": [40, 40, 16]},
]

# case -> (engine settings, hits per conversation and turn from hkvd, and from vLLM's own cache)
CASES = {
    "qwen3_next-N-retention": (
        {"model": "qwen3_next", "max_num_batched_tokens": BLOCK, "retention": BLOCK,
         "extra": {"turn_end_states": False}},
        [[0, 768, 1024], [0, 512, 896]],
        [[0, 768, 1024], [0, 512, 896]],
    ),
    "qwen3_next-vllm-defaults": (  # states only at each prompt's last boundary, in vLLM and in hkvd
        {"model": "qwen3_next", "max_num_batched_tokens": 0, "extra": {"turn_end_states": False}},
        [[0, 512, 896], [0, 512, 896]],
        [[0, 512, 896], [0, 512, 896]],
    ),
    "gemma3-default-budget": (
        {"model": "gemma3", "max_num_batched_tokens": 0, "retention": BLOCK},
        [[0, 768, 1024], [0, 512, 896]],
        [[0, 768, 1024], [0, 512, 896]],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_later_turns_hit_at_least_vllms_own_cache(case, tiny_models, outputs, daemon_factory, engine_runner,
                                                  tmp_path) -> None:
    settings, want_hkvd, want_vllm = CASES[case]
    d = daemon_factory(DAEMON_DEFAULT_CHUNK)
    args = {**settings, "model": str(tiny_models[settings["model"]]), "socket": d.socket,
            "conversations": CONVERSATIONS, "ignore_eos": True, "logprobs": 2,
            "llm": {"max_model_len": 2048}, "phases": [{"reset": True}, {"reset": False}],
            "pause_before": [1], "sync_dir": str(tmp_path)}
    res = engine_runner(args, timeout_s=900, on_pause=lambda i: d.stop())
    hkvd, own = res["phases"]
    got_hkvd = [[t["num_cached_tokens"] for t in conv] for conv in hkvd]
    got_vllm = [[t["num_cached_tokens"] for t in conv] for conv in own]
    print(f"{case}: hits from hkvd {got_hkvd}, from vLLM's own cache {got_vllm}")
    assert got_vllm == want_vllm, res["log"][-3000:]
    for conv_h, conv_v in zip(got_hkvd, got_vllm, strict=True):
        assert all(h >= v for h, v in zip(conv_h, conv_v, strict=True)), (got_hkvd, got_vllm)
    assert got_hkvd == want_hkvd, res["log"][-3000:]
    # Same hit boundaries, same bytes: the same greedy tokens, turn after turn.
    deltas = [outputs.compare(v, h, f"{case} conversation {c} turn {t + 1}")
              for c, (conv_h, conv_v) in enumerate(zip(hkvd, own, strict=True))
              for t, (h, v) in enumerate(zip(conv_h, conv_v, strict=True))]
    print(f"{case}: max logprob delta {max(deltas):.5f}")
