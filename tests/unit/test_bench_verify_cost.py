"""bench verify_cost: the ratios to verify_fraction 0, what was sampled, and the 2 % target's verdict.

Correctness only, no timing assertions; the runs are built by hand (``python -m bench verify_cost --quick``
runs the real servers).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_the_cost_at_a_fraction_is_that_share_of_checking_every_hit() -> None:
    assert verify_cost.projected_loss(0.0, 1.5) == 0.0
    assert round(verify_cost.projected_loss(1.0, 1.5), 4) == round(1 - 1 / 1.5, 4)
    assert round(verify_cost.projected_loss(0.01, 1.5), 6) == round(1 - 1 / 1.005, 6)
    assert verify_cost.projected_loss(0.5, 0.9) == 0.0  # checking every hit cost nothing: no loss, never a gain
    runs = [_run(0.0, 100.0, 200.0, 0), _run(0.01, 99.0, 210.0, 0), _run(1.0, 60.0, 400.0, 8)]
    for r, cpu in zip(runs, (40.0, 41.0, 80.0), strict=True):
        r["cpu_s"] = cpu
    figs = verify_cost.figures(runs)
    assert [round(f["cpu_vs_0"], 3) for f in figs] == [1.0, 1.025, 2.0]
    assert round(figs[1]["projected_throughput_loss"], 6) == round(1 - 1 / 1.01, 6)
    lines = verify_cost.summary({"figures": figs})
    assert lines[-1] == "projected from fraction 1's CPU cost: +0.99% throughput at 0.01: met", lines
    runs[2]["cpu_s"] = 160.0  # every hit checked costs 3x more: 3 % at 0.01
    lines = verify_cost.summary({"figures": verify_cost.figures(runs)})
    assert lines[-1] == "projected from fraction 1's CPU cost: +2.91% throughput at 0.01: MISSED", lines


def test_replies_are_compared_with_the_same_rounds_fraction_zero() -> None:
    def played(f: float, tokens: dict[tuple[int, int], list[int]]) -> dict:
        return {"verify_fraction": f, "replies": [{"conv": c, "turn": t, "token_ids": ids}
                                                  for (c, t), ids in tokens.items()]}

    rounds = [[played(0.0, {(0, 1): [1, 2], (0, 2): [3, 4]}), played(1.0, {(0, 1): [1, 2], (0, 2): [3, 5]})],
              [played(0.0, {(0, 1): [7]}), played(1.0, {(0, 1): [7], (1, 1): [8]}), {"verify_fraction": 0.1,
                                                                                       "error": "no start"}]]
    assert verify_cost.same_tokens(rounds, 1.0) == {"equal": 2, "compared": 3}
    assert verify_cost.same_tokens(rounds, 0.1) == {"equal": 0, "compared": 0}


@pytest.mark.out_of_process
def test_cpu_seconds_count_the_whole_process_tree() -> None:
    psutil = pytest.importorskip("psutil", reason="psutil comes with vLLM (make vllm), as the benches need it")
    from bench.common import tree_cpu_s

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)\n"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {burn!r}])\ntime.sleep(60)\n"])
    try:
        deadline = time.monotonic() + 30.0
        while tree_cpu_s([parent.pid]) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        whole = tree_cpu_s([parent.pid])
        own = sum(psutil.Process(parent.pid).cpu_times()[:2])
        assert whole >= 0.5 and own < 0.4, (whole, own)  # the grandchild's burn is counted, not the parent's
        assert tree_cpu_s([parent.pid, 2**22 + 12345]) >= whole  # a pid that is gone adds nothing, fails nothing
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait(10.0)
