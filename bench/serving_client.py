"""The client side of ``bench.serving``: the conversation workload, its streaming requests, vLLM's /metrics.

Role
    ``Workload`` fixes the conversations (token ids drawn from a seed, so every run of one
    invocation sends the same first and user messages). ``converse`` plays them against a
    server: ``concurrency`` worker threads take the conversation that has waited longest, send
    its next turn, and put it back at the end of the queue, so between two turns of one
    conversation the others run theirs (all but those in flight when it came back): the access
    pattern that makes an LRU cache smaller than all conversations drop each one before it
    comes back. Each turn's prompt is the previous prompt, the tokens the model answered, and a
    new user message.
    ``stream_completion`` sends one turn to vLLM's OpenAI completions endpoint (token-id prompt,
    streaming, greedy, ``ignore_eos`` with a fixed ``max_tokens`` so every run generates the same
    number of tokens) and times it from the client.

Threading
    ``converse`` runs ``send`` on its worker threads; ``on_request`` is called under its lock, in
    completion order. Everything else is plain functions.

Contracts
    Every wait has a timeout: ``stream_completion`` raises ``TimeoutError`` past ``timeout_s``
    (socket reads included) and ``RuntimeError`` on an HTTP error or a stream without usage; the
    first failed request stops ``converse``, which raises it once the in-flight turns return.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence, Sized
from dataclasses import asdict, dataclass
from typing import Any

FIRST_TOKEN_ID = 4  # ids 0..3 are the bench models' special tokens (<unk>, <s>, </s>, <pad>)


@dataclass(frozen=True)
class Workload:
    """``conversations`` chats of ``turns`` turns, ``concurrency`` requests in flight at a time.

    Turn 1 sends a ``first_tokens`` message; every later turn adds the previous answer
    (``answer_tokens``, always that many: ``ignore_eos``) and a ``user_tokens`` message.
    """

    conversations: int
    concurrency: int
    turns: int
    first_tokens: int
    user_tokens: int
    answer_tokens: int
    vocab: int = 512
    seed: int = 27

    def __post_init__(self) -> None:
        for name in ("conversations", "concurrency", "turns", "first_tokens", "user_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1, not {getattr(self, name)}")
        if self.concurrency > self.conversations:
            raise ValueError(f"concurrency {self.concurrency} exceeds the {self.conversations} conversations")

    def message(self, conv: int, turn: int) -> list[int]:
        """The user message of ``turn`` (1-based) in conversation ``conv``: fresh ids from a fixed seed."""
        rng = random.Random(f"{self.seed}/{conv}/{turn}")
        n = self.first_tokens if turn == 1 else self.user_tokens
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(n)]

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of ``turn`` (1-based), the same in every conversation."""
        return self.first_tokens + (turn - 1) * (self.answer_tokens + self.user_tokens)

    def context_tokens(self) -> int:
        """Tokens a conversation holds at the end of its last turn (prompt + answer)."""
        return self.prompt_tokens(self.turns) + self.answer_tokens

    def requests(self) -> int:
        return self.conversations * self.turns


def kv_blocks(workload: Workload, block: int, mamba_groups: int, window_groups: int = 0,
              window_cap: int | None = None) -> dict[str, int]:
    """KV-cache block counts for the runs (vLLM's ``--num-gpu-blocks-override``).

    vLLM's block pool serves every KV-cache group. A conversation at its end holds
    ``ceil(context / block)`` blocks of full attention; per Mamba group, the two state blocks vLLM
    counts for a running request (align mode keeps a request's state at one block boundary,
    not at every one: vLLM 0.32's retention interval acts on sliding windows only); per
    sliding-window group, what a prefill allocates before vLLM frees the blocks behind the
    window: every block from the first one in the window at its start to the prompt's end, so
    ``ceil(context / block)`` for a prompt computed from its first token, at most ``window_cap``
    (vLLM's per-request admission cap for the group; ``None``: no cap).
    ``small`` holds the ``concurrency`` running conversations with a quarter to spare, so no
    request is preempted, but not the others: between two turns of a conversation the other
    conversations' turns take its blocks. ``ample`` holds every conversation twice over.
    """
    attention = math.ceil(workload.context_tokens() / block)
    window = attention if window_cap is None else min(attention, window_cap)
    per_conv = attention + window_groups * window + 2 * mamba_groups
    return block_budget(per_conv, workload.conversations, workload.concurrency)


