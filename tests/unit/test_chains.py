"""The chain tracker against a reference model of the hybrid hit rule, and its use by eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvd.daemon.cache.chains import ChainTracker
from hkvd.daemon.cache.eviction import HybridAwarePolicy, LRUPolicy
from hkvd.daemon.cache.index import Index
from hkvd.daemon.cache.pool import HugePagePool

FP = b"f" * 16

LAYOUTS = {
    "attention-only": ({0: "full"}),
    "one-mamba": ({0: "full", 1: "mamba"}),
    "qwen-like": ({0: "full", 1: "full", 2: "mamba", 3: "mamba"}),
}


def ck(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Reference:
    """Which entries can be part of some hit, computed from scratch."""

    def __init__(self, kinds: dict[int, str], parents: list[int | None]) -> None:
        self.full = {g for g, k in kinds.items() if k == "full"}
        self.mamba = {g for g, k in kinds.items() if k == "mamba"}
        self.kinds = kinds
        self.parents = parents
        self.present: set[tuple[int, int]] = set()  # (node, group)

    def path(self, n: int) -> list[int]:
        out = []
        cur: int | None = n
        while cur is not None:
            out.append(cur)
            cur = self.parents[cur]
        return out

    def servable(self, m: int) -> bool:
        if not all((n, g) in self.present for n in self.path(m) for g in self.full):
            return False
        return all((m, g) in self.present for g in self.mamba)

    def subtree(self, n: int) -> list[int]:
        return [m for m in range(len(self.parents)) if n in self.path(m)]

    def useful(self, n: int, g: int) -> bool:
        if self.kinds[g] == "mamba":
            return self.servable(n)
        return any(self.servable(m) for m in self.subtree(n))

    def useful_set(self) -> set[tuple[int, int]]:
        return {(n, g) for n, g in self.present if self.useful(n, g)}


@st.composite
def scenario(draw):
    name = draw(st.sampled_from(sorted(LAYOUTS)))
    kinds = LAYOUTS[name]
    size = draw(st.integers(1, 7))
    parents: list[int | None] = [None] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    if size > 2 and draw(st.booleans()):
        parents[size - 1] = None  # a second root: another prompt
    ops = draw(st.lists(st.tuples(st.booleans(), st.integers(0, size - 1), st.sampled_from(sorted(kinds))),
                        max_size=60))
    return kinds, parents, ops


@settings(max_examples=400, deadline=None)
@given(scenario())
def test_orphans_are_exactly_what_a_removal_makes_useless(case):
    kinds, parents, ops = case
    ref = Reference(kinds, parents)
    full = frozenset(ref.full)
    mamba = frozenset(ref.mamba)
    tracker = ChainTracker(lambda fp: (full, mamba))
    for is_add, n, g in ops:
        key = (FP, g, ck(n))
        parent = ck(parents[n]) if parents[n] is not None else b""
        before = ref.useful_set()
        if is_add:
            if (n, g) in ref.present:
                continue
            ref.present.add((n, g))
            change = tracker.add(key, kinds[g], parent)
        else:
            if (n, g) not in ref.present:
                continue
            ref.present.discard((n, g))
            change = tracker.remove(key, kinds[g])
        after = ref.useful_set()
        before.discard((n, g))  # the removed entry itself
        reported = {(int.from_bytes(k[2], "little"), k[1]) for k in change.orphans}
        revived = {(int.from_bytes(k[2], "little"), k[1]) for k in change.revived}
        # Sound: nothing reported as an orphan can be part of a hit.
        assert not (reported & after), (reported & after)
        # Complete: whatever a removal made useless is reported.
        assert (before - after) <= reported, (before - after) - reported
        # Revived entries are present attention chunks with a state below them again (a broken
        # ancestor is not re-checked: it reported its subtree when it broke).
        assert all(kinds[g] != "mamba" and (n, g) in ref.present for n, g in revived)
    for n, g in list(ref.present):
        tracker.remove((FP, g, ck(n)), kinds[g])
    assert len(tracker) == 0  # no node outlives its entries


def test_attention_chunks_without_a_state_go_first():
    """Chain A loses its only Mamba state: its attention chunks, although recently used, are
    evicted before chain B's older ones under the hybrid policy, and in LRU order under lru."""
    for policy, first_evicted in ((HybridAwarePolicy(), "A"), (LRUPolicy(), "B")):
        # One 2 MiB superblock holds exactly the 8 entries below.
        with HugePagePool(2 << 20, hugepages="off", superblock_bytes=2 << 20) as pool:
            idx = Index(pool, policy)
            idx.set_groups(FP, {0: "full", 1: "mamba"})
            page = 256 << 10
            entries = {}
            for chain, base in (("B", 100), ("A", 200)):  # B is older
                for i in range(3):
                    parent = ck(base + i - 1) if i else b""
                    e = idx.begin_write((FP, 0, ck(base + i)), page, "full", 1, parent)
                    idx.finish_write(e, pending=False)
                    entries[(chain, i)] = e
                m = idx.begin_write((FP, 1, ck(base + 2)), page, "mamba", 1, ck(base + 1))
                idx.finish_write(m, pending=False)
                entries[(chain, "m")] = m
            idx.drop(entries[("A", "m")])  # e.g. invalidated by a step-event gap
            stats = idx.statistics()
            # lru has no use for orphan hints, so its index keeps no chains and marks nothing.
            assert stats.orphans_marked == (3 if policy.uses_orphans else 0)
            assert (stats.chain_nodes > 0) == policy.uses_orphans
            # Keep storing: the first three evictions show the order.
            evicted: list = []
            before = {e.key for e in entries.values()} - {entries[("A", "m")].key}
            for n in range(1, 20):
                e = idx.begin_write((FP, 0, ck(1000 + n)), page, "full", 2)
                idx.finish_write(e, pending=False)
                evicted += [k for k in before if idx.get(k) is None and k not in evicted]
                if len(evicted) >= 3:
                    break
            evicted = evicted[:3]
            chains = {"A" if int.from_bytes(k[2], "little") >= 200 else "B" for k in evicted}
            assert first_evicted in chains, (policy.name, evicted)
            if policy.name == "hybrid":
                assert chains == {"A"}


