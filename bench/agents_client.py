"""The client side of ``bench.agents``: agent sessions that pause between turns, played against a server.

Role
    ``Agents`` fixes the sessions from a seed: every session's first turn is a system prompt
    shared by all sessions and a task of its own; every later turn appends the model's answer
    and a tool result of ``tool_min`` to ``tool_max`` tokens (random token ids, as
    ``bench.serving_client`` draws its messages). After each turn but the last a session pauses
    (the tool running) for a time drawn from an exponential distribution of mean
    ``pause_mean_s``, cut at ``pause_max_s``. Lengths and pauses depend only on the seed, the
    session and the turn, so every run of one invocation sends the same prompts after the same
    pauses.
    ``play`` runs the sessions through ``send`` on ``concurrency`` worker threads: a worker takes
    the session whose pause ended first and sends its next turn; a session whose pause has not
    ended is not sent. It returns the replies and each session's spans: ``active`` (a request in
    flight), ``paused`` (its tool running) and ``waiting`` (pause over, no free worker).
    ``between_turns`` turns those spans into how many sessions sat between two turns over time:
    the sessions whose KV cache must be kept somewhere for their next turn to hit.
    ``OneShots`` is the node's other traffic: single-turn requests of ``oneshot_min`` to
    ``oneshot_max`` random tokens (unique prompts, seeded, so every run sends the same ones),
    ``oneshot_in_flight`` at a time from the sessions' start until ``stop``, at most
    ``oneshot_limit`` of them. They are never pinned and never hit; they are what a recency-only
    cache keeps instead of the paused sessions. ``oneshot_in_flight`` 0 sends none: the sessions alone.

Threading
    ``play`` runs ``send`` on its worker threads; ``on_reply`` is called under its lock, in
    completion order. ``OneShots`` runs its own threads between ``start`` and ``stop``. The rest
    are pure functions.

Contracts
    Every wait is bounded: a worker waits for the next pause to end (at most ``pause_max_s``),
    and ``send`` carries its own timeout. The first failed request stops ``play``, which raises
    it once the in-flight turns return. An answer of another length than ``answer_tokens`` is an
    error (the runs would not compare). ``OneShots.stop`` waits for the one-shots in flight (each
    bounded by ``send``'s timeout) and raises the first that failed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.serving_client import FIRST_TOKEN_ID, Reply, check_answer, run_workers


@dataclass(frozen=True)
class Agents:
    """``sessions`` agent sessions of ``turns`` turns, ``concurrency`` requests in flight at a time,
    and the one-shot traffic beside them (``oneshot_*``).

    ``pin_max_fraction``: the daemon's ``--pin-max-fraction`` in the hkvd runs; ``bench.agents``
    sizes the pool so that this share of it holds every session's pins at their largest.
    """

    sessions: int
    concurrency: int
    turns: int
    system_tokens: int
    task_tokens: int
    answer_tokens: int
    pause_mean_s: float
    pause_max_s: float
    pin_max_fraction: float = 0.5
    tool_min: int = 100
    tool_max: int = 800
    oneshot_min: int = 1000
    oneshot_max: int = 1500
    oneshot_answer_tokens: int = 2
    oneshot_in_flight: int = 1
    oneshot_limit: int = 200
    vocab: int = 512
    seed: int = 37

    def __post_init__(self) -> None:
        for name in ("sessions", "concurrency", "turns", "system_tokens", "task_tokens", "answer_tokens",
                     "tool_min", "oneshot_min", "oneshot_answer_tokens", "oneshot_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"agents {name} must be >= 1, not {getattr(self, name)}")
        if self.oneshot_in_flight < 0:  # 0: the sessions alone
            raise ValueError(f"agents oneshot_in_flight must be >= 0, not {self.oneshot_in_flight}")
        if self.tool_max < self.tool_min:
            raise ValueError(f"agents tool_max {self.tool_max} is below tool_min {self.tool_min}")
        if self.oneshot_max < self.oneshot_min:
            raise ValueError(f"agents oneshot_max {self.oneshot_max} is below oneshot_min {self.oneshot_min}")
        if not 0 < self.pin_max_fraction <= 1:
            raise ValueError(f"agents pin_max_fraction {self.pin_max_fraction}: must be more than 0 and at most 1, "
                             "as hkvd serve's --pin-max-fraction")
        if not 0 < self.pause_mean_s <= self.pause_max_s:
            raise ValueError(f"agents pauses: need 0 < pause_mean_s ({self.pause_mean_s}) <= pause_max_s "
                             f"({self.pause_max_s})")

    def _rng(self, *key: object) -> random.Random:
        return random.Random("/".join(str(k) for k in (self.seed, *key)))

    def _ids(self, n: int, *key: object) -> list[int]:
        rng = self._rng("ids", *key)
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(n)]

    def system(self) -> list[int]:
        """The system prompt every session starts with (the same ids in every session)."""
        return self._ids(self.system_tokens, "system")

    def task(self, session: int) -> list[int]:
        return self._ids(self.task_tokens, "task", session)

    def tool_tokens(self, session: int, turn: int) -> int:
        """Length of the tool result that ``turn`` (2 and on) appends: uniform in [tool_min, tool_max]."""
        if not 2 <= turn <= self.turns:
            raise ValueError(f"turn {turn}: tool results come with turns 2 to {self.turns}")
        return self._rng("tool-len", session, turn).randint(self.tool_min, self.tool_max)

    def tool_result(self, session: int, turn: int) -> list[int]:
        return self._ids(self.tool_tokens(session, turn), "tool", session, turn)

    def pause_s(self, session: int, turn: int) -> float:
        """The pause after ``turn`` (1 to turns - 1), before the next: exponential, cut at ``pause_max_s``."""
        if not 1 <= turn < self.turns:
            raise ValueError(f"turn {turn}: sessions pause after turns 1 to {self.turns - 1}")
        return min(self.pause_max_s, self._rng("pause", session, turn).expovariate(1.0 / self.pause_mean_s))

    def first_prompt(self, session: int) -> list[int]:
        return self.system() + self.task(session)

    def prompt_tokens(self, session: int, turn: int) -> int:
        """Prompt length of ``turn`` (1-based) in ``session``."""
        return (self.system_tokens + self.task_tokens
                + sum(self.answer_tokens + self.tool_tokens(session, t) for t in range(2, turn + 1)))

    def context_tokens(self, session: int) -> int:
        """Tokens ``session`` holds after its last turn (prompt + answer)."""
        return self.prompt_tokens(session, self.turns) + self.answer_tokens

    def max_context_tokens(self) -> int:
        """The most any session of any seed can reach (every tool result ``tool_max`` long)."""
        return self.system_tokens + self.task_tokens + (self.turns - 1) * (self.answer_tokens + self.tool_max) \
            + self.answer_tokens

    def mean_context_tokens(self) -> float:
        """Tokens a session holds after a turn, averaged over sessions and turns: its mean size while paused."""
        sizes = [self.prompt_tokens(s, t) + self.answer_tokens for s in range(self.sessions)
                 for t in range(1, self.turns + 1)]
        return sum(sizes) / len(sizes)

    def requests(self) -> int:
        return self.sessions * self.turns

    def oneshot_prompt(self, i: int) -> list[int]:
        """The ``i``-th one-shot request's prompt: ``oneshot_min`` to ``oneshot_max`` random ids of its own."""
        if not 0 <= i < self.oneshot_limit:
            raise ValueError(f"one-shot {i}: there are {self.oneshot_limit} (0 to {self.oneshot_limit - 1})")
        n = self._rng("oneshot-len", i).randint(self.oneshot_min, self.oneshot_max)
        return self._ids(n, "oneshot", i)


