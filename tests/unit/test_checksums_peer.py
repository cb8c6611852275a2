"""Peer pulls check what they READ against the serving daemon's checksums (``PeerLookupReply.entry_checksums``):
the in-process pair of tests/unit/test_peer_links.py (two pools, the real control protocol over loopback,
a memmove transport), with each side's ``Checksums`` running."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hkvd.daemon.integrity.checksums import Checksums
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.peer import PeerLookupReply, Pull, PullResult, pack_checksums, pack_table


def _load_links() -> Any:
    spec = importlib.util.spec_from_file_location("hkvd_test_peer_links", Path(__file__).with_name(
        "test_peer_links.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


L = _load_links()


@pytest.fixture
def sides() -> Iterator[tuple[Any, Any]]:
    a, b = L.Side(), L.Side()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
async def pair(sides: tuple[Any, Any],
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Any, Checksums, Checksums]]:
    serving, pulling = sides
    loop = asyncio.get_running_loop()
    served = Checksums(serving.index, serving.pool.buffer)
    served.start(loop)
    pulled = Checksums(pulling.index, pulling.pool.buffer)
    pulled.start(loop)
    try:
        async with L.running(sides, monkeypatch) as p:
            assert p.peers.client is not None
            p.peers.client.checks = pulled  # as the daemon sets it (PeerService.checks, before start)
            yield p, pulled, served
    finally:
        assert served.stop(5) and pulled.stop(5)


async def _pull(p: Any, req_id: int, chunks: int) -> PullResult:
    conn = L.sink()
    p.peers.submit_pull(p.pulling.engine, Pull(req_id, p.address, L.KEYS[:chunks], 0, 0), conn)
    done = await conn.reply()
    assert isinstance(done, PullResult) and done.req_id == req_id, done
    return done


async def test_bytes_damaged_in_the_serving_pool_are_never_published_by_the_puller(pair) -> None:
    p, pulled, served = pair
    for c in range(3):
        p.serving.store(c)
    assert await L.until(lambda: served.taken == 3)
    bad = p.serving.index.get(p.serving.key(1))
    off = bad.alloc.extents[0].pool_offset
    p.serving.pool.buffer[off + 100] ^= 0x04  # after its checksum: the serving scrubber has not seen it yet

    result = await _pull(p, 7, 3)
    assert result.hit_chunks == 1  # chunk 1 is a miss here, so the prefix ends at chunk 0
    assert p.pulling.index.get(p.pulling.key(1)) is None
    assert p.pulling.entry_bytes(0) == bytes([1]) * L.ENTRY
    assert pulled.mismatches == {"peer_pull": 1}
    assert p.pulling.index.statistics().corrupt == {"checksum": 1}


async def test_intact_entries_pull_whole_and_keep_the_checksums_they_were_checked_against(pair) -> None:
    p, pulled, served = pair
    for c in range(3):
        p.serving.store(c)
    assert await L.until(lambda: served.taken == 3)
    result = await _pull(p, 8, 3)
    assert result.hit_chunks == 3 and pulled.mismatches == {}
    assert pulled.taken == 0 and pulled.pending() == 0  # verified on arrival: not hashed a second time
    for c in range(3):
        assert p.pulling.index.get(p.pulling.key(c)).checksum == p.serving.index.get(p.serving.key(c)).checksum


@pytest.mark.parametrize("puller", ["older", "current"])
async def test_checksums_are_sent_only_to_a_puller_that_asks(pair, puller: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An older puller's PeerLookup has no ``checksums``, and it could not parse a reply's trailing
    ``entry_checksums``: it is sent none, and its pull still completes."""
    from hkvd.daemon.peers import pulling as pulling_mod
    from hkvd.daemon.peers import serving as serving_mod
    from hkvd.transport.wire.peer import PeerLookup

    p, pulled, served = pair
    for c in range(3):
        p.serving.store(c)
    assert await L.until(lambda: served.taken == 3)
    sent: list[PeerLookupReply] = []

    def spy(*args: Any) -> PeerLookupReply:
        sent.append(PeerLookupReply(*args))
        return sent[-1]

    monkeypatch.setattr(serving_mod, "PeerLookupReply", spy)
    if puller == "older":
        monkeypatch.setattr(pulling_mod, "PeerLookup", lambda *a, checksums=False: PeerLookup(*a))
    result = await _pull(p, 9, 3)
    assert result.hit_chunks == 3 and pulled.mismatches == {}
    assert [bool(r.entry_checksums) for r in sent] == [puller == "current"]
    assert PeerLookup(1, b"f" * 16, [], 0, 0.0, 0).to_wire()[-1] == 0  # the older form: no trailing flag


def test_entry_checksums_are_a_trailing_optional_field() -> None:
    table, extents = pack_table([(0, 0, 8, 1), (0, 1, 8, 1)], [(4096, 8), (8192, 8)])
    old = PeerLookupReply(1, 2, 9, 5.0, table, extents)
    old.validate()
    assert old.checksums() == [0, 0]  # an older daemon's reply: nothing to check against
    new = PeerLookupReply(1, 2, 9, 5.0, table, extents, pack_checksums([11, 2**64 - 1]))
    new.validate()
    assert new.checksums() == [11, 2**64 - 1]
    with pytest.raises(ProtocolViolation, match="one little-endian uint64 per entry"):
        PeerLookupReply(1, 2, 9, 5.0, table, extents, pack_checksums([11])).validate()