def test_a_hit_unmarks_an_orphan():
    policy = HybridAwarePolicy()
    policy.insert("a")
    policy.insert("b")
    policy.mark_orphan("b")
    assert next(iter(policy.candidates())) == "b"
    policy.touch("b")
    assert next(iter(policy.candidates())) == "a"


@pytest.mark.parametrize("kind", ["full", "mamba"])
def test_parent_key_travels_on_the_wire(kind):
    from hkvd.transport.errors import ProtocolViolation
    from hkvd.transport.wire.kv import Item, items_to_wire, parse_items

    items = [Item(0, 0, ck(1), [1]), Item(0, 1, ck(2), [2], ck(1))]
    assert parse_items(items_to_wire(items), "t") == items
    with pytest.raises(ProtocolViolation, match="chunk 0 has no parent"):
        parse_items([[0, 0, ck(1), [1], ck(9)]], "t")
    with pytest.raises(ProtocolViolation, match="parent_key must be 16 bytes"):
        parse_items([[0, 1, ck(1), [1], b"short"]], "t")


@pytest.mark.parametrize("policy_cls", [LRUPolicy, HybridAwarePolicy])
def test_candidates_stay_in_order_while_the_index_evicts(policy_cls):
    policy = policy_cls()
    for k in range(10):
        policy.insert(k)
    policy.mark_orphan(7)
    got = []
    for k in policy.candidates():
        got.append(k)
        if k % 2 == 0:
            policy.remove(k)  # evicted; odd keys are "pinned" and stay
    expected = list(range(10))
    if policy_cls is HybridAwarePolicy:
        expected = [7] + [k for k in expected if k != 7]
    assert got == expected
    assert list(policy.candidates()) == ([7, 1, 3, 5, 9] if policy_cls is HybridAwarePolicy else [1, 3, 5, 7, 9])
