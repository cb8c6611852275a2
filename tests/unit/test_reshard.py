"""Re-sharding on read (transport/reshard.py): a TP=j rank's blocks assembled from a TP=k world's entries,
byte-exact against the model's whole KV (every head) assembled with NumPy; GDN states (transport/state_shards.py)
likewise against the model's whole conv and SSM states, cut into per-rank pages as vLLM lays them; and the shapes
refused."""

from __future__ import annotations

import numpy as np
import pytest

from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.reshard import HeadSplit, ShardShape, block_moves, rank_heads, refusal, segments
from hkvd.transport.state_shards import MambaSplit, StateSplit, parse_states

STATES, CELL, LAYERS, CHUNK = 4, 8, 3, 8  # states per page (tokens per block), bytes per cell
NUM_BLOCKS = 6


def heads_here(tp: int, total: int) -> int:
    return len(rank_heads(tp, total, 0))


def group(tp: int, total: int, *, kind: str = "full", order: str = "HNC", block_major: bool = False,
          tokens: int = STATES) -> GroupSpec:
    """One group of LAYERS layers of one rank: layer-major (LB) or block-major (BL) pages of H x STATES cells."""
    page = heads_here(tp, total) * STATES * CELL
    if block_major:
        view = View(0, 0, LAYERS, page, LAYERS * page, page)
    else:
        view = View(0, 0, LAYERS, NUM_BLOCKS * page, page, page)
    return GroupSpec(0, kind, tokens, 16 if kind == "swa" else 0, NUM_BLOCKS, "bfloat16", (view,))


def shape(tp: int, total: int, order: str = "HNC", **kw: object) -> ShardShape:
    g = group(tp, total, order=order, **kw)  # type: ignore[arg-type]
    return ShardShape(tp, CHUNK, order, (g,), {0: HeadSplit(heads_here(tp, total), total, STATES)})


def page_of(kv: np.ndarray, heads: list[int], order: str) -> np.ndarray:
    """One layer's page of ``heads`` (kv: [head, state, cell] of one block and layer) in ``order``."""
    sel = kv[heads]  # [H, S, C]
    return (sel if order == "HNC" else sel.transpose(1, 0, 2)).reshape(-1)


def entry_bytes(kv: np.ndarray, heads: list[int], order: str) -> np.ndarray:
    """A rank's entry of one chunk: blocks, layers, pages (kv: [block, layer, head, state, cell])."""
    return np.concatenate([page_of(kv[b, layer], heads, order) for b in range(kv.shape[0])
                           for layer in range(LAYERS)])


def engine_block(region: np.ndarray, g: GroupSpec, block: int) -> np.ndarray:
    v = g.views[0]
    return np.concatenate([region[v.offset + layer * v.layer_stride + block * v.block_stride:][:v.page_bytes]
                           for layer in range(v.num_layers)])


def read(k: int, j: int, total: int, order_k: str = "HNC", order_j: str = "HNC", block_major: bool = False) -> None:
    """TP=k stores one chunk (2 blocks); every rank of TP=j reads it; its blocks hold exactly its heads."""
    rng = np.random.default_rng(k * 100 + j * 10 + total)
    blocks = CHUNK // STATES
    kv = rng.integers(0, 256, size=(blocks, LAYERS, total, STATES, CELL), dtype=np.uint8)
    src, dst = shape(k, total, order_k), shape(j, total, order_j, block_major=block_major)
    src = ShardShape(k, CHUNK, order_k, src.groups, src.heads)
    assert refusal(src, dst) is None
    pool = np.zeros(1 << 16, dtype=np.uint8)
    extents: dict[int, list[tuple[int, int]]] = {}
    at = 0
    for r in range(k):  # each source rank's entry, in two extents (the second one starts past a gap)
        data = entry_bytes(kv, rank_heads(k, total, r), order_k)
        cut = data.size // 2 + 3
        extents[r] = [(at, cut), (at + cut + 64, data.size - cut)]
        pool[at:at + cut] = data[:cut]
        pool[at + cut + 64:at + data.size + 64] = data[cut:]
        at += data.size + 128
    for rank in range(j):
        g = dst.groups[0]
        moves = block_moves(src, dst, 0, rank)
        region = np.zeros(LAYERS * NUM_BLOCKS * g.views[0].page_bytes, dtype=np.uint8)
        ids = [4, 2]
        used = {m[1] for m in moves}
        segs = segments(g, ids, moves, src.groups[0].block_bytes, {r: extents[r] for r in used})
        for s in segs:
            region[s.region_offset:s.region_offset + s.nbytes] = pool[s.pool_offset:s.pool_offset + s.nbytes]
        mine = rank_heads(j, total, rank)
        for i, b in enumerate(ids):
            want = np.concatenate([page_of(kv[i, layer], mine, order_j) for layer in range(LAYERS)])
            assert np.array_equal(engine_block(region, g, b), want), (k, j, rank, b)
        # Nothing else was written: the blocks not named stay zero.
        for b in set(range(NUM_BLOCKS)) - set(ids):
            assert not engine_block(region, g, b).any()


