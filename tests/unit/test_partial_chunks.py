"""Partial chunks (``hkvd.shim.partial``, ``hkvd.transport.keys.partial_key``): keys, probe positions, probe replies."""

from __future__ import annotations

import pytest

from hkvd.shim import partial
from hkvd.shim.request_state import RequestRecord
from hkvd.shim.spec import GroupInfo
from hkvd.transport.keys import ROOT_KEY, chunk_keys, partial_key
from hkvd.transport.turn_ends import TurnEnds

N = 128
FULL = GroupInfo(0, "full", N, 0)
MAMBA = GroupInfo(1, "mamba", N, 0)
SWA = GroupInfo(2, "swa", N, 64)
TOKENS = list(range(4, 4 + 300))


def test_a_partial_key_is_neither_a_whole_chunks_key_nor_another_lengths() -> None:
    whole = chunk_keys(TOKENS, N)
    assert partial_key(ROOT_KEY, TOKENS[:N]) != whole[0]
    assert partial_key(whole[0], TOKENS[N:2 * N]) != whole[1]
    keys = {partial_key(whole[0], TOKENS[N:end]) for end in (160, 192, 224)}
    assert len(keys) == 3
    assert partial_key(whole[0], TOKENS[N:224]) == partial_key(whole[0], list(TOKENS[N:224]))  # deterministic
    assert partial_key(ROOT_KEY, TOKENS[N:224]) != partial_key(whole[0], TOKENS[N:224])  # the parent counts
    with pytest.raises(ValueError, match="at least one token"):
        partial_key(ROOT_KEY, [])


def test_partial_chunks_need_a_mamba_group_full_attention_only_and_chunks_of_one_block() -> None:
    assert partial.enabled([FULL, MAMBA], N, N)
    assert not partial.enabled([FULL, MAMBA], N, 2 * N)  # chunks of two blocks
    assert not partial.enabled([FULL, SWA], N, N)  # no Mamba: vLLM hits at block multiples only
    assert not partial.enabled([FULL, SWA, MAMBA], N, N)  # window tails are not kept per partial chunk


def test_checkpoints_inside_a_block_need_a_unit_below_the_block_that_divides_it() -> None:
    assert partial.checkpoints(N, 32)
    assert not partial.checkpoints(N, N)  # no prefix_match_unit below the block: turn ends only
    assert not partial.checkpoints(N, 0)
    assert not partial.checkpoints(N, 48)  # does not divide the block


def test_probe_positions_lie_inside_the_chunk_after_the_hit_longest_first_and_spare_the_last_token() -> None:
    assert partial.candidates(1, 230, N, 32) == [224, 192, 160]
    assert partial.candidates(1, 225, N, 32) == [224, 192, 160]
    assert partial.candidates(1, 224, N, 32) == [192, 160]  # 224 would leave no token to compute
    assert partial.candidates(1, 400, N, 32) == [224, 192, 160]  # never the next chunk's end
    assert partial.candidates(0, 40, N, 32) == [32]
    assert partial.candidates(1, 129, N, 32) == []


def test_key_at_names_the_chunk_holding_the_position() -> None:
    whole = chunk_keys(TOKENS, N)
    assert partial.key_at(whole, TOKENS, 224, N) == partial_key(whole[0], TOKENS[N:224])
    assert partial.key_at(whole, TOKENS, 32, N) == partial_key(ROOT_KEY, TOKENS[:32])
    assert partial.key_at(whole, TOKENS, 256, N) is None  # a whole chunk's end
    assert partial.key_at(whole[:1], TOKENS, 288, N) is None  # chunk 1 has no key yet
    assert partial.key_at(whole, TOKENS[:200], 224, N) is None  # tokens not known that far


def record(req_id: str, hit_chunks: int, lease_id: int) -> RequestRecord:
    return RequestRecord(req_id, [], 0, hit_chunks=hit_chunks, lease_id=lease_id)


def test_the_longest_probe_that_hits_one_chunk_more_wins_and_every_other_lease_is_released() -> None:
    p, r = partial.Probes(), record("r", 1, 10)
    p.begin(r, {1: (224, b"k224"), 2: (192, b"k192"), 3: (160, b"k160")})
    assert 2 in p and 9 not in p and r.probe is not None
    assert p.reply(3, 2, 13) == (r, None, [])  # 160 hits
    assert p.reply(2, 2, 12) == (r, None, [13])  # 192 beats it: 160's lease goes
    st, choice, release = p.reply(1, 1, 11)  # 224 misses: only the whole chunk
    assert (st, release) == (r, [11, 10])  # its lease, and the whole-chunk lookup's (replaced)
    assert choice == partial.Choice(2, 12, 192, b"k192")
    assert 1 not in p and 2 not in p and r.probe is None


def test_without_a_winning_probe_the_whole_chunk_answer_stands() -> None:
    p, r = partial.Probes(), record("r", 1, 10)
    p.begin(r, {1: (224, b"k224"), 2: (192, b"k192")})
    assert p.reply(1, 0, 0) == (r, None, [])  # failed
    st, choice, release = p.reply(2, 1, 12)
    assert (st, choice, release) == (r, partial.Choice(1, 10), [12])


def test_dropping_a_request_hands_back_its_best_probe_lease_and_forgets_its_lookups() -> None:
    p, r = partial.Probes(), record("r", 1, 10)
    p.begin(r, {1: (224, b"k224"), 2: (192, b"k192")})
    p.reply(2, 2, 12)
    assert p.drop(r) == [12]
    assert 1 not in p and p.drop(r) == []
    s = record("s", 0, 0)
    p.begin(s, {5: (32, b"k32")})
    p.clear()
    assert 5 not in p and s.probe is None


def test_turn_end_positions_are_probed_with_the_unit_multiples_each_once_longest_first() -> None:
    ends = TurnEnds()
    parent = chunk_keys(TOKENS, N)[1]
    assert ends.positions(parent, 2 * N, 440) == []
    ends.add(parent, 83)  # a turn ended at 339, inside chunk 2
    ends.add(parent, 32)  # and one at 288, a unit multiple
    assert sorted(ends.positions(parent, 2 * N, 440)) == [288, 339]
    assert ends.positions(parent, 2 * N, 339) == [288]  # 339 would leave no token to compute
    assert ends.positions(ROOT_KEY, 0, 440) == []  # another chunk's
    got = partial.merge(partial.candidates(2, 440, N, 32), ends.positions(parent, 2 * N, 440))
    assert got == [352, 339, 320, 288]


def test_turn_ends_are_bounded_by_chunk_key_and_by_offsets_per_key() -> None:
    ends = TurnEnds(limit=2, per_key=2)
    ends.add(b"a", 1)
    ends.add(b"b", 2)
    assert ends.positions(b"a", 0, 100) == [1]  # a used: b is now the oldest
    ends.add(b"c", 3)
    assert len(ends) == 2 and ends.positions(b"b", 0, 100) == [] and ends.positions(b"a", 0, 100) == [1]
    ends.add(b"a", 5)
    ends.add(b"a", 7)  # a third offset: the oldest (1) goes
    assert sorted(ends.positions(b"a", 0, 100)) == [5, 7]
    ends.add(b"a", 5)  # added again: the newest
    ends.add(b"a", 9)
    assert sorted(ends.positions(b"a", 0, 100)) == [5, 9]
    assert ends.offsets(b"a") == [9, 5] and ends.offsets(b"z") == []  # newest first
    with pytest.raises(ValueError, match="limit"):
        TurnEnds(limit=0)