def block_budget(per_conv: int, conversations: int, concurrency: int) -> dict[str, int]:
    """``kv_blocks``' small and ample memories for conversations of at most ``per_conv`` blocks each."""
    small = math.ceil(1.25 * concurrency * per_conv)
    everything = conversations * per_conv
    if small >= everything:
        raise ValueError(f"{conversations} conversations need {everything} KV blocks, which the small "
                         f"memory for {concurrency} running ({small}) already holds: use more "
                         "conversations than 1.25x the concurrency")
    return {"per_conversation": per_conv, "all_conversations": everything, "small": small, "ample": 2 * everything}


@dataclass(frozen=True)
class Reply:
    """One turn as the client saw it. Times are seconds; ``start_s`` from the start of the run."""

    conv: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    start_s: float
    ttft_s: float
    e2e_s: float
    token_ids: tuple[int, ...]

    def decode_tok_s(self) -> float:
        """Tokens per second after the first (the stream's decode rate)."""
        span = self.e2e_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else float("nan")

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_ids"] = list(self.token_ids)
        return d


def reply_from_json(d: dict[str, Any]) -> Reply:
    """``Reply.as_json``'s inverse."""
    return Reply(**{**d, "token_ids": tuple(d["token_ids"])})


Send = Callable[[int, int, list[int]], Reply]


def converse(workload: Workload, send: Send, on_request: Callable[[Reply], None] = lambda r: None) -> list[Reply]:
    """Play every conversation of ``workload`` through ``send(conv, turn, prompt)``; the replies in completion order.

    The next prompt is ``prompt + reply.token_ids + workload.message(conv, turn + 1)``; a reply
    with another number of tokens than ``answer_tokens`` is an error (the runs would not compare).
    """
    lock = threading.Lock()
    queue: deque[tuple[int, int, list[int]]] = deque((c, 1, workload.message(c, 1))
                                                     for c in range(workload.conversations))
    replies: list[Reply] = []
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                # An empty queue means every unfinished conversation is in flight, and the worker
                # that has it puts it back and takes it again: this worker is no longer needed.
                if errors or not queue:
                    return
                conv, turn, prompt = queue.popleft()
            try:
                reply = send(conv, turn, prompt)
                check_answer(reply, f"conversation {conv} turn {turn}", workload.answer_tokens)
            except BaseException as e:  # re-raised by converse once the other threads return
                with lock:
                    errors.append(e)
                return
            with lock:
                replies.append(reply)
                on_request(reply)
                if turn < workload.turns:
                    queue.append((conv, turn + 1, prompt + list(reply.token_ids) + workload.message(conv, turn + 1)))

    run_workers(worker, workload.concurrency, "bench-conv", errors, replies, workload.requests())
    return replies


def check_answer(reply: Reply, who: str, answer_tokens: int) -> None:
    """A reply with another number of tokens than asked for is an error (the runs would not compare)."""
    if len(reply.token_ids) != answer_tokens:
        raise RuntimeError(f"{who}: {len(reply.token_ids)} answer tokens, asked for {answer_tokens} with ignore_eos")


