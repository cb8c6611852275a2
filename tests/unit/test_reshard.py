"""Re-sharding on read (transport/reshard.py): a TP=j rank's blocks assembled from a TP=k world's entries,
byte-exact against the model's whole KV (every head) assembled with NumPy; and the shapes refused."""

from __future__ import annotations

import numpy as np
import pytest

from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.reshard import HeadSplit, ShardShape, block_moves, rank_heads, refusal, segments

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
    assert "Mamba/GDN states are not re-sharded" in (refusal(mamba, ShardShape(
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

