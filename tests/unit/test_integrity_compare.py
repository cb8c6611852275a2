"""Sampled-hit comparison (daemon/integrity/compare.py) and quarantine bookkeeping (quarantine.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hkvd.daemon.integrity.compare import decode, entry_error, value_layout
from hkvd.daemon.integrity.quarantine import MAX_ROWS, Quarantine
from hkvd.transport.layout import GroupSpec, View

FP = b"\x01" * 16


def _group(dtype: str, page: int, kind: str = "full", layers: int = 2) -> GroupSpec:
    return GroupSpec(0, kind, 16, 0, 8, dtype, (View(0, 0, layers, page * 8, page, page),))


def _bf16(values: np.ndarray) -> bytes:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def test_identical_bytes_are_exact_and_small_drift_is_small() -> None:
    rng = np.random.default_rng(1)
    ref = rng.standard_normal(2 * 64).astype(np.float32)
    g = _group("bfloat16", 128)
    assert entry_error(_bf16(ref), _bf16(ref), g) == 0.0
    drift = entry_error(_bf16(ref * 1.01), _bf16(ref), g)
    assert 0.0 < drift < 0.05
    other = rng.standard_normal(ref.size).astype(np.float32)
    assert entry_error(_bf16(other), _bf16(ref), g) > 1.0  # unrelated values: about sqrt(2)


def test_a_few_values_far_off_weigh_by_their_share_and_a_wrong_entry_is_far() -> None:
    # A recomputed chunk whose rounding a deep model amplified: 4 of 4,096 values off by half the largest
    # value. The entry as a whole is close; the next chunk's entry is not.
    rng = np.random.default_rng(2)
    ref = rng.standard_normal(4096).astype(np.float32)
    fresh = ref + rng.standard_normal(ref.size).astype(np.float32) * 0.005
    fresh[[7, 900, 2000, 4000]] += 0.5 * float(np.abs(ref).max())
    g = _group("bfloat16", 4096)
    assert entry_error(_bf16(fresh), _bf16(ref), g) < 0.1
    shifted = np.roll(ref, 128)  # a byte range one token (128 values) off
    assert entry_error(_bf16(shifted), _bf16(ref), g) > 1.0


def test_bfloat16_is_the_upper_half_of_a_float32() -> None:
    exact = np.array([1.0, -2.5, 0.0, 3.0e38], np.float32)
    assert decode(np.frombuffer(_bf16(exact), np.uint8), "bfloat16").tolist() == pytest.approx(exact.tolist(),
                                                                                               rel=1e-2)
    assert entry_error(_bf16(np.array([1.0, 2.5])), _bf16(np.array([1.0, 2.0])), _group("bfloat16", 2, layers=1)) \
        == pytest.approx(0.5 / math.sqrt(1.0 + 4.0))


def test_float32_error_is_the_norm_of_the_difference_over_the_norm_of_the_reference() -> None:
    ref = np.array([1.0, -4.0, 2.0, 0.5], np.float32)
    fresh = ref.copy()
    fresh[2] += 0.2
    norm = math.sqrt(1.0 + 16.0 + 4.0 + 0.25)
    assert entry_error(fresh.tobytes(), ref.tobytes(), _group("float32", 8)) == pytest.approx(0.2 / norm, rel=1e-6)
    assert entry_error(fresh.tobytes(), np.zeros(4, np.float32).tobytes(), _group("float32", 8)) == math.inf


def test_a_value_that_turns_nan_or_infinite_on_one_side_is_infinitely_wrong() -> None:
    ref = np.ones(4, np.float32)
    fresh = ref.copy()
    fresh[1] = np.nan
    assert entry_error(fresh.tobytes(), ref.tobytes(), _group("float32", 8)) == math.inf
    fresh[1] = np.inf
    assert entry_error(fresh.tobytes(), ref.tobytes(), _group("float32", 8)) == math.inf


def test_fp8_formats_decode_known_codes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    e4m3 = decode(codes, "float8_e4m3fn")
    assert np.array_equal(decode(codes, "uint8"), e4m3, equal_nan=True)  # vLLM's fp8 caches: read as e4m3fn
    assert e4m3[0x38] == 1.0 and e4m3[0x7E] == 448.0 and e4m3[0xB8] == -1.0 and math.isnan(e4m3[0x7F])
    assert e4m3[0x01] == 2.0 ** -9  # the smallest subnormal
    e5m2 = decode(codes, "float8_e5m2")
    assert e5m2[0x3C] == 1.0 and e5m2[0x7B] == 57344.0 and e5m2[0x7C] == math.inf and math.isnan(e5m2[0x7D])
    g = _group("float8_e4m3fn", 4)
    # 1.125 against 1.0 in one of every four values [1, 1, 2, 0]: 0.125 * sqrt(2) / sqrt(2 * (1 + 1 + 4))
    assert entry_error(bytes([0x38, 0x39, 0x40, 0x00] * 2), bytes([0x38, 0x38, 0x40, 0x00] * 2), g) \
        == pytest.approx(0.125 / math.sqrt(6.0))


def test_a_mamba_page_is_compared_state_by_state_in_each_dtype() -> None:
    # bf16[2, 2] then float32[3]: 8 + 12 = 20 bytes a page
    g = _group("state:bfloat16[2, 2];float32[3]", 20, kind="mamba", layers=1)
    assert value_layout(g).runs == ((0, 8, "bfloat16"), (8, 12, "float32"))
    conv = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    ssm = np.array([10.0, -20.0, 5.0], np.float32)
    ref = _bf16(conv) + ssm.tobytes()
    bumped = ssm.copy()
    bumped[0] += 2.0
    # the float32 state alone: 2 / ||(10, -20, 5)||, not diluted by the bf16 state's values
    assert entry_error(_bf16(conv) + bumped.tobytes(), ref, g) == pytest.approx(2.0 / math.sqrt(525.0))
    # Read as one dtype, the same bytes would mean other numbers: the layout matters.
    assert not value_layout(_group("state:bfloat16[2, 2];float32[4]", 20, kind="mamba")).runs


def test_an_unknown_dtype_is_compared_byte_for_byte() -> None:
    g = _group("complex_thing", 4)
    assert value_layout(g).exact
    assert entry_error(b"abcd", b"abcd", g) == 0.0
    assert entry_error(b"abce", b"abcd", g) == math.inf


def test_sizes_must_agree() -> None:
    with pytest.raises(ValueError, match="8 bytes, its recomputed copy 4"):
        entry_error(b"\0" * 4, b"\0" * 8, _group("float32", 8))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _record(q: Quarantine, diverged: int, group: int = 1, fp: bytes = FP) -> bool:
    return q.record(fp, group, "full", checked=max(diverged, 1), diverged=diverged, missing=0, max_error=0.9,
                    evidence="chunk 0", threshold=3, window_s=60.0)


def test_divergences_within_the_window_quarantine_the_pair_only() -> None:
    clock = Clock()
    q = Quarantine(clock, wall=lambda: 1234.0)
    assert not _record(q, 2)
    clock.t += 61.0  # those two fall out of the window
    assert not _record(q, 2)
    assert (FP, 1) not in q
    clock.t += 1.0
    assert _record(q, 1)
    assert (FP, 1) in q and (FP, 2) not in q and (b"\x02" * 16, 1) not in q
    assert not _record(q, 0, group=2)
    rows = {r.group: r for r in q.statistics().groups}
    assert (rows["1"].checks, rows["1"].divergences, rows["1"].quarantined, rows["1"].since) == (5, 5, True, 1234.0)
    assert (rows["2"].checks, rows["2"].matches, rows["2"].quarantined) == (1, 1, False)
    assert q.statistics().quarantines == 1


def test_lift_by_prefix_or_all() -> None:
    q = Quarantine(Clock())
    other = b"\x02" * 16
    for fp in (FP, other):
        _record(q, 3, fp=fp)
    assert q.lift("03030303") == []
    assert q.lift("01010101") == [(FP, 1)]
    assert (FP, 1) not in q and (other, 1) in q
    assert not _record(q, 1)  # lifted: the window starts over
    assert q.lift_all("SIGHUP") == [(other, 1)]
    assert len(q) == 0 and q.statistics().lifted == 2


def test_rows_past_the_bound_fold_into_other_and_never_quarantine() -> None:
    q = Quarantine(Clock())
    for i in range(MAX_ROWS + 5):
        _record(q, 0, group=i)
    assert not _record(q, 3, group=MAX_ROWS + 10)
    rows = q.statistics().groups
    assert len(rows) == MAX_ROWS and rows[-1].fingerprint == "other" and rows[-1].divergences == 3
    assert len(q) == 0


def test_item_sizes_are_the_numpy_types_sizes() -> None:
    """The sizes the layout reads without importing ml_dtypes are those of the types the comparison views."""
    import numpy as np

    from hkvd.daemon.integrity import compare

    assert {k: np.dtype(v).itemsize for k, v in compare._numpy().items()} == compare._ITEMSIZE
