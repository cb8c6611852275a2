"""The GPU benches' parts that need no GPU: arguments, percentiles and ratios, the report's verdicts,
the log's path, and the skip (exit 0 with its reason) where CuPy or a device is missing.

The numbers here are made up to check the arithmetic; no bench figure is asserted."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hkvd.cuda._cupy import cupy_available, device_count

ROOT = Path(__file__).resolve().parents[2]
# bench/ is a top-level folder of the checkout, not an installed package: on sys.path only while importing.
sys.path.insert(0, str(ROOT))
try:
    from bench import gpu_interference as gi
    from bench import gpu_store_retrieve as gsr
finally:
    sys.path.remove(str(ROOT))


def test_percentile_interpolates_between_ranks() -> None:
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert gi.percentile(xs, 50) == pytest.approx(50.5)
    assert gi.percentile(xs, 99) == pytest.approx(99.01)
    assert gi.percentile(list(reversed(xs)), 0) == 1.0 and gi.percentile(xs, 100) == 100.0
    assert gi.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError, match="no samples"):
        gi.percentile([], 50)
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        gi.percentile(xs, 101)


def test_ratios_and_report_verdicts() -> None:
    base = gi.Phase("base", steps_ms=tuple([10.0] * 99 + [12.0]))
    slow = gi.Phase("kernel, copies during compute", "kernel", tuple([15.0] * 99 + [30.0]), 10 * 10**9, 1.0)
    fine = gi.Phase("memcpy, copies during compute", "memcpy", tuple([10.2] * 99 + [12.5]), 30 * 10**9, 1.0)
    r50, r99 = gi.ratios(slow, base)
    assert r50 == pytest.approx(1.5)
    assert r99 == pytest.approx(gi.percentile(slow.steps_ms, 99) / gi.percentile(base.steps_ms, 99))
    phases = [base,
              gi.Phase("memcpy, copies alone", "memcpy", copy_bytes=40 * 10**9, copy_s=1.0), fine,
              gi.Phase("kernel, copies alone", "kernel", copy_bytes=20 * 10**9, copy_s=1.0), slow]
    lines = gi.report(phases, "memcpy")
    text = "\n".join(lines)
    assert "| memcpy, copies during compute | 100 | 1.020 |" in text
    assert "| memcpy, copies alone | - | - | - | 40.0 | - |" in text
    verdicts = {ln.split(":")[0]: ln for ln in lines if "target <=" in ln}
    assert verdicts["memcpy (default)"].endswith(": met") and "0.75 of their rate alone" in verdicts["memcpy (default)"]
    assert verdicts["kernel"].endswith("NOT met")  # 1.5x at p50, and only half its rate alone


def test_copies_below_their_share_alone_miss_the_target() -> None:
    base = gi.Phase("base", steps_ms=(10.0,) * 10)
    starved = gi.Phase("auto, copies during compute", "auto", (10.0,) * 10, 5 * 10**9, 1.0)
    alone = gi.Phase("auto, copies alone", "auto", copy_bytes=10 * 10**9, copy_s=1.0)
    (verdict,) = [ln for ln in gi.report([base, alone, starved], "auto") if "target" in ln]
    assert "0.50 of their rate alone" in verdict and verdict.endswith("NOT met")


def test_interference_arguments() -> None:
    a = gi.parse_args(["--methods", "auto, memcpy", "--seconds", "2"])
    assert a.methods == ["auto", "memcpy"] and a.seconds == 2.0 and a.requests == 16 and a.page_mib == 8
    assert gi.parse_args([]).methods == list(gi.METHODS)
    for bad in (["--methods", "dma"], ["--methods", ","], ["--seconds", "0"], ["--requests", "-1"]):
        with pytest.raises(SystemExit):
            gi.parse_args(bad)


def test_log_path_names_the_gpu_and_day() -> None:
    p = gi.log_path("NVIDIA H100 80GB HBM3", datetime.date(2026, 11, 27))
    assert os.path.basename(p) == "gpu_interference_nvidia_h100_80gb_hbm3_2026-11-27.log"
    assert os.path.dirname(p) == str(ROOT / "bench" / "results")


def test_store_retrieve_arguments_and_hybrid_shape() -> None:
    a = gsr.parse_args(["--inflight", "1,8", "--methods", "memcpy", "--page-kib", "1024"])
    assert a.inflight == [1, 8] and a.methods == ["memcpy"] and a.pages == [1 << 20]
    d = gsr.parse_args([])
    assert d.inflight == [1, 8, 64] and d.methods == ["memcpy", "kernel"] and not d.no_hybrid
    for bad in (["--methods", "dma"], ["--inflight", "0"], ["--batches", "x"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            gsr.parse_args(bad)
    shape = gsr.hybrid_shape()
    assert len(shape.tensors) == 12 and all(t == ["full", "mamba", "mamba", "mamba"] for t in shape.tensors)
    assert shape.chunks == 16 and shape.tokens_per_block == 544
    assert shape.mamba_state_bytes <= shape.page_bytes  # a GDN state fits the (padded) attention page
    assert 210e6 <= shape.attention_bytes <= 218e6, shape.attention_bytes  # about 214 MB a prefill step
    assert shape.step_bytes == shape.attention_bytes + 3 * 12 * shape.mamba_state_bytes


def test_fixed_cost_and_verdict() -> None:
    # 1 MiB at 50 GB/s moves in ~21 us; a request that took 321 us cost ~300 us beyond its bytes.
    assert gsr.fixed_cost_us(321e-6, 1_048_576, 50.0) == pytest.approx(321 - 20.97152)
    rows = [{"method": "memcpy", "shape": "a", "store_vs_raw": 0.95, "retrieve_vs_raw": 0.91},
            {"method": "memcpy", "shape": "b", "store_vs_raw": 0.97, "retrieve_vs_raw": 0.93},
            {"method": "kernel", "shape": "a", "store_vs_raw": 0.95, "retrieve_vs_raw": 0.52}]
    memcpy, kernel = gsr.verdict(rows).splitlines()
    assert memcpy.startswith("memcpy: worst 0.91") and memcpy.endswith(": met")
    assert kernel.startswith("kernel: worst 0.52") and "NOT met in 1 of 1 shapes (a)" in kernel


@pytest.mark.skipif(cupy_available() and device_count() > 0, reason="a GPU is here: the benches would run")
@pytest.mark.parametrize("bench", ["gpu_interference.py", "gpu_store_retrieve.py", "gpu_copy.py"])
def test_benches_skip_without_a_gpu(bench: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HKVD_REQUIRE_GPU"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / bench)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "run it on a GPU node" in out.stderr and ("cupy is not installed" in out.stderr
                                                     or "no CUDA device" in out.stderr)
    env["HKVD_REQUIRE_GPU"] = "1"
    strict = subprocess.run([sys.executable, str(ROOT / "bench" / bench)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert strict.returncode == 1  # a GPU job cannot pass by skipping