def run_workers(worker: Callable[[], None], concurrency: int, name: str, errors: list[BaseException],
                replies: Sized, requests: int) -> None:
    """Run ``concurrency`` threads of ``worker`` to their end; re-raise the first error one of them recorded in
    ``errors``, else check that the threads gathered ``requests`` replies."""
    threads = [threading.Thread(target=worker, name=f"{name}-{i}", daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if len(replies) != requests:
        raise RuntimeError(f"{len(replies)} of {requests} turns ran")


def stream_completion(host: str, port: int, model: str, prompt: Sequence[int], max_tokens: int,
                      timeout_s: float, extra: dict[str, Any] | None = None
                      ) -> tuple[float, float, dict[str, Any], list[int]]:
    """One streamed greedy completion: ``(ttft_s, e2e_s, usage, token_ids)``.

    ``ttft_s`` runs from just before the request is sent to the first chunk that carries a
    generated token; ``usage`` is the stream's last chunk (``stream_options.include_usage``).
    ``extra`` adds fields to the request body (``kv_transfer_params``: bench/agents.py's pins).
    """
    body = json.dumps({"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       "return_token_ids": True, **(extra or {})})
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read()[:2000].decode(errors="replace")
            raise RuntimeError(f"POST /v1/completions: HTTP {resp.status}: {detail}")
        ttft = float("nan")
        tokens: list[int] = []
        usage: dict[str, Any] | None = None
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"completion of {len(prompt)} prompt tokens not done within {timeout_s:.0f} s")
            line = resp.readline()
            if not line:
                break
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            data = text[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and not tokens:
                    ttft = time.perf_counter() - t0
                tokens.extend(int(t) for t in ids)
            if chunk.get("usage"):
                usage = chunk["usage"]
        e2e = time.perf_counter() - t0
    except TimeoutError:
        raise
    except OSError as e:  # socket.timeout is a TimeoutError (3.10+); the rest: refused, reset
        raise RuntimeError(f"POST /v1/completions on {host}:{port}: {e}") from e
    finally:
        conn.close()
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk (stream_options.include_usage)")
    return ttft, e2e, usage, tokens


def cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens the server did not compute (vLLM's prefix cache plus the KV connector's hit).

    Needs the server's ``--enable-prompt-tokens-details``; its absence is an error, not zero.
    """
    details = usage.get("prompt_tokens_details")
    if not details or details.get("cached_tokens") is None:
        raise RuntimeError("usage has no prompt_tokens_details.cached_tokens: start vLLM with "
                           "--enable-prompt-tokens-details")
    return int(details["cached_tokens"])


def http_get(host: str, port: int, path: str, timeout_s: float) -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


METRICS = {  # vLLM counter -> our name
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prefix_cache_queries_total": "local_queries",
    "vllm:prefix_cache_hits_total": "local_hits",
    "vllm:external_prefix_cache_queries_total": "external_queries",
    "vllm:external_prefix_cache_hits_total": "external_hits",
    "vllm:num_preemptions_total": "preemptions",
    # hkvd's connector stats (hkvd.shim.connector_stats): absent, so 0, in the runs without hkvd
    "vllm:hkvd_lookups_deferred_total": "hkvd_lookups_deferred",
    "vllm:hkvd_load_settles_won_total": "hkvd_load_settles_won",
    "vllm:hkvd_load_settle_seconds_total": "hkvd_load_settle_seconds",
    "vllm:hkvd_loads_reported_early_total": "hkvd_loads_reported_early",
    "vllm:hkvd_load_seconds_total": "hkvd_load_seconds",
    "vllm:hkvd_loads_total": "hkvd_loads",
    # in-step loads (in_step_loads): hits copied by the engine in the step that planned them, every rank counted
    "vllm:hkvd_in_step_loads_total": "hkvd_in_step_loads",
    # sampled verification (bench/verify_cost.py): requests with a hit computed and checked, chunks compared
    "vllm:hkvd_verify_sampled_total": "hkvd_verify_sampled",
    "vllm:hkvd_verify_checks_total": "hkvd_verify_checks",
    "vllm:hkvd_verify_divergences_total": "hkvd_verify_divergences",
    # session pins (bench/agents.py): finished requests pinned for their session, pin asks refused
    "vllm:hkvd_pins_sent_total": "hkvd_pins_sent",
    "vllm:hkvd_pins_refused_total": "hkvd_pins_refused",
}


def parse_metrics(text: str) -> dict[str, float]:
    """The counters of ``METRICS`` from a Prometheus text page, summed over their label sets."""
    out = dict.fromkeys(METRICS.values(), 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            out[METRICS[name]] += float(line.rsplit(" ", 1)[1])
    return out
