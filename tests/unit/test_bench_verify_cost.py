"""bench verify_cost: the ratios to verify_fraction 0, what was sampled, and the 2 % target's verdict.

Correctness only, no timing assertions; the runs are built by hand (``python -m bench verify_cost --quick``
runs the real servers).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package (see tests/unit/test_bench.py)
try:
    from bench import verify_cost
finally:
    sys.path.remove(str(ROOT))


def _run(fraction: float, tok_s: float, ttft_ms: float, sampled: float) -> dict:
    return {"run": f"verify {fraction:g}", "verify_fraction": fraction, "output_tok_s": tok_s,
            "turns": [{"turn": 1, "ttft_ms_p50": 1.0, "requests": 4}, {"turn": "later", "ttft_ms_p50": ttft_ms,
                                                                      "requests": 8}],
            "counters": {"hkvd_verify_sampled": sampled, "hkvd_verify_checks": 4 * sampled, "hkvd_loads": 8 - sampled}}


def test_ratios_to_fraction_zero_and_the_target() -> None:
    runs = [_run(0.0, 100.0, 200.0, 0), _run(0.01, 99.0, 210.0, 1), _run(0.1, 90.0, 300.0, 3)]
    figs = verify_cost.figures(runs)
    assert [round(f["throughput_vs_0"], 3) for f in figs] == [1.0, 0.99, 0.9]
    assert [round(f["later_ttft_p50_vs_0"], 3) for f in figs] == [1.0, 1.05, 1.5]
    assert [(f["sampled"], f["chunks_compared"], f["later_requests"]) for f in figs] == [(0, 0, 8), (1, 4, 8),
                                                                                        (3, 12, 8)]
    lines = verify_cost.summary({"figures": figs})
    assert lines[-1].startswith("target: at most 2% throughput loss at 0.01: +1.0%: met"), lines
    assert "nothing was sampled" not in lines[-1]
    assert "sampled 3 of 8 later-turn requests, 12 chunks compared" in lines[2]


def test_the_median_of_rounds_leaves_a_stalled_round_out() -> None:
    base, stalled = _run(0.0, 50.0, 200.0, 0), _run(0.01, 40.0, 200.0, 0)
    base["rounds"] = [{"output_tok_s": x} for x in (100.0, 20.0, 100.0)]
    stalled["rounds"] = [{"output_tok_s": x} for x in (99.0, 99.0, 10.0)]
    f = verify_cost.figures([base, stalled])[1]
    assert f["output_tok_s_rounds"] == [99.0, 99.0, 10.0] and round(f["throughput_median_rounds_vs_0"], 3) == 0.99
    assert verify_cost.summary({"figures": [f]})[-1].startswith(
        "target: at most 2% throughput loss at 0.01: +20.0%: MISSED (median of rounds: +1.0%)")


def test_a_missed_target_an_unsampled_run_and_a_failed_run_are_said() -> None:
    runs = [_run(0.0, 100.0, 200.0, 0), _run(0.01, 95.0, 200.0, 0),
            {"run": "verify 0.1", "verify_fraction": 0.1, "error": "server did not start"}]
    lines = verify_cost.summary({"figures": verify_cost.figures(runs)})
    assert "verify_fraction 0.1: did not run: server did not start" in lines
    assert lines[-1] == ("target: at most 2% throughput loss at 0.01: +5.0%: MISSED (median of rounds: +5.0%); "
                         "nothing was sampled at 0.01, so the difference is run-to-run noise")
    _headers, rows = verify_cost.table({"figures": verify_cost.figures(runs)})
    assert len(rows) == 3 and rows[2][1] == "error: server did not start"
