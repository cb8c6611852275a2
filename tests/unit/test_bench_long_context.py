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


# A hit's and a miss's timeline as the engine hands them back: [event, ms since generate(), step].
HIT_EVENTS = [["arrival", 1.0, 4], ["lookup_sent", 1.5, 4], ["lookup_answered", 2.0, 4], ["first_schedule", 2.5, 4],
              ["load_planned", 3.0, 4], ["load_issued", 4.0, 4], ["load_done", 9.0, 4], ["load_reported", 9.5, 5],
              ["first_forward", 10.0, 5], ["finished", 40.0, 5]]
MISS_EVENTS = [["arrival", 1.0, 9], ["lookup_sent", 1.2, 9], ["first_schedule", 1.4, 9], ["lookup_answered", 1.6, 9],
               ["first_forward", 2.0, 9], ["finished", 900.0, 12]]


def test_segments_cut_the_ttft_at_each_event_up_to_the_first_forward() -> None:
    segs = long_context.segments(HIT_EVENTS, ttft_ms=50.0)
    names = [n for n, _ in segs]
    assert names[0] == long_context.BEFORE and names[-1] == long_context.AFTER
    assert names[1:-1] == ["arrival -> lookup_sent", "lookup_sent -> lookup_answered", "lookup_answered -> "
                           "first_schedule", "first_schedule -> load_planned", "load_planned -> load_issued",
                           "load_issued -> load_done", "load_done -> load_reported", "load_reported -> first_forward"]
    assert sum(ms for _, ms in segs) == pytest.approx(50.0)  # every millisecond accounted for
    assert dict(segs)[long_context.AFTER] == pytest.approx(40.0)  # finished is past the first token: not a cut
    assert long_context.segments(HIT_EVENTS[:5], 50.0) == []  # no forward: nothing to account for
    assert long_context.steps_to_forward(HIT_EVENTS) == 1 and long_context.steps_to_forward(MISS_EVENTS) == 0
    assert long_context.steps_to_forward(HIT_EVENTS[:3]) is None


def test_an_in_step_loads_copies_are_cut_out_of_its_forward_step() -> None:
    in_step = [["arrival", 1.0, 4], ["lookup_sent", 1.5, 4], ["first_schedule", 2.5, 4], ["lookup_answered", 2.6, 4],
               ["load_planned", 3.0, 4], ["first_forward", 3.2, 4], ["load_issued", 4.0, 4],
               ["states_copied", 4.5, 4], ["attention_copy", 8.0, 4], ["load_done", 11.0, 4],
               ["finished", 40.0, 5]]
    segs = dict(long_context.segments(in_step, ttft_ms=30.0))
    assert segs["first_forward -> load_issued"] == pytest.approx(0.8)
    assert segs["load_issued -> states_copied"] == pytest.approx(0.5)  # the Mamba/GDN states' copy
    assert segs["states_copied -> attention_copy"] == pytest.approx(3.5)  # vLLM's preparation of the step
    assert segs["attention_copy -> load_done"] == pytest.approx(3.0)  # the attention blocks' copy
    assert segs[long_context.AFTER] == pytest.approx(19.0)  # from the load's end
    assert sum(segs.values()) == pytest.approx(30.0)
    # A worker event of a later step (an asynchronous load issued after the forward) is no cut.
    late = [*in_step[:6], ["load_issued", 4.0, 5], ["load_done", 11.0, 5]]
    assert list(long_context.segments(late, 30.0))[-1] == (long_context.AFTER, pytest.approx(26.8))


def test_the_breakdown_takes_medians_per_segment_for_hits_and_misses() -> None:
    samples = [_s(1000, 1000, 50, 52), _s(1000, 1010, 50, 60), _s(1000, 1000, 50, 70)]
    later = [[e, ms + 2.0 if e == "first_forward" else ms, step + 1 if e == "first_forward" else step]
             for e, ms, step in HIT_EVENTS]
    for s, hit in zip(samples, (HIT_EVENTS, HIT_EVENTS, later), strict=True):
        s["hit"]["events"], s["miss"]["events"] = hit, MISS_EVENTS
    b = long_context.breakdown(samples)
    assert set(b) == {"hit", "miss"}
    assert b["hit"]["steps_to_forward"] == [1, 1, 2] and b["miss"]["steps_to_forward"] == [0, 0, 0]
    assert b["hit"]["ttft_ms"] == 60 and b["miss"]["ttft_ms"] == 1000
    assert b["hit"]["segments_ms"]["load_reported -> first_forward"] == pytest.approx(0.5)  # median of .5 .5 2.5
    assert list(b["miss"]["segments_ms"])[3] == "first_schedule -> lookup_answered"  # the scheduler waited
    assert long_context.breakdown([_s(1, 1, 1, 1)]) == {}  # no timelines (the engines had none): no breakdown
    lines = long_context._breakdown_lines(b)
    assert lines[0].startswith("hit 60 ms = before arrival: front end") and "[1, 1, 2]" in lines[0]


def test_the_breakdown_plot_stacks_hit_and_miss_beside_the_totals(tmp_path: Path) -> None:
    from unittest import mock

    samples = [_s(1000, 1000, 50, 52)]
    samples[0]["hit"]["events"], samples[0]["miss"]["events"] = HIT_EVENTS, MISS_EVENTS
    row = {"length": 8192, "ttft_ms_p50": {"recompute": 1000, "miss": 1000, "limit": 50, "hit": 52},
           "breakdown": long_context.breakdown(samples)}
    plt, fig, ax = mock.MagicMock(), mock.MagicMock(), mock.MagicMock()
    plt.subplots.return_value = (fig, [[ax]])  # matplotlib stands in: only what is drawn is checked
    path = long_context._plot_breakdown(plt, {"model": "qwen3_next", "rows": [row]}, tmp_path)
    assert path.endswith("long_context_qwen3_next.png")
    bars = ax.bar.call_args_list
    hit_bars = [c for c in bars if c.args[0] == 0]
    assert len(hit_bars) == len(row["breakdown"]["hit"]["segments_ms"])
    assert sum(c.args[1] for c in hit_bars) == pytest.approx(52.0)  # the segments stack to the hit's TTFT
    assert [c.args[:2] for c in bars if c.args[0] in (2, 3)] == [(2, 50), (3, 1000)]
