"""bench/long_context.py: the alternation of a sample, its checks, the ratios and their spread, the table.

The engines are stand-ins that answer from a table (the bench's own engines need vLLM and take minutes to
start); bench/long_context.py's run against real vLLM is the bench itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
try:
    from bench import long_context
finally:
    sys.path.remove(str(ROOT))


class Answers:
    """An engine that answers each prompt with a fixed time, hit and token, and records what it was asked."""

    def __init__(self, ttft_s: float, cached: int, token: int = 7) -> None:
        self.ttft_s, self.cached, self.token = ttft_s, cached, token
        self.asked: list[tuple[int, bool]] = []

    def ask(self, ids: list[int], reset: bool) -> dict[str, Any]:
        self.asked.append((len(ids), reset))
        return {"ttft_s": self.ttft_s, "cached_tokens": self.cached, "token": self.token}


def _sample(alone: Answers, hkvd: Answers, seed: int = 0) -> dict[str, Any]:
    return long_context.sample(alone, hkvd, 1024, seed)  # type: ignore[arg-type]


def test_a_sample_alternates_the_engines_and_resets_all_but_the_limit() -> None:
    order: list[str] = []
    alone, hkvd = Answers(1.0, 1024), Answers(0.5, 1024)
    for name, eng in (("alone", alone), ("hkvd", hkvd)):
        real = eng.ask
        eng.ask = lambda ids, reset, real=real, name=name: (order.append(name), real(ids, reset))[1]  # type: ignore[method-assign]
    got = _sample(alone, hkvd, seed=0)
    assert order == ["alone", "hkvd", "alone", "hkvd"]
    assert alone.asked == [(1024 + long_context.SUFFIX, True), (1024 + long_context.SUFFIX, False)]
    assert hkvd.asked == [(1024 + long_context.SUFFIX, True), (1024 + long_context.SUFFIX, True)]
    assert got["hit"]["ttft_ms"] == 500.0 and got["limit"]["ttft_ms"] == 1000.0
    order.clear()
    _sample(alone, hkvd, seed=1)
    assert order == ["hkvd", "alone", "hkvd", "alone"]


def test_a_sample_refuses_a_wrong_token_or_a_short_hit() -> None:
    with pytest.raises(RuntimeError, match="first token"):
        _sample(Answers(1.0, 1024, token=3), Answers(0.5, 1024, token=4))
    with pytest.raises(RuntimeError, match="fewer than"):
        _sample(Answers(1.0, 1024), Answers(0.5, 512))


def _s(recompute: float, miss: float, limit: float, hit: float) -> dict[str, Any]:
    return {k: {"ttft_ms": v, "cached_tokens": 0} for k, v in
            (("recompute", recompute), ("miss", miss), ("limit", limit), ("hit", hit))}


def test_a_target_is_met_only_when_every_sample_meets_it() -> None:
    r = long_context.ratios([_s(1000, 1000, 50, 52), _s(1000, 1010, 50, 60)])
    assert r["hit_vs_limit"]["low"] == pytest.approx(1.04) and r["hit_vs_limit"]["high"] == pytest.approx(1.2)
    assert r["hit_vs_limit"]["median"] == pytest.approx(1.12)
    assert not r["hit_vs_limit"]["met"]  # the median is over 1.10 and so is one sample
    assert r["hit_vs_recompute"]["met"] and r["miss_vs_recompute"]["met"]
    r = long_context.ratios([_s(1000, 1000, 50, 52), _s(1000, 1040, 50, 54)])
    assert r["hit_vs_limit"]["met"] and r["hit_vs_limit"]["high"] == pytest.approx(1.08)
    assert not r["miss_vs_recompute"]["met"]  # 1.04 over 1.03
    headers, rows = long_context.table({"models": [{"model": "qwen3_next", "rows": [
        {"length": 8192, "ratios": r, "ttft_ms_p50": {"recompute": 1000, "miss": 1000, "limit": 50, "hit": 54}}]}]})
    assert len(rows) == 1 and len(rows[0]) == len(headers) and rows[0][1] == "8K"
    headers, rows = long_context.table({"skipped": "vllm not installed (make vllm)", "models": []})
    assert rows[0][1].startswith("vllm not installed")
