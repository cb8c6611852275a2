"""bench/: the store/retrieve path checks bytes against a real daemon, and the report renders.

Correctness only (no timing assertions): a store/retrieve row through a real ``hkvd serve``
and the raw-CMA helper child, and the tables of every run from result dicts shaped as the runs
write them. Plots are drawn when matplotlib is installed (``make bench`` installs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hkvd.daemon.cache.pool import HugePagePool

ROOT = Path(__file__).resolve().parents[2]
# bench/ is a top-level folder of the checkout, not an installed package. The checkout's root goes
# on sys.path only while bench imports: left there, a plain `import cuda` (CuPy's NVIDIA bindings)
# would find hkvd's cuda/ folder (tests/unit/test_packaging.py checks that it cannot).
sys.path.insert(0, str(ROOT))
try:
    from bench import control_plane, load_overlap, scale, store_retrieve, vllm_e2e
    from bench.common import Daemon, engine_result, md_table
finally:
    sys.path.remove(str(ROOT))

KIB = 1024


@pytest.mark.out_of_process
def test_store_retrieve_rows_move_every_byte() -> None:
    page, batches = 64 * KIB, [1, 4]
    store_retrieve._allow_any_ptracer()
    pool_bytes = 32 << 20  # a small pool: 16 superblocks of 2 MiB
    helper = store_retrieve.Helper(pool_bytes, "off")
    scratch_pool = HugePagePool(pool_bytes, "off")
    try:
        scratch_pool.prefault()
        scratch = np.frombuffer(scratch_pool.buffer, dtype=np.int8)
        with Daemon("--chunk-size", "16", pool_gb=0.0625, hugepages="off") as daemon:
            # _run_page raises unless each retrieve brings back exactly the stored bytes.
            rows = store_retrieve._run_page(daemon.socket_path, helper, scratch, page, batches, 1, lambda *_: None,
                                            par=True)
        del scratch
    finally:
        scratch_pool.close()
        helper.close()
    assert [r["batch"] for r in rows] == batches
    assert all(r["ping_us"] > 0 for r in rows)
    for r in rows:
        assert r["request_bytes"] == r["batch"] * page
        for k in ("store_gbps", "raw_read_gbps", "raw_read_par_gbps", "retrieve_gbps", "raw_write_gbps",
                  "raw_write_par_gbps", "memcpy_to_gbps", "memcpy_from_gbps", "mapped_gbps", "mapped_fresh_gbps"):
            assert r[k] > 0, k  # the mapped copies: byte-exact too (checked once per row), from a leased lookup
    result = {"rows": rows, "summary": {"split_parts": 1}}
    headers, table_rows = store_retrieve.table(result)
    assert "store/raw par" not in headers and len(table_rows) == 2
    text = md_table(headers, table_rows)
    assert "| 64 KiB | 4 |" in text


def _cp_result(with_lmcache: bool) -> dict:
    rows = [{"op": op, "engines": n, "n": 10, "ops_s": 1000.0 * n, "p50_us": 100.0, "p99_us": 200.0,
             "p50_vs_echo": 5.0} for n in (1, 8, 64) for op in control_plane.OPS]
    res: dict = {"echo": {"p50_us": 20.0, "p99_us": 30.0, "ops_s": 50000.0}, "rows": rows,
                 "lmcache": {"skipped": "LMCache not installed: make bench-peers"}}
    if with_lmcache:
        lm = {"ping": {"p50_us": 300.0, "p99_us": 900.0, "ops_s": 3000.0},
              "lookup": {"p50_us": 1200.0, "p99_us": 3000.0, "ops_s": 800.0}}
        ours = {"ping": {"p50_us": 90.0, "p99_us": 200.0, "ops_s": 10000.0},
                "lookup_lease": {"p50_us": 150.0, "p99_us": 300.0, "ops_s": 6000.0}}
        res["lmcache"] = {"lmcache": lm, "hkvd": ours, "pairs": {"ping": "ping", "lookup": "lookup_lease"},
                          "ping_rate_ratio": 10000 / 3000, "lookup_rate_ratio": 6000 / 800}
    return res


@pytest.mark.parametrize("with_lmcache", [False, True])
def test_control_plane_table(with_lmcache: bool) -> None:
    headers, rows = control_plane.table(_cp_result(with_lmcache))
    text = md_table(headers, rows)
    assert "(bare UDS echo)" in text
    assert ("(LMCache ping)" in text and "(hkvd lookup_lease, same run)" in text) == with_lmcache


def test_vllm_e2e_table_and_skip() -> None:
    runs = [{"run": name, "prompts": 2, "prompt_tokens": 1800, "cached_tokens": cached,
             "prefill_computed": 1800 - cached, "hkvd_share": cached / 1800, "ttft_ms_p50": ttft,
             "ttft_vs_cold": ttft / 200.0} for name, cached, ttft in (("cold", 0, 200.0), ("warm", 1792, 60.0))]
    headers, rows = vllm_e2e.table({"models": [{"model": "qwen3_next", "runs": runs, "warm_vs_cold_ttft": 0.3}]})
    text = md_table(headers, rows)
    assert "| qwen3_next | warm | 2 x 900 | 8 | 1792 | 99.6% |" in text
    headers, rows = vllm_e2e.table({"skipped": "vllm not installed (make vllm)", "models": []})
    assert "vllm not installed" in md_table(headers, rows)


def _step(t: float, *, a: int = 1, pending: int = 0, busy: bool = False, started: int = 0,
          in_flight: int = 0) -> dict:
    return {"t": t, "a": a, "pending": pending, "busy": busy, "started": started, "in_flight": in_flight}


def test_load_overlap_classes_spans_and_table() -> None:
    steps = [_step(0.00), _step(0.01), _step(0.02),
             _step(0.04, pending=1, started=1, in_flight=1),  # submits the load
             _step(0.06, pending=1, busy=True, in_flight=1),  # wholly inside it
             _step(0.07, pending=1, busy=True),  # reads the reply
             _step(0.12, pending=1),  # the loaded prompt's last token, beside A
             _step(0.13), _step(0.135, a=0), _step(0.14)]
    got = load_overlap.classify(steps)
    assert [c for c, _ in got] == ["no load", "no load", "load in flight", "load in flight", "load in flight",
                                   "loaded prompt computes", "no load", "no load"]
    assert [round(ms) for _, ms in got] == [10, 10, 20, 20, 10, 50, 10, 10]  # a step without A's token is skipped
    (span,) = load_overlap.load_spans(steps)
    assert span == (pytest.approx(30.0), 1)
    res = {"rounds": [{"steps": steps, "prefixes": []}], "loads": {"loaded_bytes": 128 << 20, "loads_failed": 0}}
    out = load_overlap.summarize(res)
    assert out["p99_ratio"] == pytest.approx(2.0) and out["loads"] == 1
    headers, rows = load_overlap.table(out)
    assert len(rows) == 4 and all(len(r) == len(headers) for r in rows)
    assert "1 x 128 MiB" in md_table(headers, rows)
    assert "vllm not installed" in md_table(*load_overlap.table({"skipped": "vllm not installed", "rows": []}))


def test_load_overlap_check_refuses_a_wrong_answer_or_a_short_hit() -> None:
    good = {"tokens": [5], "logprobs": [-1.0], "num_cached_tokens": 4096}
    ref = {**good, "num_cached_tokens": 0}
    load_overlap.check({"rounds": [{"prefixes": [{"reference": ref, "loaded": good}]}]}, 4096)
    for bad in ({**good, "tokens": [6]}, {**good, "num_cached_tokens": 3968}):
        with pytest.raises(RuntimeError):
            load_overlap.check({"rounds": [{"prefixes": [{"reference": ref, "loaded": bad}]}]}, 4096)


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install -e '.[bench]')")
    from bench.common import try_pyplot

    plt = try_pyplot()
    for with_lmcache in (False, True):
        (path,) = control_plane.plot(plt, _cp_result(with_lmcache), tmp_path)
        assert Path(path).stat().st_size > 1000


def test_cma_helper_reads_walk_fresh_pool_and_writes_read_the_last_read() -> None:
    from bench.cma_helper import _Cursor

    class Pool:
        base_addr, size = 1 << 20, 100

    c = _Cursor(Pool())  # type: ignore[arg-type]
    assert [c.take(30), c.take(30), c.take(30)] == [Pool.base_addr, Pool.base_addr + 30, Pool.base_addr + 60]
    assert c.written(30) == c.written(20) == Pool.base_addr + 60  # what the last read filled
    assert c.written(40) == Pool.base_addr  # more than the last read: a fresh stretch (wrapped here)
    assert c.take(10) == Pool.base_addr + 40


@pytest.mark.out_of_process
def test_store_retrieve_run_sizes_a_helper_per_page_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small pages store little: the helper's pool still has to be a valid pool (>= one 2 MiB superblock).
    monkeypatch.setitem(store_retrieve.QUICK, "pages", [64 * KIB, 128 * KIB])
    monkeypatch.setitem(store_retrieve.QUICK, "batches", [1, 2])
    monkeypatch.setitem(store_retrieve.QUICK, "repeats", 1)
    result = store_retrieve.run(quick=True, hugepages="off", log=lambda *_: None)
    assert [(r["page_bytes"], r["batch"]) for r in result["rows"]] == [
        (64 * KIB, 1), (64 * KIB, 2), (128 * KIB, 1), (128 * KIB, 2)]
    assert all(r["store_vs_raw_best"] > 0 and r["retrieve_vs_raw_best"] > 0 for r in result["rows"])


# Run as the bench runs: in a process of its own, whose heap is the bench's. In the test process, after
# other tests imported torch or vLLM, CPython's collector would wait for far more objects before a full
# collection, and the baseline might never collect. 32 000 entries: the baseline's first full collection
# comes near 20 000 here.
_GC_CHILD = """
import gc, json
from bench import scale
callbacks = list(gc.callbacks)
rows = scale.gc_pauses(ENTRIES, log=lambda *_: None)
print(json.dumps({"rows": rows, "frozen": gc.get_freeze_count(), "callbacks_kept": gc.callbacks == callbacks}))
"""


@pytest.mark.out_of_process
def test_scale_gc_pauses_compares_both_collectors_and_leaves_none_frozen() -> None:
    import json
    import subprocess

    entries = 32_000
    out = subprocess.run([sys.executable, "-c", _GC_CHILD.replace("ENTRIES", str(entries))], cwd=ROOT,
                         capture_output=True, text=True, timeout=100, check=True).stdout
    child = json.loads(out)
    rows = child["rows"]
    assert [r["mode"] for r in rows] == ["python", "hkvd"]
    py, hk = rows
    assert py["freezes"] == 0 and py["freeze_every"] == 0
    assert hk["freezes"] == 1 + entries // hk["freeze_every"]  # start-up, then one per freeze_every writes
    # The comparison means something only if CPython's own collector did run a full collection.
    assert py["full_collections"] >= 1, f"the baseline never ran a full collection in {entries} entries: {py}"
    assert hk["full_collections"] < py["full_collections"]
    for r in rows:
        assert r["entries"] == entries and r["longest_pause_ms"] > 0 and r["gc_s"] >= r["full_collection_s"] >= 0
    assert child["frozen"] == 0 and child["callbacks_kept"]  # the bench process is as it was
    headers, table = scale.table({"index": [], "gc": rows, "prefault": {"pool_bytes": 1 << 20, "kind": "plain",
                                                                        "prefault_gbps": 1.0, "memset_gbps": 2.0,
                                                                        "prefault_vs_memset": 0.5}})
    assert [row[0] for row in table] == ["collector: python", "collector: hkvd", "pre-fault 1 MiB plain"]
    assert all(len(row) == len(headers) for row in table)


@pytest.mark.out_of_process
def test_engine_result_reads_the_bench_line_and_names_a_failure_or_a_hang() -> None:
    import subprocess

    def child(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    res, text = engine_result(child('print("warming up"); print(\'HKVD_BENCH {"startup_s": 1.5}\')'), 10.0, "engine")
    assert res == {"startup_s": 1.5} and text.startswith("warming up")
    with pytest.raises(RuntimeError, match=r"(?s)engine x failed \(rc 3\):.*no luck"):
        engine_result(child('import sys; print("no luck"); sys.exit(3)'), 10.0, "engine x")
    with pytest.raises(RuntimeError, match=r"(?s)engine y ran past 0 s:.*started"):
        engine_result(child('import time; print("started", flush=True); time.sleep(30)'), 0.3, "engine y")
