# SPDX-License-Identifier: Apache-2.0
"""hkvd inside real vLLM (CPU) with ``prefix_match_unit`` set below the block size (docs/design.md, "Hit granularity").

With ``prefix_match_unit`` (vLLM's ``hash_block_size``) finer than the block size N, vLLM hashes a prompt
every unit and, for a Mamba model in align mode, can hit inside a block: at the hash-aligned checkpoint
of a prompt's last block. Gemma3 (no Mamba group) keeps its hits at block multiples.

Workload: prompts that share a 200-token system prompt (ending inside the second 128-token block), with
different questions, a prompt sent again, and one extended by a follow-up. One engine per model runs them
three times:

1. hkvd phase: vLLM's local cache is emptied before every prompt, so every hit comes from hkvd.
2. reference phase: the daemon is stopped and vLLM's local cache is kept: vLLM's own prefix cache.
3. no-cache phase: the daemon is still stopped and the local cache emptied before every prompt.

hkvd must serve the engine (no error), hit at least what vLLM's own cache hits, and give the no-cache
run's greedy tokens. For Qwen3-Next the prompt sent again and the extended one hit at 224 (the first
prompt's checkpoint, 7 units into its second block): from vLLM's partial entry, and from hkvd's partial
chunk (``hkvd.shim.partial``); the second question, which shares only the system prompt, hits at 128
from both (nothing checkpointed the system prompt's end).
"""

from __future__ import annotations

import http.client
import json
import socket

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128
UNIT = 32


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


SYSTEM = _seq(200, 7, 3)
A = SYSTEM + _seq(30, 11, 5)
PROMPTS = [
    A,                          # 230 tokens
    SYSTEM + _seq(30, 13, 2),   # same system prompt, another question
    A,                          # sent again
    A + _seq(100, 17, 1),       # A with a follow-up (330 tokens)
]

