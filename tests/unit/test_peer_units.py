"""Peer-link pieces that need no daemon: extent pairing, the allowlist, tokens, proofs, wire checks."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvd.daemon.cache import Cache
from hkvd.daemon.cache.entry import EntryState
from hkvd.daemon.cache.eviction import make_policy
from hkvd.daemon.cache.pool import PAGE, HugePagePool
from hkvd.daemon.peers.auth import (
    PeerConfigError,
    allowed,
    client_proof,
    parse_allow,
    read_token,
    server_proof,
    split_address,
)
from hkvd.daemon.peers.pulling import begin_entries, merge, pair_extents
from hkvd.transport.base import Desc
from hkvd.transport.codec import decode_body, encode
from hkvd.transport.errors import PoolFull, ProtocolViolation
from hkvd.transport.wire.peer import PeerLookup, PeerLookupReply, Pull, RemoteEntry, pack_entries


def _split(total: int, cuts: list[int], base: int) -> list[tuple[int, int]]:
    points = sorted({c % total for c in cuts if c % total} | {0, total})
    # Extents are scattered: a gap of 4096 after each one, so nothing merges by accident.
    out, addr = [], base
    for a, b in itertools.pairwise(points):
        out.append((addr, b - a))
        addr += b - a + 4096
    return out


@given(total=st.integers(1, 10_000), rcuts=st.lists(st.integers(0, 10_000), max_size=8),
       lcuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_pair_extents_maps_every_byte_in_order(total: int, rcuts: list[int], lcuts: list[int]) -> None:
    remote = _split(total, rcuts, 1 << 20)
    local = _split(total, lcuts, 1 << 30)
    descs = pair_extents(remote, local)
    assert sum(d.nbytes for d in descs) == total

    def flat(extents: list[tuple[int, int]]) -> list[int]:
        return [a + i for a, n in extents for i in range(n)]

    assert [d.remote_addr + i for d in descs for i in range(d.nbytes)] == flat(remote)
    assert [d.local_addr + i for d in descs for i in range(d.nbytes)] == flat(local)


FP = b"f" * 16
KINDS = {0: "full", 1: "mamba"}


@pytest.fixture(scope="module")
def pool():
    p = HugePagePool(256 << 20, "off")  # 8 superblocks: room for every size class the cases use
    yield p
    p.close()


def _remote(n: int, pages: list[int], cuts: list[list[int]], contiguous: bool) -> list[RemoteEntry]:
    """``n`` serving-side entries of ``pages[i] * PAGE`` bytes: back to back in the peer's pool when
    ``contiguous`` (and whole), else scattered and cut at ``cuts[i]``."""
    out, addr = [], 1 << 40
    for i in range(n):
        nbytes = pages[i % len(pages)] * PAGE
        extents = [(addr, nbytes)] if contiguous else _split(nbytes, cuts[i % len(cuts)], addr)
        out.append(RemoteEntry(i % 2, i, nbytes, extents))
        addr = extents[-1][0] + extents[-1][1] + (0 if contiguous else 4096)
    return out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), pages=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       cuts=st.lists(st.lists(st.integers(0, 3 * PAGE), max_size=3), min_size=1, max_size=3),
       contiguous=st.booleans(), present=st.sets(st.integers(0, 23), max_size=6))
def test_begin_entries_maps_every_new_entry_byte_for_byte(pool, n, pages, cuts, contiguous, present) -> None:
    index = Cache(pool, make_policy("lru"))
    used = pool.statistics().used_bytes
    keys = [i.to_bytes(16, "little") for i in range(n)]
    part = _remote(n, pages, cuts, contiguous)
    for i in sorted(present):
        if i < n:  # already here: skipped, not written again
            e = index._index.begin_write((FP, part[i].group_id, keys[i]), part[i].nbytes, KINDS[part[i].group_id], 1)
            assert e is not None
            index._index.finish_write(e, pending=False)
    begun, descs = begin_entries(index, pool.base_addr, FP, KINDS, keys, part, 7)
    new = [e for i, e in enumerate(part) if i not in present]
    assert [le.key for le in begun] == [(FP, e.group_id, keys[e.chunk_index]) for e in new]
    assert all(le.state is EntryState.WRITING for le in begun)
    reference = merge([d for e, le in zip(new, begun, strict=True) for d in pair_extents(
        e.extents, [(pool.base_addr + off, ln) for off, ln in le.alloc.extents])])
    assert merge(descs) == reference

    def runs(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:  # in order, contiguous ones joined
        out: list[tuple[int, int]] = []
        for a, ln in extents:
            if out and out[-1][0] + out[-1][1] == a:
                out[-1] = (out[-1][0], out[-1][1] + ln)
            else:
                out.append((a, ln))
        return out

    # Both sides in the same order with equal piece sizes: byte k of the new entries' remote bytes
    # lands on byte k of their local extents.
    assert runs([(d.remote_addr, d.nbytes) for d in descs]) == runs([x for e in new for x in e.extents])
    assert runs([(d.local_addr, d.nbytes) for d in descs]) == runs(
        [(pool.base_addr + off, ln) for le in begun for off, ln in le.alloc.extents])
    for le in begun:
        index._index.abandon_write(le)
    for i in sorted(present):
        if i < n:
            index.drop(index.get((FP, part[i].group_id, keys[i])))
    assert pool.statistics().used_bytes == used


def test_begin_entries_gives_everything_back_when_one_does_not_fit(pool) -> None:
    index = Cache(pool, make_policy("lru"))
    free = pool.statistics().free_bytes
    part = [RemoteEntry(0, i, 4 << 20, [((1 << 40) + i * (4 << 20), 4 << 20)]) for i in range(80)]  # 320 MiB
    keys = [i.to_bytes(16, "little") for i in range(80)]
    with pytest.raises(PoolFull):
        begin_entries(index, pool.base_addr, FP, KINDS, keys, part, 7)
    assert len(index) == 0 and pool.statistics().free_bytes == free


def test_pair_extents_merges_contiguous_pieces_and_refuses_size_mismatch() -> None:
    assert pair_extents([(100, 10), (110, 6)], [(5000, 16)]) == [Desc(100, 5000, 16)]
    with pytest.raises(ValueError, match="different byte counts"):
        pair_extents([(100, 10)], [(5000, 12)])
    assert merge([Desc(0 + 1, 10, 4), Desc(5, 14, 4), Desc(100, 18, 1)]) == [Desc(1, 10, 8), Desc(100, 18, 1)]


def test_allowlist() -> None:
    nets = parse_allow(["10.0.0.0/24", "192.168.1.7", " fd00::/8 "])
    assert allowed("10.0.0.42", nets) and allowed("192.168.1.7", nets) and allowed("fd00::1", nets)
    assert allowed("::ffff:10.0.0.9", nets)  # IPv4-mapped IPv6 from a dual-stack socket
    assert not allowed("10.0.1.1", nets) and not allowed("127.0.0.1", nets) and not allowed("junk", nets)
    loop = parse_allow([])  # default: loopback only
    assert allowed("127.0.0.1", loop) and allowed("::1", loop) and not allowed("10.0.0.1", loop)
    with pytest.raises(PeerConfigError, match="not an IP address or CIDR"):
        parse_allow(["10.0.0.0/33"])


def test_tokens(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HKVD_PEER_TOKEN", raising=False)
    assert read_token("", "") == b""
    monkeypatch.setenv("HKVD_PEER_TOKEN", "x" * 20)
    assert read_token("", "") == b"x" * 20
    f = tmp_path / "t"
    f.write_text("  " + "y" * 32 + "\n")
    f.chmod(0o600)
    assert read_token("", str(f)) == b"y" * 32  # the file wins, whitespace stripped
    for mode in (0o604, 0o640, 0o620, 0o602, 0o610):  # any access for the group or other users
        f.chmod(mode)
        with pytest.raises(PeerConfigError, match="chmod 600"):
            read_token("", str(f))
    f.chmod(0o400)
    assert read_token("", str(f)) == b"y" * 32
    if os.geteuid() == 0:  # another user's token file: they could change it under the daemon
        os.chown(f, 65534, 65534)
        with pytest.raises(PeerConfigError, match=r"owned by uid 65534, not by the daemon's user .*chown 0 "):
            read_token("", str(f))
    with pytest.raises(PeerConfigError, match="not a regular file"):
        read_token("", str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # refused at once, never waited on
    with pytest.raises(PeerConfigError, match="not a regular file"):
        read_token("", str(fifo))
    with pytest.raises(PeerConfigError, match="at least 16"):
        read_token("short", "")
    with pytest.raises(PeerConfigError, match="No such file"):
        read_token("", str(tmp_path / "missing"))


def test_proofs_bind_both_nonces_and_the_direction() -> None:
    tok, a, b = os.urandom(32), os.urandom(32), os.urandom(32)
    assert server_proof(tok, a, b) != client_proof(tok, a, b)  # a server proof is no client proof
    assert client_proof(tok, a, b) != client_proof(tok, a, os.urandom(32))
    assert client_proof(tok, a, b) != client_proof(os.urandom(32), a, b)
    assert len(server_proof(tok, a, b)) == 32


def test_split_address() -> None:
    assert split_address("10.0.0.5:7470") == ("10.0.0.5", 7470)
    assert split_address("[fd00::5]:7470") == ("fd00::5", 7470)
    assert split_address("prefill-0.svc:80") == ("prefill-0.svc", 80)
    for bad in ("10.0.0.5", ":80", "h:0", "h:99999", "h:x"):
        with pytest.raises(PeerConfigError, match="HOST:PORT"):
            split_address(bad)


def _reply(table: list[tuple[int, ...]], extents: list[tuple[int, int]]) -> list:
    return [1, 1, 2, 30.0, np.array(table, dtype="<u8").tobytes(), np.array(extents, dtype="<u8").tobytes()]


def test_peer_wire_checks() -> None:
    sent = [RemoteEntry(0, 1, 10, [(4096, 4), (8192, 6)]), RemoteEntry(2, 7, 3, [(1 << 40, 3)])]
    msg = decode_body(encode(PeerLookupReply(5, 8, 2, 30.0, *pack_entries(sent)))[4:])
    assert isinstance(msg, PeerLookupReply) and msg.entries() == sent
    assert PeerLookupReply.from_wire(_reply([], [])).entries() == []  # a miss: no entries
    for table, extents, why in (
            ([(0, 1, 10, 1)], [(4096, 4)], "hold 4 bytes"),              # extents hold fewer bytes than the entry
            ([(0, 1, 10, 0)], [], "1..1024 extents"),                   # no extents
            ([(0, 1, 10, 1)], [(0, 10)], "0 < addr"),                   # address 0
            ([(0, 1, 10, 1)], [(4096, 0)], "0 < len"),                  # empty extent
            ([(0, 1, 10, 2)], [(4096, 10)], "name 2 extents"),          # fewer extents than the table says
            ([(0, 1, 2**64 - 1, 1)], [(4096, 2**64 - 1)], "nbytes"),    # sums that would wrap around
            ([(1 << 16, 1, 10, 1)], [(4096, 10)], "group_id"),
            ([(0, 1, 10, 1)], [(4096, 2), (4102, 8)], "name 1 extents")):
        with pytest.raises(ProtocolViolation, match=why):
            PeerLookupReply.from_wire(_reply(table, extents))
    with pytest.raises(ProtocolViolation, match="rows of 4"):
        PeerLookupReply.from_wire([1, 1, 2, 30.0, b"x" * 31, b""])
    with pytest.raises(ProtocolViolation, match="expected bytes"):
        PeerLookupReply.from_wire([1, 1, 2, 30.0, [[0, 1, 10, [[4096, 10]]]], b""])  # protocol 1's nested lists
    key = b"k" * 16
    with pytest.raises(ProtocolViolation, match="16 bytes"):
        PeerLookup.from_wire([1, b"f" * 15, [key], 0, 0.0, 0])
    with pytest.raises(ProtocolViolation, match="wait_s"):
        PeerLookup.from_wire([1, b"f" * 16, [key], 0, 99.0, 0])
    with pytest.raises(ProtocolViolation, match="at least one chunk key"):
        Pull.from_wire([1, "h:1", [], 0, 0])
    with pytest.raises(ProtocolViolation, match="HOST:PORT"):
        Pull.from_wire([1, "", [key], 0, 0])


def test_an_unspecified_listen_address_needs_an_advertised_one() -> None:
    from hkvd.daemon.config import ConfigError, DaemonConfig

    for listen in ("0.0.0.0:7470", "[::]:7470"):
        with pytest.raises(ConfigError, match="--peer-advertise HOST:7470"):
            DaemonConfig(peer_listen=listen).validate()
        DaemonConfig(peer_listen=listen, peer_advertise="10.0.0.5:7470").validate()
    with pytest.raises(ConfigError, match=r"cannot connect to 0\.0\.0\.0"):
        DaemonConfig(peer_listen="10.0.0.5:7470", peer_advertise="0.0.0.0:7470").validate()
    DaemonConfig(peer_listen="127.0.0.1:7470").validate()
