"""bench reasoning (``bench.reasoning``): its chats' shape and its table and notes; the engines run only in the
bench itself."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The checkout on sys.path only while bench imports (as tests/unit/test_bench.py does).
sys.path.insert(0, str(ROOT))
try:
    from bench import reasoning
finally:
    sys.path.remove(str(ROOT))


def test_chats_are_distinct_and_turns_line_up() -> None:
    convs = reasoning.conversations(3, 4, 100)
    assert len({tuple(c["first"]) for c in convs}) == 3
    for c in convs:
        assert len(c["users"]) == len(c["answers"]) == 3 and c["thinking"] == 100
        assert not set(reasoning.OPEN) & {t for part in (c["first"], *c["users"], *c["answers"]) for t in part}


def _result(ratios: list[float]) -> dict:
    rounds = [{"round": i + 1, "bytes_everything": 4 << 20, "bytes_auto": int(r * (4 << 20)), "ratio": r,
               "entries_everything": 40, "entries_auto": 12, "hit_tokens": 1024, "prompt_tokens": 4000}
              for i, r in enumerate(ratios)]
    return {"config": {"chats": 2, "turns": 3, "thinking_tokens": 192}, "rounds": rounds,
            "summary": {"ratio_median": sorted(ratios)[len(ratios) // 2], "ratio_min": min(ratios),
                        "ratio_max": max(ratios), "target": 0.5, "met": max(ratios) <= 0.5}}


def test_table_has_a_row_per_round_and_notes_say_whether_every_round_met_the_target() -> None:
    headers, rows = reasoning.table(_result([0.3, 0.4]))
    assert len(rows) == 2 and len(rows[0]) == len(headers) and rows[0][1] == 4.0
    assert "met (every round)" in reasoning.notes(_result([0.3, 0.4]))
    assert "not met" in reasoning.notes(_result([0.3, 0.6]))
    assert reasoning.notes({}) == ""