@pytest.mark.parametrize(("k", "j", "total"), [(2, 1, 2), (1, 2, 2), (2, 1, 4), (1, 4, 4), (4, 2, 8),
                                               (4, 2, 2), (2, 4, 2), (4, 1, 2), (1, 4, 2), (2, 2, 4)])
def test_every_reader_rank_gets_exactly_its_heads(k: int, j: int, total: int) -> None:
    read(k, j, total)


def test_nhc_pages_and_block_major_readers() -> None:
    read(2, 1, 4, "NHC", "NHC")
    read(1, 2, 4, "NHC", "NHC", block_major=True)
    read(4, 2, 2, block_major=True)


def test_replicated_heads_come_from_one_source_rank() -> None:
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1 (vLLM's QKVParallelLinear).
    assert [rank_heads(4, 2, r) for r in range(4)] == [[0], [0], [1], [1]]
    src, dst = shape(4, 2), shape(2, 2)
    assert {m[1] for m in block_moves(src, dst, 0, 1)} == {2}
    # TP=2 -> 1 reads each layer's page from both ranks: two runs per page (one head each).
    moves = block_moves(shape(2, 2), shape(1, 2), 0, 0)
    assert len(moves) == 2 * LAYERS and {m[1] for m in moves} == {0, 1}


def test_same_tp_is_one_run_per_block() -> None:
    moves = block_moves(shape(2, 4), shape(2, 4), 0, 1)
    assert moves == ((0, 1, 0, LAYERS * 2 * STATES * CELL),)


def test_refusals_name_the_shape() -> None:
    assert "do not split over TP=2" in (refusal(ShardShape(
        2, CHUNK, "HNC", (group(1, 3),), {0: HeadSplit(2, 3, STATES)}), shape(1, 3)) or "")
    mamba = ShardShape(2, CHUNK, "HNC", (group(2, 2, kind="mamba"),), {})
    assert "no state split registered at TP=2 (an older shim)" in (refusal(mamba, ShardShape(
        1, CHUNK, "HNC", (group(1, 2, kind="mamba"),), {})) or "")
    other_block = shape(2, 2, tokens=2 * STATES)
    assert "block size differs" in (refusal(other_block, shape(1, 2)) or "")
    assert "chunk sizes differ" in (refusal(ShardShape(2, 2 * CHUNK, "HNC", shape(2, 2).groups,
                                                       shape(2, 2).heads), shape(1, 2)) or "")
    assert "page orders differ" in (refusal(shape(2, 2, "NHC"), shape(1, 2)) or "")
    no_heads = ShardShape(2, CHUNK, "HNC", shape(2, 2).groups, {})
    assert "no KV-head split" in (refusal(no_heads, shape(1, 2)) or "")
    other_total = ShardShape(2, CHUNK, "HNC", shape(2, 4).groups, {0: HeadSplit(2, 4, STATES)})
    assert "heads or states differ" in (refusal(other_total, shape(1, 2)) or "")
    with pytest.raises(ValueError, match="do not split"):
        rank_heads(2, 3, 0)


def test_engine_spec_carries_the_model_identity_and_head_splits() -> None:
    from hkvd.transport.errors import ProtocolViolation
    from hkvd.transport.wire.control import EngineSpec

    g = group(2, 4)
    spec = EngineSpec("m", 2, 1, "cpu/HNC", 0, STATES, 8192, "none", [], [g], identity="i",
                      model_identity="mi", heads=[(0, 2, 4, STATES)])
    back = EngineSpec.from_wire(spec.to_wire())
    assert (back.model_identity, back.heads) == ("mi", [(0, 2, 4, STATES)])
    old = spec.to_wire()
    del old["model_identity"], old["heads"]  # an older shim sends neither
    assert (EngineSpec.from_wire(old).model_identity, EngineSpec.from_wire(old).heads) == ("", [])
    for bad in ([[0, 0, 4, STATES]], [[0, 2, 4]], [[1, 2, 4, STATES]], [[0, 2, 4, STATES], [0, 2, 4, STATES]],
                [[0, 2, 1 << 17, STATES]], [[-1, 2, 4, STATES]], "x"):
        with pytest.raises(ProtocolViolation):
            EngineSpec.from_wire({**spec.to_wire(), "heads": bad})
    with pytest.raises(ProtocolViolation):
        EngineSpec.from_wire({**spec.to_wire(), "model_identity": "x" * 300})



# ---- GDN states ------------------------------------------------------------------------------------------------
# A tiny GDN model: 4 key heads of 2, 8 value heads of 2 (key_dim 8, value_dim 16, conv_dim 32), conv kernel 4
# (state_len 3), conv state bfloat16, SSM state float32: every part splits over 1, 2 and 4 ranks.
NK, NV, DK, DV, STATE_LEN = 4, 8, 2, 2, 3
KD, VD = NK * DK, NV * DV
CONV_B, SSM_B = 2, 4  # bytes per value
GDN_LAYERS = 2


def gdn_split(dim_first: bool, totals: tuple[int, ...] = (KD, KD, VD)) -> MambaSplit:
    return MambaSplit("gdn_attn", (StateSplit(0 if dim_first else 1, totals), StateSplit(0, (NV,))))


def gdn_group(tp: int, dim_first: bool, *, state_len: int = STATE_LEN, ssm: str = "float32",
              conv_dim: int | None = None) -> GroupSpec:
    """One GDN group of GDN_LAYERS layers at TP=``tp``: vLLM's per-rank state shapes, pages laid layer-major."""
    c = (2 * KD + VD) // tp if conv_dim is None else conv_dim
    conv = [c, state_len] if dim_first else [state_len, c]
    dtype = f"state:bfloat16{conv};{ssm}[{NV // tp}, {DV}, {DK}]"
    page = CONV_B * c * state_len + {"float32": 4, "bfloat16": 2}[ssm] * NV // tp * DV * DK
    view = View(0, 0, GDN_LAYERS, NUM_BLOCKS * page, page, page)
    return GroupSpec(0, "mamba", STATES, 0, NUM_BLOCKS, dtype, (view,))


def gdn_shape(tp: int, dim_first: bool, **kw: object) -> ShardShape:
    return ShardShape(tp, CHUNK, "HNC", (gdn_group(tp, dim_first, **kw),), {},  # type: ignore[arg-type]
                      {0: gdn_split(dim_first)})


def gdn_page(conv: np.ndarray, ssm: np.ndarray, tp: int, rank: int, dim_first: bool) -> np.ndarray:
    """Rank ``rank``'s page at TP=``tp`` as vLLM lays it: its conv channels (its q, then k, then v channels),
    oriented SD (state_len, dim) or DS (dim, state_len), then its value heads' SSM states.
    conv: [state_len, 2*KD + VD, CONV_B] bytes (channels: q, k, v); ssm: [NV, DV, DK, SSM_B] bytes."""
    q, k, v = KD // tp, KD // tp, VD // tp
    chans = [*range(rank * q, (rank + 1) * q), *range(KD + rank * k, KD + (rank + 1) * k),
             *range(2 * KD + rank * v, 2 * KD + (rank + 1) * v)]
    mine = conv[:, chans]  # [state_len, dim, bytes]
    if dim_first:
        mine = mine.transpose(1, 0, 2)
    heads = NV // tp
    return np.concatenate([mine.reshape(-1), ssm[rank * heads:(rank + 1) * heads].reshape(-1)])


def read_gdn(k: int, j: int, dim_first: bool) -> None:
    """TP=k stores one state per layer; every rank of TP=j reads it; its block is exactly its own page per layer."""
    rng = np.random.default_rng(k * 10 + j + 100 * dim_first)
    convs = rng.integers(0, 256, size=(GDN_LAYERS, STATE_LEN, 2 * KD + VD, CONV_B), dtype=np.uint8)
    ssms = rng.integers(0, 256, size=(GDN_LAYERS, NV, DV, DK, SSM_B), dtype=np.uint8)
    src, dst = gdn_shape(k, dim_first), gdn_shape(j, dim_first)
    assert refusal(src, dst) is None
    pool = np.zeros(1 << 16, dtype=np.uint8)
    extents: dict[int, list[tuple[int, int]]] = {}
    at = 0
    for r in range(k):  # each source rank's entry (one block: its page of every layer), in two extents
        data = np.concatenate([gdn_page(convs[layer], ssms[layer], k, r, dim_first) for layer in range(GDN_LAYERS)])
        assert data.size == src.groups[0].block_bytes
        cut = data.size // 3 + 1
        extents[r] = [(at, cut), (at + cut + 64, data.size - cut)]
        pool[at:at + cut] = data[:cut]
        pool[at + cut + 64:at + data.size + 64] = data[cut:]
        at += data.size + 128
    g = dst.groups[0]
    for rank in range(j):
        moves = block_moves(src, dst, 0, rank)
        assert sum(m[3] for m in moves) == g.block_bytes
        region = np.zeros(GDN_LAYERS * NUM_BLOCKS * g.views[0].page_bytes, dtype=np.uint8)
        used = {m[1] for m in moves}
        first = rank * k // j  # the source ranks holding the reader's parts: those whose ranges overlap its own
        assert used == set(range(first, max(first + 1, (rank + 1) * k // j))), (k, j, rank, used)
        for s in segments(g, [3], moves, src.groups[0].block_bytes, {r: extents[r] for r in used}):
            region[s.region_offset:s.region_offset + s.nbytes] = pool[s.pool_offset:s.pool_offset + s.nbytes]
        want = np.concatenate([gdn_page(convs[layer], ssms[layer], j, rank, dim_first)
                               for layer in range(GDN_LAYERS)])
        assert np.array_equal(engine_block(region, g, 3), want), (k, j, rank, dim_first)
        for b in set(range(NUM_BLOCKS)) - {3}:
            assert not engine_block(region, g, b).any()


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
@pytest.mark.parametrize(("k", "j"), [(2, 1), (1, 2), (2, 4), (4, 2), (4, 1), (1, 4), (2, 2)])
def test_every_reader_rank_gets_exactly_its_gdn_states(k: int, j: int, dim_first: bool) -> None:
    read_gdn(k, j, dim_first)


def test_gdn_runs_merge_where_one_source_rank_holds_a_range() -> None:
    # Same TP size: the whole block from the reader's own rank, one run.
    assert block_moves(gdn_shape(2, False), gdn_shape(2, False), 0, 1) == (
        (0, 1, 0, gdn_group(2, False).block_bytes),)
    # TP=2 -> 1, SD: per layer, 3 rows x (q, k, v) x 2 source ranks of the conv state, then 2 runs of SSM heads.
    moves = block_moves(gdn_shape(2, False), gdn_shape(1, False), 0, 0)
    assert len(moves) == GDN_LAYERS * (STATE_LEN * 3 * 2 + 2)
    # DS: each part's channels are whole rows of state_len values: 3 parts x 2 ranks, then 2 SSM runs.
    assert len(block_moves(gdn_shape(2, True), gdn_shape(1, True), 0, 0)) == GDN_LAYERS * (3 * 2 + 2)


def test_hybrid_worlds_pass_with_heads_and_states() -> None:
    def hybrid(tp: int) -> ShardShape:
        full = group(tp, 4)
        gdn = GroupSpec(1, "mamba", STATES, 0, NUM_BLOCKS, gdn_group(tp, False).dtype, gdn_group(tp, False).views)
        return ShardShape(tp, CHUNK, "HNC", (full, gdn), {0: HeadSplit(heads_here(tp, 4), 4, STATES)},
                          {1: gdn_split(False)})

    assert refusal(hybrid(2), hybrid(1)) is None and refusal(hybrid(1), hybrid(2)) is None
    assert {m[1] for m in block_moves(hybrid(2), hybrid(1), 1, 0)} == {0, 1}


def test_gdn_refusals_name_the_group_and_what_differs() -> None:
    def why(src: ShardShape, dst: ShardShape) -> str:
        return refusal(src, dst) or ""

    ok = gdn_shape(1, False)
    mamba2 = ShardShape(2, CHUNK, "HNC", gdn_shape(2, False).groups, {}, {0: MambaSplit("mamba2", ())})
    assert "mamba2 states (the shim describes how GDN states split" in why(mamba2, ok)
    assert "group 0 (mamba)" in why(mamba2, ok)
    no_split = ShardShape(2, CHUNK, "HNC", gdn_shape(2, False).groups, {}, {})
    assert "no state split registered at TP=2" in why(no_split, ok)
    # Parts that do not divide over TP=3 (8 key channels).
    three = ShardShape(3, CHUNK, "HNC", (gdn_group(1, False, conv_dim=(2 * KD + VD) // 3 + 1),), {},
                       {0: gdn_split(False)})
    assert "state 0's parts [8, 8, 16] do not split over TP=3" in why(three, ok)
    assert "state 1's dtype differs (float32 at TP=2, bfloat16 at TP=1)" in why(
        gdn_shape(2, False), gdn_shape(1, False, ssm="bfloat16"))
    assert "state 0's shape differs beyond its split axis 1 ([4, 16] at TP=2, [3, 32] at TP=1)" in why(
        gdn_shape(2, False, state_len=4), ok)
    assert "the state splits differ" in why(gdn_shape(2, True), ok)  # DS against SD
    wrong_dim = ShardShape(2, CHUNK, "HNC", (gdn_group(2, False, conv_dim=12),), {}, {0: gdn_split(False)})
    assert "state 0 is [3, 12] at TP=2, not its parts [8, 8, 16] over 2 ranks along axis 1" in why(wrong_dim, ok)
    odd = gdn_group(2, False)
    padded = ShardShape(2, CHUNK, "HNC", (GroupSpec(0, "mamba", STATES, 0, NUM_BLOCKS, odd.dtype, (View(
        0, 0, GDN_LAYERS, NUM_BLOCKS * 1024, 1024, 1024),)),), {}, {0: gdn_split(False)})
    assert "a page is not its states'" in why(padded, ok)
    unknown = ShardShape(2, CHUNK, "HNC", (GroupSpec(0, "mamba", STATES, 0, NUM_BLOCKS, "state:complex64[3, 16]",
                                                     odd.views),), {}, {0: gdn_split(False)})
    assert "names no states hkvd can read" in why(unknown, ok)
    assert "kinds differ" in why(shape(2, 4), ShardShape(1, CHUNK, "HNC", (gdn_group(1, False),), {},
                                                         {0: gdn_split(False)}))
    assert parse_states("bfloat16") is None and parse_states("state:bfloat16[3, 4];float32[2]") == [
        ("bfloat16", (3, 4)), ("float32", (2,))]


def test_engine_spec_carries_state_splits_and_the_registry_reads_them() -> None:
    from hkvd.daemon.engines.registry import shard_shape
    from hkvd.transport.errors import ProtocolViolation
    from hkvd.transport.wire.control import EngineSpec

    g = gdn_group(2, False)
    states = [(0, "gdn_attn", ((1, (KD, KD, VD)), (0, (NV,))))]
    spec = EngineSpec("m", 2, 1, "cpu/HNC", 0, STATES, 8192, "align", [], [g], identity="i",
                      model_identity="mi", states=states)
    back = EngineSpec.from_wire(spec.to_wire())
    assert back.states == states and back == spec
    assert shard_shape(back, CHUNK).states == {0: gdn_split(False)}
    old = spec.to_wire()
    del old["states"]  # an older shim sends none: not re-sharded
    assert EngineSpec.from_wire(old).states == [] and shard_shape(EngineSpec.from_wire(old), CHUNK).states == {}
    assert EngineSpec.from_wire({**spec.to_wire(), "states": [[0, "mamba2", []]]}).states == [(0, "mamba2", ())]
    for bad in ("x", [[0, "gdn_attn"]], [[1, "gdn_attn", []]], [[0, "", []]], [[0, "x" * 65, []]],
                [[0, "gdn_attn", [[1, [8, 0]]]]], [[0, "gdn_attn", [[8, [8]]]]], [[0, "gdn_attn", [[0, []]]]],
                [[0, "gdn_attn", [[0, [1 << 25]]]]], [[0, "gdn_attn", [[0, [1]]] * 9]],
                [[0, "gdn_attn", []], [0, "gdn_attn", []]], [[-1, "gdn_attn", []]], [[0, "gdn_attn", [[0, [True]]]]]):
        with pytest.raises(ProtocolViolation):
            EngineSpec.from_wire({**spec.to_wire(), "states": bad})
    full = EngineSpec("m", 2, 1, "cpu/HNC", 0, STATES, 8192, "none", [], [group(2, 4)], states=[(0, "gdn_attn", ())])
    with pytest.raises(ProtocolViolation, match="Mamba groups"):  # an attention group has no states
        EngineSpec.from_wire(full.to_wire())