@dataclass(frozen=True)
class Span:
    """Session ``session`` was ``kind`` (active, paused, waiting) from ``t0_s`` to ``t1_s`` (from the start)."""

    session: int
    kind: str
    t0_s: float
    t1_s: float


Send = Callable[[int, int, list[int]], Reply]


def play(agents: Agents, send: Send, on_reply: Callable[[Reply], None] = lambda r: None,
         clock: Callable[[], float] = time.monotonic) -> tuple[list[Reply], list[Span]]:
    """Every session of ``agents`` through ``send(session, turn, prompt)``: replies in completion order, spans.

    The next prompt is ``prompt + reply.token_ids + agents.tool_result(session, turn + 1)``, sent
    once ``agents.pause_s(session, turn)`` has passed and a worker is free; of the sessions ready,
    the one whose pause ended first goes first.
    """
    cond = threading.Condition()
    t0 = clock()
    # session -> (ready at, turn, prompt), for the sessions not in flight and not done
    queued: dict[int, tuple[float, int, list[int]]] = {s: (0.0, 1, agents.first_prompt(s))
                                                       for s in range(agents.sessions)}
    paused_since: dict[int, float] = {}
    replies: list[Reply] = []
    spans: list[Span] = []
    errors: list[BaseException] = []
    in_flight = [0]

    def take() -> tuple[int, int, list[int]] | None:
        """The next (session, turn, prompt) to send, or None when this worker is no longer needed."""
        with cond:
            while True:
                if errors or (not queued and in_flight[0] == 0):
                    cond.notify_all()
                    return None
                now = clock() - t0
                ready = [(at, s) for s, (at, _, _) in queued.items() if at <= now]
                if ready:
                    at, s = min(ready)
                    _, turn, prompt = queued.pop(s)
                    if turn > 1:
                        spans.append(Span(s, "paused", paused_since.pop(s), at))
                        spans.append(Span(s, "waiting", at, now))
                    in_flight[0] += 1
                    return s, turn, prompt
                if not queued:  # the rest are in flight: a worker of theirs takes their next turn
                    return None
                nxt = min(at for at, _, _ in queued.values())
                cond.wait(timeout=max(0.0, nxt - now) + 0.001)

    def worker() -> None:
        while (job := take()) is not None:
            s, turn, prompt = job
            start = clock() - t0
            try:
                reply = send(s, turn, prompt)
                check_answer(reply, f"session {s} turn {turn}", agents.answer_tokens)
            except BaseException as e:  # re-raised by play once the other threads return
                with cond:
                    errors.append(e)
                    in_flight[0] -= 1
                    cond.notify_all()
                return
            with cond:
                end = clock() - t0
                spans.append(Span(s, "active", start, end))
                replies.append(reply)
                on_reply(reply)
                if turn < agents.turns:
                    nxt = prompt + list(reply.token_ids) + agents.tool_result(s, turn + 1)
                    queued[s] = (end + agents.pause_s(s, turn), turn + 1, nxt)
                    paused_since[s] = end
                in_flight[0] -= 1
                cond.notify_all()

    run_workers(worker, agents.concurrency, "bench-agent", errors, replies, agents.requests())
    return replies, spans


