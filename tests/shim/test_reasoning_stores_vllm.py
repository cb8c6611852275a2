# SPDX-License-Identifier: Apache-2.0
"""A reasoning model's chat inside real vLLM (CPU): the thinking part its template drops is not stored.

The model is the tiny Qwen3-Next with a chat template that drops an earlier answer's ``<think>...</think>``
part from the next prompt (tests/shim/tiny_models.py, ``qwen3_next_think``); the shim runs with its default
``store_decode: "auto"``, which reads that template when the engine starts. Random weights never think, so
each turn's prompt ends with ``<think>`` and the engine's whole output stands for the thinking part; the
next turn's prompt is built as the template would: the previous prompt without ``<think>``, a fixed answer,
the next user message (tests/shim/e2e_run.py, ``"think"``).

Four conversations share one engine: A says nothing (the template decides: not stored), B asks
``{"hkvd": {"store_decode": true}}`` (stored), C asks ``false`` (not stored, reason ``request``), D sends a
value that is not a bool (one warning, the template decides). Phase 1 runs them with every hit from hkvd;
then the daemon is stopped and phase 2 recomputes every turn, the reference the greedy tokens must equal.

Checked: the daemon holds exactly the prompts' chunks, B's generated chunks and B's turn ends
(full-attention entries, one per chunk key, counted from the chunk keys of each turn's tokens); vLLM's
``vllm:hkvd_decode_*_not_stored`` counters name A's, C's and D's generated chunks by reason; every later turn
hits all of the previous prompt's whole chunks (all it shares with the next prompt), whether its thinking was
stored or not.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's block for the tiny Qwen3-Next; the daemon's chunk size
OPEN = [5, 6]  # the generation prompt's "<think>\n"
MAX_TOKENS = [100, 100, 4]  # each turn generates at least one whole chunk past its prompt


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 480 + 20 for i in range(n)]  # ids 0..3 are special tokens; 5, 6 are OPEN


def _conversation(k: int, params: dict[str, Any] | None, turns: int = 3) -> dict[str, Any]:
    conv: dict[str, Any] = {
        "first": _seq(300, 7 + 4 * k, 3 + k), "users": [_seq(100, 11 + 2 * k, 5 + t) for t in range(turns - 1)],
        "think": {"open": OPEN, "answers": [_seq(24, 13 + k, t + 1) for t in range(turns - 1)]},
        "max_tokens": MAX_TOKENS[:turns],
    }
    if params is not None:
        conv["kv_transfer_params"] = params
    return conv


CONVERSATIONS = [
    _conversation(0, None),  # A: the template decides
    _conversation(1, {"hkvd": {"store_decode": True}}),  # B
    _conversation(2, {"hkvd": {"store_decode": False}}, turns=2),  # C
    _conversation(3, {"hkvd": {"store_decode": "no"}}, turns=1),  # D: not a bool
]
STORED = {1}  # the conversations whose generated chunks are stored
REASONS = {0: "template", 2: "request", 3: "template"}


def _prompts(conv: dict[str, Any]) -> list[list[int]]:
    """Each turn's prompt, as tests/shim/e2e_run.py builds it."""
    base, out = list(conv["first"]), []
    for t in range(len(conv["max_tokens"])):
        if t:
            base += conv["think"]["answers"][t - 1] + conv["users"][t - 1]
        out.append(base + OPEN)
    return out


def _expected_keys(turns: list[dict[str, Any]], conv: dict[str, Any], decode: bool
                   ) -> tuple[set[bytes], int, int]:
    """(the chunk keys the conversation's turns leave in the daemon, its turn ends stored, the chunks it generated
    and did not store)."""
    from hkvd.transport.keys import chunk_keys

    keys: set[bytes] = set()
    turn_ends = not_stored = 0
    for prompt, turn in zip(_prompts(conv), turns, strict=True):
        assert turn["prompt_len"] == len(prompt)
        keys.update(chunk_keys(prompt, BLOCK))
        computed = len(prompt) + len(turn["tokens"]) - 1  # the last token sampled is never computed
        if decode:
            keys.update(chunk_keys((prompt + turn["tokens"])[:computed // BLOCK * BLOCK], BLOCK))
            # turn_end_states: the state after its last computed token, a partial chunk (full-attention page and
            # Mamba state under a key of its own), where that is inside a chunk.
            turn_ends += bool(computed % BLOCK)
        else:
            not_stored += computed // BLOCK - len(prompt) // BLOCK
    return keys, turn_ends, not_stored


def test_thinking_dropped_by_the_template_is_not_stored(tiny_lib, models_root, outputs, daemon_factory,
                                                        engine_runner, tmp_path) -> None:
    from hkvd.shim.testing.launcher import daemon_status

    model = tiny_lib.build("qwen3_next_think", models_root)
    d = daemon_factory(BLOCK)
    held: dict[str, Any] = {}

    def stop_daemon(_phase: int) -> None:
        held.update(daemon_status(d.socket)["index"])
        d.stop()

    args = {"model": str(model), "socket": d.socket, "conversations": CONVERSATIONS, "ignore_eos": True,
            "logprobs": 2, "max_num_batched_tokens": BLOCK, "retention": BLOCK, "vllm_metrics": True,
            "llm": {"max_model_len": 2048}, "phases": [{"reset": True}, {"reset": True}], "pause_before": [1],
            "sync_dir": str(tmp_path)}
    res = engine_runner(args, timeout_s=800, on_pause=stop_daemon)
    log = res["log"]
    hkvd, ref = res["phases"]
    assert log.count("['store_decode']='no' is not a bool") == 2, log[-3000:]  # D's request, once per phase

    # The daemon holds the prompts' chunks and B's generated chunks, no more.
    want: set[bytes] = set()
    turn_ends = 0
    not_stored = dict.fromkeys(("template", "request", "config"), 0)
    for c, conv in enumerate(CONVERSATIONS):
        keys, ends, n = _expected_keys(hkvd[c], conv, c in STORED)
        want |= keys
        turn_ends += ends
        if c in REASONS:
            assert n > 0, f"conversation {c} generated no whole chunk: the test checks nothing"
            not_stored[REASONS[c]] += n
    print(f"daemon index {held}; chunk keys expected {len(want)} and {turn_ends} turn ends; not stored {not_stored}")
    assert held["by_kind"].get("full") == len(want) + turn_ends, (held, len(want), turn_ends)
    metrics = res["vllm_metrics"][0]
    for reason, n in not_stored.items():
        assert metrics.get(f"vllm:hkvd_decode_chunks_not_stored{{{reason}}}", 0) == n, (reason, metrics)
    assert metrics.get("vllm:hkvd_decode_bytes_not_stored{template}", 0) > 0, metrics

    # Every later turn hits the previous prompt's whole chunks (without <think>): all it shares with it.
    got = [[t["num_cached_tokens"] for t in conv] for conv in hkvd]
    want_hits = [[0] + [(len(p) - len(OPEN)) // BLOCK * BLOCK for p in _prompts(conv)[:-1]]
                 for conv in CONVERSATIONS]
    print(f"hits {got}, expected {want_hits}")
    assert got == want_hits
    assert all(t["num_cached_tokens"] == 0 for conv in ref for t in conv)  # the reference computed everything
    deltas = [outputs.compare(r, h, f"conversation {c} turn {t + 1}")
              for c, (conv_h, conv_r) in enumerate(zip(hkvd, ref, strict=True))
              for t, (h, r) in enumerate(zip(conv_h, conv_r, strict=True))]
    print(f"max logprob delta {max(deltas):.5f}")
