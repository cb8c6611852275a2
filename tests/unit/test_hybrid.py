"""The hybrid hit rule against a brute-force reference and against vLLM's traces."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvd.daemon.cache.hybrid import (
    GroupRule,
    HitPlan,
    mamba_checkpoint_keep,
    plan_hit,
    required_chunks,
)

# ---------------------------------------------------------------- reference model


def ref_needed(rule: GroupRule, n: int, c: int) -> list[int]:
    """Needed chunks, written token by token: obviously correct, slow."""
    if n == 0:
        return []
    if rule.kind == "full":
        return list(range(n))
    if rule.kind == "mamba":
        return [n - 1]
    end = n * c
    tokens = range(max(0, end - rule.window_tokens), end)
    return sorted({t // c for t in tokens})


def ref_plan(rules: list[GroupRule], num_chunks: int, c: int, avail: set[tuple[int, int]], cap: int | None):
    limit = num_chunks if cap is None else max(0, min(num_chunks, cap))
    best = 0
    for n in range(limit + 1):
        if all((r.group_id, i) in avail for r in rules for i in ref_needed(r, n, c)):
            best = n
    return best


class Probe:
    """A `present` callback that records how often each (group, chunk) was asked."""

    def __init__(self, avail: set[tuple[int, int]]) -> None:
        self.avail = avail
        self.calls: Counter[tuple[int, int]] = Counter()

    def __call__(self, group_id: int, chunk: int) -> bool:
        self.calls[(group_id, chunk)] += 1
        return (group_id, chunk) in self.avail


# ---------------------------------------------------------------- strategies


@st.composite
def scenarios(draw):
    c = draw(st.sampled_from([1, 2, 3, 4, 16]))
    num_chunks = draw(st.integers(0, 24))
    kinds = draw(st.lists(st.sampled_from(["full", "swa", "mamba"]), min_size=1, max_size=6))
    rules = []
    for gid, kind in enumerate(kinds):
        window = draw(st.integers(1, 6 * c)) if kind == "swa" else 0
        rules.append(GroupRule(gid, kind, window))
    # Mostly-present groups with a few holes make long hits likely, which is where the
    # downward search and the swa interval reuse get exercised.
    density = draw(st.sampled_from([0.5, 0.85, 0.97, 1.0]))
    avail = set()
    for r in rules:
        for i in range(num_chunks):
            if draw(st.floats(0, 1)) < density:
                avail.add((r.group_id, i))
    cap = draw(st.none() | st.integers(-1, 30))
    return rules, num_chunks, c, avail, cap


# ---------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_matches_brute_force(scn) -> None:
    rules, num_chunks, c, avail, cap = scn
    probe = Probe(avail)
    plan = plan_hit(rules, num_chunks, c, probe, max_chunks=cap)
    assert plan.hit_chunks == ref_plan(rules, num_chunks, c, avail, cap)
    # Every (group, chunk) is probed at most once: linear in the prefix, never quadratic.
    assert all(v == 1 for v in probe.calls.values()), probe.calls
    assert set(plan.needed) == {r.group_id for r in rules}
    for r in rules:
        assert plan.needed[r.group_id] == ref_needed(r, plan.hit_chunks, c)
        # What the plan tells a retrieve to load is actually there.
        assert all((r.group_id, i) in avail for i in plan.needed[r.group_id])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["full", "swa", "mamba"]), st.integers(1, 64), st.integers(1, 200), st.integers(0, 40))
def test_required_chunks_matches_token_model(kind: str, c: int, window: int, n: int) -> None:
    rule = GroupRule(0, kind, window if kind == "swa" else 0)  # type: ignore[arg-type]
    assert list(required_chunks(rule, n, c)) == ref_needed(rule, n, c)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_never_rounds_up(scn) -> None:
    """The hit never exceeds any single group's own best answer."""
    rules, num_chunks, c, avail, cap = scn
    plan = plan_hit(rules, num_chunks, c, lambda g, i: (g, i) in avail, max_chunks=cap)
    for r in rules:
        alone = plan_hit([r], num_chunks, c, lambda g, i: (g, i) in avail, max_chunks=cap)
        assert plan.hit_chunks <= alone.hit_chunks


# ---------------------------------------------------------------- hand-written cases


def _avail(**groups: list[int]) -> set[tuple[int, int]]:
    return {(int(g[1:]), i) for g, idx in groups.items() for i in idx}


