"""Sampled verification, the engine's side (``hkvd.shim.verify``): which requests are sampled, the option's
checks at start-up, and which chunks of a plan are compared instead of stored."""

from __future__ import annotations

import pytest

from hkvd.shim import plans
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.verify import sampled
from hkvd.transport.wire.kv import Item

IDS = [f"cmpl-{i}" for i in range(4000)]


def test_the_same_request_id_is_always_treated_alike() -> None:
    picked = [r for r in IDS if sampled(r, 0.1, seed=7)]
    assert picked == [r for r in IDS if sampled(r, 0.1, seed=7)]  # a pure function of (seed, id, fraction)
    assert 300 < len(picked) < 500  # about a tenth of 4000 ids (a fixed set: the count is fixed too)
    other = [r for r in IDS if sampled(r, 0.1, seed=8)]
    assert other != picked and len(set(other) & set(picked)) < len(picked) // 2  # the seed picks others


def test_fraction_zero_samples_none_and_one_samples_every_request() -> None:
    assert not any(sampled(r, 0.0) for r in IDS)
    assert all(sampled(r, 1.0) for r in IDS)
    # A larger fraction keeps every request a smaller one sampled (one hash, one threshold).
    small = {r for r in IDS if sampled(r, 0.01)}
    assert small and small <= {r for r in IDS if sampled(r, 0.05)}


def test_verify_fraction_defaults_on_and_refuses_bad_values_with_the_range() -> None:
    assert ShimConfig.from_extra({"socket_path": "/x"}).verify_fraction == 0.01
    assert ShimConfig.from_extra({"socket_path": "/x", "verify_fraction": "1"}).verify_fraction == 1.0
    for bad in (-0.1, 1.5, "nan"):
        with pytest.raises(ValueError, match=r"verify_fraction=.* must be in \[0, 1\]"):
            ShimConfig.from_extra({"verify_fraction": bad})
    with pytest.raises(ValueError, match=r"verify_fraction.*is not a float"):
        ShimConfig.from_extra({"verify_fraction": "often"})


def test_a_sampled_hits_chunks_are_compared_and_the_rest_stored() -> None:
    items = [Item(g, i, bytes([i]) * 16, [10 * g + i + 1]) for i in range(4) for g in (0, 1)]
    stores, checks = plans.split_verified(items, 3)
    assert [(it.group_id, it.chunk_index) for it in checks] == [(g, i) for i in range(3) for g in (0, 1)]
    assert [(it.group_id, it.chunk_index) for it in stores] == [(0, 3), (1, 3)]
    assert plans.split_verified(items, 0) == (items, [])  # not sampled: every chunk stored
