"""The one record of engine formats (daemon/cache/formats.py, ``Formats``): worlds by any rank's
fingerprint, the ranks that registered, the bound (the least recently registered world goes first),
and the worlds it never forgets (registered now, or held); the peer and routing views read it."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from hkvd.daemon.cache import Cache, Formats, GroupRule, HugePagePool, make_policy
from hkvd.daemon.engines.host_engine import HostCopyEngine
from hkvd.daemon.engines.registry import Registry
from hkvd.daemon.peers.layout_book import LayoutBook
from hkvd.daemon.routing.usable_prefix import FormatBook
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.control import EngineSpec

CHUNK = 16
PAGE = 4096


def fps(i: int, ranks: int = 1) -> tuple[bytes, ...]:
    return tuple(bytes([i, r]) * 8 for r in range(ranks))


def add(book: Formats, i: int, rank: int = 0, ranks: int = 1, *, live: bool = False, model: str = "m") -> None:
    book.add(fps(i, ranks), rank, model=model, chunk_size=CHUNK, rules=[GroupRule(0, "full")], kinds={0: "full"},
             entry_bytes={0: PAGE}, live=live)


def known(book: Formats) -> list[int]:
    return [w.fingerprints[0][0] for w in book.worlds()]


def test_a_world_is_found_by_any_rank_and_remembers_which_ranks_registered() -> None:
    book = Formats()
    add(book, 1, rank=1, ranks=4)
    w = book.world(fps(1, 4)[3])
    assert w is not None and w is book.world(fps(1, 4)[0]) and w.ranks == {1}
    add(book, 1, rank=3, ranks=4, model="other")  # the first registration fixed the format
    assert w.ranks == {1, 3} and w.model == "m" and len(book) == 1
    assert book.world(b"\0" * 16) is None
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4 ranks"):
        add(book, 1, rank=4, ranks=4)


def test_the_bound_forgets_the_least_recently_registered_world_first() -> None:
    book = Formats(max_worlds=3)
    for i in range(3):
        add(book, i)
    add(book, 0)  # registered again: now the newest
    add(book, 3)
    assert known(book) == [2, 0, 3]
    assert book.world(fps(1)[0]) is None  # forgotten with every rank's fingerprint
    add(book, 4)
    assert known(book) == [0, 3, 4]


def test_registered_and_held_worlds_are_never_forgotten() -> None:
    book = Formats(max_worlds=2)
    add(book, 0, live=True)
    add(book, 1)
    book.hold(fps(1)[0])
    add(book, 2)
    add(book, 3)
    assert known(book) == [0, 1, 3]  # over the bound only by the live and the held
    book.release(fps(1)[0])
    assert known(book) == [0, 3]
    book.leave(fps(0))
    assert known(book) == [0, 3]  # within the bound: kept after it leaves
    add(book, 4)
    assert known(book) == [3, 4]
    with pytest.raises(KeyError, match="add it before holding it"):
        book.hold(fps(9)[0])


@pytest.fixture
def registry() -> Iterator[Registry]:
    pool = HugePagePool(4 << 20, "off", superblock_bytes=2 << 20)
    copy_engine = HostCopyEngine(pool)
    yield Registry(CHUNK, copy_engine, pool=pool, formats=Cache(pool, make_policy("lru")).formats)
    copy_engine.close()
    pool.close()


def test_registration_feeds_the_record_that_the_peer_and_routing_views_read(registry: Registry) -> None:
    group = GroupSpec(0, "full", 16, 0, 64, "bfloat16", (View(0, 0, 1, 64 * PAGE, PAGE, PAGE),))
    state = registry.register(EngineSpec("/models/m", 2, 1, "t", CHUNK, 16, 8192, "none", [], [group]), 1, 1)
    w = registry.formats.world(state.fingerprint)
    assert w is not None and w.ranks == {1} and w.live == 1
    peers = LayoutBook(registry)  # type: ignore[arg-type]
    assert peers.fingerprints() == [state.fingerprint]
    assert peers.get(state.rank_fingerprints[0]) is None  # rank 0 never registered here
    layout = peers.get(state.fingerprint)
    assert layout is not None and layout.entry_bytes == state.entry_bytes and layout.chunk_size == CHUNK
    routing = FormatBook(registry.formats)
    assert routing.find("m", None).rank_fingerprints == state.rank_fingerprints
    registry.unregister(state.engine_id)
    assert w.live == 0 and peers.get(state.fingerprint) == layout  # kept after the engine leaves


def test_the_routing_view_follows_the_record() -> None:
    book = Formats(max_worlds=2)
    routing = FormatBook(book)
    eng = SimpleNamespace(spec=SimpleNamespace(model="a"), chunk_size=CHUNK, fingerprint=fps(0)[0],
                          rank_fingerprints=fps(0), world_fingerprints=fps(0), rules=[GroupRule(0, "full")],
                          kinds={0: "full"},
                          entry_bytes={0: PAGE})
    routing.add(eng)  # type: ignore[arg-type]
    assert len(book) == 1 and routing.find("a", None).model == "a"
    add(book, 1, model="b")
    add(book, 2, model="c")
    assert len(routing) == 2 and [f["model"] for f in routing.listing()] == ["b", "c"]


def test_a_world_of_another_tp_size_is_offered_to_peers_and_learned_by_the_puller(registry: Registry) -> None:
    """The serving daemon keeps the spec that fixed a world's format and offers the world to a peer asking for its
    model; the pulling daemon derives the same fingerprints and shape from that spec and learns the world, with no
    rank registered (so it never offers it to peers of its own)."""
    from hkvd.daemon.peers.tp_pulls import SpecFormat

    group = GroupSpec(0, "full", 16, 0, 64, "bfloat16", (View(0, 0, 1, 64 * PAGE, PAGE, PAGE),))
    spec = EngineSpec("m", 2, 1, "host/HNC", CHUNK, 16, 8192, "none", [], [group], model_identity="w",
                      heads=[(0, 1, 2, 16)])
    state = registry.register(spec, 1, 1)
    peers = LayoutBook(registry)  # type: ignore[arg-type]
    (offered,) = peers.other_worlds([state.model_key], [b"\0" * 16])
    assert offered.spec is not None and offered.spec.regions == [] and offered.spec.chunk_size == CHUNK
    assert peers.other_worlds([state.model_key], [state.fingerprint]) == []  # the asker's own world: not "other"
    assert peers.other_worlds([b"\1" * 16], [b"\0" * 16]) == []  # another model

    fmt = SpecFormat.of(offered.spec)
    assert fmt.fingerprints == state.rank_fingerprints and fmt.model_key == state.model_key
    assert fmt.shard == state.shard and fmt.entry_bytes == state.entry_bytes
    book = Formats()
    learned = book.learn(fmt.fingerprints, model="m", chunk_size=CHUNK, rules=fmt.rules, kinds=fmt.kinds,
                         entry_bytes=fmt.entry_bytes, model_key=fmt.model_key, shard=fmt.shard, spec=offered.spec)
    assert learned.ranks == set() and book.same_model(fmt.model_key, ()) == [learned]