# model -> hits per prompt: vLLM's own prefix cache (reference phase), hkvd's (hkvd phase), and the usable-prefix
# endpoint's answer once every prompt ran (each prompt's own checkpoint is stored by then: 224 for the 230-token
# prompts, 320 for the 330-token one, inside a block; Gemma3 only whole chunks, the 330-token prompt's 256)
CASES = {
    "qwen3_next": ([0, 128, 224, 224], [0, 128, 224, 224], [224, 224, 224, 320]),
    "gemma3": ([0, 128, 128, 128], [0, 128, 128, 128], [128, 128, 128, 256]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _usable(port: int, model: str, ids: list[int]) -> int:
    """``usable_tokens`` of the daemon's usable-prefix endpoint for ``ids``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/usable_prefix", body=json.dumps({"model": model, "token_ids": ids}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        assert resp.status == 200, out
        return int(out["usable_tokens"])
    finally:
        conn.close()


@pytest.mark.parametrize("model", list(CASES))
def test_prefix_match_unit_serves_and_hits(model, tiny_models, outputs, daemon_factory, engine_runner,
                                           tmp_path) -> None:
    want_vllm, want_hkvd, want_usable = CASES[model]
    assert all(h >= v for h, v in zip(want_hkvd, want_vllm, strict=True))
    port = _free_port()
    d = daemon_factory(BLOCK, "--metrics-port", str(port))
    usable: list[int] = []

    def ask_then_stop(i: int) -> None:  # before the reference phase: what the endpoint says of the prompts
        usable.extend(_usable(port, str(tiny_models[model]), p) for p in PROMPTS)
        d.stop()

    args = {"model": str(tiny_models[model]), "socket": d.socket, "max_num_batched_tokens": 0,
            "conversations": [{"first": p, "users": [], "max_tokens": 6} for p in PROMPTS],
            "ignore_eos": True, "logprobs": 2, "llm": {"max_model_len": 1024, "prefix_match_unit": UNIT},
            "phases": [{"reset": True}, {"reset": False}, {"reset": True}],
            "pause_before": [1], "sync_dir": str(tmp_path)}
    res = engine_runner(args, timeout_s=600, on_pause=ask_then_stop)
    hkvd, own, cold = ([conv[0] for conv in phase] for phase in res["phases"])
    got_hkvd = [r["num_cached_tokens"] for r in hkvd]
    got_vllm = [r["num_cached_tokens"] for r in own]
    print(f"{model}: hits from hkvd {got_hkvd}, from vLLM's own cache {got_vllm}")
    assert [r["num_cached_tokens"] for r in cold] == [0] * len(PROMPTS), res["log"][-3000:]
    assert got_vllm == want_vllm, res["log"][-3000:]
    assert got_hkvd == want_hkvd, res["log"][-3000:]
    assert usable == want_usable, usable
    deltas = [outputs.compare(c, h, f"{model} prompt {i} (hkvd vs no cache)")
              for i, (c, h) in enumerate(zip(cold, hkvd, strict=True))]
    deltas += [outputs.compare(c, v, f"{model} prompt {i} (vLLM's cache vs no cache)")
               for i, (c, v) in enumerate(zip(cold, own, strict=True))]
    print(f"{model}: max logprob delta {max(deltas):.5f}")


# A chat: each turn's prompt is the previous prompt, the engine's 40-token answer and a 3-token message. Turn 1
# (300 tokens) checkpoints at 288, turn 2 (343) at 320: inside a block, where vLLM's next turn hits. hkvd with
# turn-end states hits at each previous turn's end, prompt + answer less the last sampled token (300 + 40 - 1,
# 343 + 40 - 1), also inside a block. The messages are short so that the state loaded at the turn's end shapes
# the answer: the tiny model's Gated-DeltaNet layers forget fast, and a wrong state followed by 100 tokens
# gives the same tokens as the right one. Even so, a state one token off is not told apart; a state from
# another block is.
CHAT = [{"first": _seq(300, 19, 4), "users": [_seq(3, 23, 1), _seq(3, 23, 8)], "max_tokens": [40, 40, 6]}]
CHAT_VLLM = [0, 288, 320]
CHAT_VLLM_BLOCKS = [0, 256, 256]  # vLLM's own cache without prefix_match_unit: block multiples
CHAT_TURN_ENDS = [0, 339, 382]
TIE = 0.008  # nats: two bf16 ulps at these logprobs; a top-2 gap this small may flip with the prefill's chunking


def _same_or_tie(cold: dict, got: dict, what: str, tol: float) -> bool:
    """``got`` has ``cold``'s greedy tokens (True), or they part at a near-tie of either run, with logprobs
    within ``tol`` up to it, its own included (False: later turns' prompts differ, so they are not comparable)."""
    diff = next((i for i, (a, b) in enumerate(zip(cold["tokens"], got["tokens"], strict=True)) if a != b), None)
    upto = len(cold["tokens"]) if diff is None else diff
    delta = max((abs(x - y) for x, y in zip(cold["logprobs"][:upto], got["logprobs"][:upto], strict=True)),
                default=0.0)
    assert delta <= tol, f"{what}: logprob delta {delta:.5f} before any divergence"
    if diff is None:
        return True
    top = abs(cold["logprobs"][diff] - got["logprobs"][diff])  # at a tie both picks have the top logprob
    assert top <= tol, f"{what}: tokens part at step {diff} with top logprobs {top:.5f} apart"
    gap = min(cold["gaps"][diff], got["gaps"][diff])
    assert gap <= TIE, f"{what}: tokens part at step {diff} with a top-2 gap of {gap:.4f}, no tie"
    print(f"{what}: parts from the no-cache run at step {diff}, at a tie (top-2 gap {gap:.4f})")
    return False


@pytest.mark.parametrize(("turn_ends", "unit"), [(True, UNIT), (False, UNIT), (True, None)],
                         ids=["turn_end_states", "checkpoints_only", "turn_end_states_without_unit"])
def test_a_chats_next_turn_hits_where_the_previous_turn_ended(turn_ends, unit, tiny_models, outputs, daemon_factory,
                                                               engine_runner, tmp_path) -> None:
    """Qwen3-Next: with turn-end states (``turn_end_states``, on by default) hkvd serves each turn at the
    previous turn's end, beyond vLLM's own cache, with the no-cache run's tokens in every turn (a Mamba state
    from another block parts from them), with or without ``prefix_match_unit`` (without it vLLM's own cache
    hits at block multiples only); without them, at the previous prompt's checkpoint, as vLLM's own
    cache does, with the same tokens and logprobs. Against a no-cache run, a hit at a checkpoint changes the
    prefill's chunking, which may move a logprob by a bf16 ulp: the tokens match or part at a near-tie."""
    d = daemon_factory(BLOCK)
    llm = {"max_model_len": 1024, **({"prefix_match_unit": unit} if unit else {})}
    args = {"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "max_num_batched_tokens": 0,
            "conversations": CHAT, "ignore_eos": True, "logprobs": 2, "extra": {"turn_end_states": turn_ends},
            "llm": llm, "phases": [{"reset": True}, {"reset": False}, {"reset": True}],
            "pause_before": [1], "sync_dir": str(tmp_path)}
    res = engine_runner(args, timeout_s=600, on_pause=lambda i: d.stop())
    hkvd, own, cold = (phase[0] for phase in res["phases"])
    got_hkvd = [t["num_cached_tokens"] for t in hkvd]
    got_vllm = [t["num_cached_tokens"] for t in own]
    print(f"chat (turn_end_states={turn_ends}, prefix_match_unit={unit}): hits from hkvd {got_hkvd}, "
          f"from vLLM's own cache {got_vllm}")
    assert [t["num_cached_tokens"] for t in cold] == [0, 0, 0], res["log"][-3000:]
    assert got_vllm == (CHAT_VLLM if unit else CHAT_VLLM_BLOCKS), res["log"][-3000:]
    assert got_hkvd == (CHAT_TURN_ENDS if turn_ends else CHAT_VLLM), res["log"][-3000:]
    if not turn_ends:
        for t, (v, h) in enumerate(zip(own, hkvd, strict=True)):  # same hit boundaries: the same bytes
            outputs.compare(v, h, f"chat turn {t + 1} (hkvd vs vLLM's cache)")
    else:  # the state at each turn's end, loaded: the no-cache run's tokens, every turn
        for t, (c, h) in enumerate(zip(cold, hkvd, strict=True)):
            outputs.compare(c, h, f"chat turn {t + 1} (hkvd from turn ends vs no cache)")
        return
    for t, (c, h) in enumerate(zip(cold, hkvd, strict=True)):
        if not _same_or_tie(c, h, f"chat turn {t + 1} (hkvd vs no cache)", outputs.LOGPROB_TOL):
            break


def test_a_turn_that_ended_on_another_engine_is_resumed_at_its_end(tiny_models, outputs, daemon_factory,
                                                                   engine_runner, tmp_path) -> None:
    """Qwen3-Next, no ``prefix_match_unit``: one engine runs a chat's first turn; a second engine (a new process,
    which remembers no turn end of its own) gets the next turn's prompt. The daemon names where the first turn
    ended (``LookupReply.ends``), so the second engine resumes there, past vLLM's block multiples, with the
    tokens of a run without any cache."""
    d = daemon_factory(BLOCK)
    first = CHAT[0]["first"]
    base = {"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "max_num_batched_tokens": 0,
            "ignore_eos": True, "logprobs": 2, "llm": {"max_model_len": 1024}}
    # Two phases: the second's emptying of vLLM's cache runs steps, which send the first's turn-end store.
    one = engine_runner({**base, "conversations": [{"first": first, "users": [], "max_tokens": [40]}],
                         "phases": [{"reset": True}, {"reset": True}]}, timeout_s=600)
    answer = one["phases"][0][0][0]["tokens"]
    prompt = [*first, *answer, *CHAT[0]["users"][0]]
    two = engine_runner({**base, "conversations": [{"first": prompt, "users": [], "max_tokens": [6]}],
                         "phases": [{"reset": True}, {"reset": True}], "pause_before": [1],
                         "sync_dir": str(tmp_path)}, timeout_s=600, on_pause=lambda i: d.stop())
    (hkvd,), (cold,) = (phase[0] for phase in two["phases"])
    end = len(first) + len(answer) - 1
    print(f"next turn on another engine: hit {hkvd['num_cached_tokens']} of {len(prompt)} (first turn ended at "
          f"{end}; vLLM's block multiples stop at {end // BLOCK * BLOCK})")
    assert hkvd["num_cached_tokens"] == end, two["log"][-3000:]
    assert cold["num_cached_tokens"] == 0
    outputs.compare(cold, hkvd, "next turn on another engine (hkvd from the turn end vs no cache)")


# A pinned session and an unpinned one of the same shape, each ending its first turn at 207 (a 200-token
# prompt, 8 tokens answered, the last not computed), with six 900-token one-shots between their turns:
# about twice the 12 MB pool (three stored about 12.7 MB, so whether they evicted the unpinned session's
# entries hung on which Mamba checkpoints a run happened to store).
SESSION = {"pin_s": 300, "session": "agent-1"}
PINNED_CHAT = {"first": _seq(200, 29, 6), "users": [_seq(30, 31, 2)], "kv_transfer_params": {"hkvd": SESSION}}
LOOSE_CHAT = {"first": _seq(200, 37, 9), "users": [_seq(30, 41, 3)]}
FLOOD = [{"first": _seq(900, 43 + 2 * i, i), "users": []} for i in range(6)]
TURN_END = 207


def test_a_pinned_sessions_turn_end_outlives_a_flood_that_evicts_an_unpinned_ones(tiny_models, daemon_factory,
                                                                                 engine_runner) -> None:
    """The partial chunks a pinned request stores (its turn's end, vLLM's checkpoint inside its last block) are
    pinned with its whole chunks (``Pin.partial_keys``): one-shots that overflow a 12 MB pool evict the unpinned
    session's, and the pinned session's next turn still resumes at its previous turn's end."""
    d = daemon_factory(BLOCK, "--l1-size-gb", "0.01")
    args = {"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "max_num_batched_tokens": 0,
            "conversations": [PINNED_CHAT, LOOSE_CHAT, *FLOOD], "ignore_eos": True,
            "llm": {"max_model_len": 1024, "prefix_match_unit": UNIT}, "phases": [{"reset": True}]}
    res = engine_runner(args, timeout_s=600)
    pinned, loose = (conv for conv in res["phases"][0][:2])
    hits = {"pinned": [t["num_cached_tokens"] for t in pinned], "loose": [t["num_cached_tokens"] for t in loose]}
    print(f"hits from hkvd after the flood: {hits}")
    assert hits["loose"][1] < TURN_END, ("the one-shots did not evict the unpinned session: the test proves "
                                         f"nothing; {hits}")
    assert hits["pinned"] == [0, TURN_END], res["log"][-3000:]


# A turn that ends on a stop token, as a chat's turns do (EOS), not on its length. The first conversation (12
# tokens, ended by length) only supplies the stop token: its answer's 3rd token, so the second conversation's
# first turn, the same prompt, stops there or at an earlier occurrence.
STOP_PROMPT = _seq(200, 53, 7)
LEARN_CHAT = {"first": STOP_PROMPT, "users": [], "max_tokens": 12}
STOP_CHAT = {"first": STOP_PROMPT, "users": [_seq(30, 59, 4)], "max_tokens": 12,
             "stop_from": {"conversation": 0, "turn": 0, "index": 2}}


def test_a_turn_that_stops_on_a_token_is_resumed_at_its_end(tiny_models, outputs, daemon_factory, engine_runner,
                                                            tmp_path) -> None:
    """The next turn hits at the end of a turn that stopped on a token (the stop token, never fed through, is
    computed again), with the tokens of a run without any cache (or parting from them only at a near-tie).
    vLLM's CPU platform schedules synchronously: under asynchronous scheduling (vLLM's GPU default) the step
    after the stop token's is in flight when the request finishes, and the shim stores no turn end there
    (docs/design.md, "Hit granularity")."""
    d = daemon_factory(BLOCK)
    args = {"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "max_num_batched_tokens": 0,
            "conversations": [LEARN_CHAT, STOP_CHAT], "ignore_eos": True, "logprobs": 2,
            "llm": {"max_model_len": 1024, "prefix_match_unit": UNIT},
            "phases": [{"reset": True}, {"reset": True}], "pause_before": [1], "sync_dir": str(tmp_path)}
    res = engine_runner(args, timeout_s=600, on_pause=lambda i: d.stop())
    (learn, stopped), (_, cold) = res["phases"]
    first, second = stopped
    stop = learn[0]["tokens"][2]
    print(f"stop token {stop}: first turn {first['tokens']} ({first['finish_reason']}); second turn hit "
          f"{second['num_cached_tokens']} of {second['prompt_len']}")
    assert first["finish_reason"] == "stop" and first["tokens"][-1] == stop, first
    assert first["tokens"] == learn[0]["tokens"][:len(first["tokens"])], (first, learn[0])
    end = len(STOP_PROMPT) + len(first["tokens"]) - 1  # the prompt and the answer up to the stop token
    assert second["num_cached_tokens"] == end, res["log"][-3000:]
    assert [t["num_cached_tokens"] for t in cold] == [0, 0], res["log"][-3000:]
    # The same tokens, or a parting at a near-tie (the loaded state's prefill is chunked otherwise).
    _same_or_tie(cold[1], second, "the turn after a stop token (hkvd from its end vs no cache)", outputs.LOGPROB_TOL)