class OneShots:
    """``agents``' one-shot traffic through ``send(index, prompt)``, ``oneshot_in_flight`` at a time, from
    ``start`` to ``stop`` (or until ``oneshot_limit`` were sent: ``exhausted`` then says so).

    ``replies``: in completion order; a one-shot's ``conv`` is its index, its ``turn`` 1.
    """

    def __init__(self, agents: Agents, send: Callable[[int, list[int]], Reply]) -> None:
        self.agents = agents
        self.send = send
        self.replies: list[Reply] = []
        self.errors: list[BaseException] = []
        self.exhausted = False
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, name=f"bench-oneshot-{i}", daemon=True)
                         for i in range(agents.oneshot_in_flight)]

    def _take(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self.errors:
                return None
            if self._next >= self.agents.oneshot_limit:
                self.exhausted = True
                return None
            self._next += 1
            return self._next - 1

    def _worker(self) -> None:
        while (i := self._take()) is not None:
            try:
                reply = self.send(i, self.agents.oneshot_prompt(i))
                check_answer(reply, f"one-shot {i}", self.agents.oneshot_answer_tokens)
            except BaseException as e:  # raised by stop()
                with self._lock:
                    self.errors.append(e)
                return
            with self._lock:
                self.replies.append(reply)

    def start(self) -> OneShots:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float) -> list[Reply]:
        """Send no more; wait (at most ``timeout_s``) for those in flight; the replies, or the first error."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"one-shot requests still in flight {timeout_s:.0f} s after the sessions ended")
        if self.errors:
            raise self.errors[0]
        return list(self.replies)


def between_turns(spans: Sequence[Span]) -> dict[str, Any]:
    """Sessions between two turns (paused or waiting for a worker) over the run, and those in flight.

    ``mean``: time-weighted over the run (first span's start to last span's end); ``max``: the
    most at once; ``samples``: ``[t_s, between, active]`` at every change, for plots.
    """
    events: list[tuple[float, int, int]] = []  # (time, d between, d active)
    for sp in spans:
        if sp.t1_s <= sp.t0_s:
            continue
        if sp.kind == "active":
            events += [(sp.t0_s, 0, 1), (sp.t1_s, 0, -1)]
        else:
            events += [(sp.t0_s, 1, 0), (sp.t1_s, -1, 0)]
    if not events:
        return {"mean": 0.0, "max": 0, "mean_active": 0.0, "samples": []}
    events.sort(key=lambda e: (e[0], e[1] + e[2]))  # ends before starts at the same instant
    between = active = 0
    area_b = area_a = 0.0
    last = events[0][0]
    peak = 0
    samples: list[list[float]] = []
    for t, db, da in events:
        area_b += between * (t - last)
        area_a += active * (t - last)
        last = t
        between += db
        active += da
        peak = max(peak, between)
        samples.append([round(t, 3), between, active])
    span = events[-1][0] - events[0][0]
    return {"mean": area_b / span if span > 0 else 0.0, "max": peak,
            "mean_active": area_a / span if span > 0 else 0.0, "samples": samples}