def test_trace_a_block16_hit48() -> None:
    # vllm-connector.md 5.A: FullAttention + Mamba, block 16 = chunk 16. r1 stored 4 attention
    # chunks and mamba states at 32 (idx 1), 48 (idx 2), 64 (idx 3); r3 asks 64 tokens with
    # the last one to recompute -> cap 3 chunks = 48 tokens, load mamba state(48) = idx 2.
    rules = [GroupRule(0, "full"), GroupRule(1, "mamba")]
    avail = _avail(g0=[0, 1, 2, 3], g1=[1, 2, 3])
    plan = plan_hit(rules, 4, 16, lambda g, i: (g, i) in avail, max_chunks=(64 - 1) // 16)
    assert plan == HitPlan(3, {0: [0, 1, 2], 1: [2]})
    assert 3 * 16 == 48


def test_mamba_state_missing_at_boundary_falls_back_not_up() -> None:
    # Retention interval 0: only the replay boundary (state 32 = idx 1) was offered.
    rules = [GroupRule(0, "full"), GroupRule(1, "mamba")]
    avail = _avail(g0=[0, 1, 2, 3], g1=[1])
    plan = plan_hit(rules, 4, 16, lambda g, i: (g, i) in avail)
    assert plan.hit_chunks == 2
    assert plan.needed == {0: [0, 1], 1: [1]}


def test_mamba_state_beyond_full_run_is_not_used() -> None:
    rules = [GroupRule(0, "full"), GroupRule(1, "mamba")]
    avail = _avail(g0=[0, 1], g1=[3])  # state at 64 tokens but attention only up to 32
    assert plan_hit(rules, 4, 16, lambda g, i: (g, i) in avail).hit_chunks == 0


def test_swa_window_boundary_exact() -> None:
    # Gemma-like: window 32, chunk 16. n=4 (L=64) needs tokens [32, 64) = chunks 2, 3 only.
    swa = GroupRule(1, "swa", 32)
    assert list(required_chunks(swa, 4, 16)) == [2, 3]
    # Window 33: token 31 is in chunk 1 -> three chunks.
    assert list(required_chunks(GroupRule(1, "swa", 33), 4, 16)) == [1, 2, 3]
    # Window 31: tokens [33, 64) -> chunks 2, 3.
    assert list(required_chunks(GroupRule(1, "swa", 31), 4, 16)) == [2, 3]
    # Window longer than the prefix: everything from 0.
    assert list(required_chunks(GroupRule(1, "swa", 4096), 3, 16)) == [0, 1, 2]


def test_swa_only_needs_suffix() -> None:
    # SWA blocks outside the window were freed (null) before the store: only the suffix exists.
    rules = [GroupRule(0, "full"), GroupRule(1, "swa", 32)]
    avail = _avail(g0=[0, 1, 2, 3, 4], g1=[2, 3])
    plan = plan_hit(rules, 5, 16, lambda g, i: (g, i) in avail)
    assert plan == HitPlan(4, {0: [0, 1, 2, 3], 1: [2, 3]})


def test_swa_hole_jumps_below_it() -> None:
    rules = [GroupRule(0, "swa", 16)]  # one chunk of window at chunk 16
    avail = _avail(g0=[0, 1, 2, 4, 5, 6, 7])  # hole at 3, 7 present
    assert plan_hit(rules, 8, 16, lambda g, i: (g, i) in avail).hit_chunks == 8
    rules = [GroupRule(0, "swa", 48)]  # three chunks of window
    assert plan_hit(rules, 8, 16, lambda g, i: (g, i) in avail).hit_chunks == 8
    rules = [GroupRule(0, "swa", 49)]  # four chunks: 8 needs 4..7 ok
    assert plan_hit(rules, 8, 16, lambda g, i: (g, i) in avail).hit_chunks == 8
    rules = [GroupRule(0, "swa", 49), GroupRule(1, "mamba")]
    avail |= _avail(g1=[5])  # only state at idx 5 -> n = 6 needs swa chunks 2..5: hole at 3
    assert plan_hit(rules, 8, 16, lambda g, i: (g, i) in avail).hit_chunks == 0


def test_several_mamba_groups_take_minimum() -> None:
    # Trace B: three GDN groups + one attention group, block 512; all states at 512 tokens.
    rules = [GroupRule(0, "mamba"), GroupRule(1, "mamba"), GroupRule(2, "mamba"), GroupRule(3, "full")]
    avail = _avail(g0=[0, 1], g1=[0, 1], g2=[0], g3=[0, 1])
    plan = plan_hit(rules, 2, 512, lambda g, i: (g, i) in avail)
    assert plan == HitPlan(1, {0: [0], 1: [0], 2: [0], 3: [0]})


def test_zero_is_always_served() -> None:
    rules = [GroupRule(0, "full"), GroupRule(1, "mamba"), GroupRule(2, "swa", 8)]
    assert plan_hit(rules, 10, 4, lambda g, i: False) == HitPlan(0, {0: [], 1: [], 2: []})
    assert plan_hit(rules, 0, 4, lambda g, i: True).hit_chunks == 0


def test_max_chunks_caps_and_never_probes_beyond() -> None:
    rules = [GroupRule(0, "full"), GroupRule(1, "mamba")]
    probe = Probe(_avail(g0=list(range(10)), g1=list(range(10))))
    assert plan_hit(rules, 10, 4, probe, max_chunks=3).hit_chunks == 3
    assert max(i for _, i in probe.calls) < 3


def test_mamba_checkpoint_keep() -> None:
    assert all(mamba_checkpoint_keep(i, 1) for i in range(10))
    assert [i for i in range(12) if mamba_checkpoint_keep(i, 4)] == [3, 7, 11]
    with pytest.raises(ValueError, match="interval"):
        mamba_checkpoint_keep(0, 0)


def test_checkpoint_interval_lands_hits_on_multiples() -> None:
    k = 4
    rules = [GroupRule(0, "full"), GroupRule(1, "mamba")]
    avail = _avail(g0=list(range(10)), g1=[i for i in range(10) if mamba_checkpoint_keep(i, k)])
    assert plan_hit(rules, 10, 16, lambda g, i: (g, i) in avail).hit_chunks == 8


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, "swa", 0), "window_tokens"),
        ((0, "cross_attention", 0), "unknown kind"),
        ((-1, "full", 0), "group_id"),
    ],
)
def test_group_rule_rejects(args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GroupRule(*args)


def test_plan_hit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        plan_hit([], 3, 16, lambda g, i: True)
    with pytest.raises(ValueError, match="duplicate"):
        plan_hit([GroupRule(0, "full"), GroupRule(0, "mamba")], 3, 16, lambda g, i: True)
    with pytest.raises(ValueError, match="chunk_size"):
        plan_hit([GroupRule(0, "full")], 3, 0, lambda g, i: True)
