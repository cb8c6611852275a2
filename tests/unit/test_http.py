"""The metrics port's HTTP server (hkvd.daemon.http) over real loopback sockets, in-process.

What tests/unit/test_usable_prefix.py and tests/ops/test_metrics.py do not already cover: a head that
grows across reads, refusals and interim answers in their turn behind pipelined requests, handler bugs,
versions and upgrades, the connection bound and the read timeout.
"""

from __future__ import annotations

import asyncio

import pytest

from hkvd.daemon import http
from hkvd.daemon.http import MAX_REQUEST_BYTES, HTTPEndpoint, Request, Response

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


async def _endpoint() -> HTTPEndpoint:
    ep = HTTPEndpoint(0, lambda: (True, "ok"), lambda: b"m 1\n")
    gate = asyncio.Event()

    async def slow(req: Request) -> Response:
        await gate.wait()
        return Response(200, "text/plain", b"slow " + req.body)

    async def broken_later(req: Request) -> Response:
        raise RuntimeError("a bug, awaited")

    def broken(req: Request) -> Response:
        raise RuntimeError("a bug")

    ep.route("POST", "/slow", slow)
    ep.route("POST", "/echo", lambda req: Response(200, "text/plain", b"echo " + req.body))
    ep.route("GET", "/broken", broken)
    ep.route("GET", "/broken_later", broken_later)
    ep.gate = gate  # type: ignore[attr-defined]
    await ep.start()
    return ep


async def _answer(r: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One answer: its status line, headers (lower-case names) and body."""
    lines = (await r.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    return lines[0].encode(), headers, await r.readexactly(int(headers.get("content-length", "0")))


async def test_a_head_growing_across_reads_is_refused_once_over_the_bound():
    ep = await _endpoint()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: ")
        await w.drain()
        await asyncio.sleep(0.05)  # the server's loop (this one) reads the head's start on its own
        for _ in range(3):  # one header value, never ended, each piece a read of its own
            w.write(b"a" * (MAX_REQUEST_BYTES // 2))
            await w.drain()
            await asyncio.sleep(0.05)
        async with asyncio.timeout(10):  # well within the read timeout: refused by size, not by time
            status, headers, _ = await _answer(r)
            assert status == b"HTTP/1.0 431 Request Header Fields Too Large" and headers["connection"] == "close"
            assert await r.read() == b""
        w.close()
        # A head just under the bound, in many small reads, is taken.
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (MAX_REQUEST_BYTES - 100) + b"\r\n\r\n"
        for i in range(0, len(head), 1000):
            w.write(head[i:i + 1000])
            await w.drain()
            await asyncio.sleep(0.005)
        async with asyncio.timeout(10):
            assert (await _answer(r))[::2] == (b"HTTP/1.1 200 OK", b"ok\n")
        w.close()
    finally:
        await ep.close()


async def test_refusals_and_interim_answers_wait_their_turn_behind_pipelined_requests():
    ep = await _endpoint()
    try:
        # Two requests, then garbage, in one write: two answers, then the refusal and the end.
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(HEALTHZ + HEALTHZ + b"garbage\r\n\r\n" + HEALTHZ)
        async with asyncio.timeout(10):
            got = [await _answer(r) for _ in range(3)]
            assert [s for s, _, _ in got] == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.0 400 Bad Request"]
            assert await r.read() == b""
        w.close()
        # "Expect: 100-continue" behind an answer still being worked out: the interim answer after it.
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n1"
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        ep.gate.set()  # type: ignore[attr-defined]
        async with asyncio.timeout(10):
            assert (await _answer(r))[::2] == (b"HTTP/1.1 200 OK", b"slow 1")
            assert await r.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(b"abc")
            assert (await _answer(r))[::2] == (b"HTTP/1.1 200 OK", b"echo abc")
        w.close()
    finally:
        await ep.close()


async def test_a_handler_bug_is_a_500_and_the_connection_serves_on():
    ep = await _endpoint()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\nGET /broken_later HTTP/1.1\r\nHost: x\r\n\r\n" + HEALTHZ)
        async with asyncio.timeout(10):
            got = [await _answer(r) for _ in range(3)]
        assert [(s, b) for s, _, b in got] == [(b"HTTP/1.1 500 Internal Server Error", b"internal error\n")] * 2 + [
            (b"HTTP/1.1 200 OK", b"ok\n")]
        w.close()
    finally:
        await ep.close()


@pytest.mark.parametrize("raw, status", [
    (b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", b"HTTP/1.0 400"),  # only HTTP/1.x is spoken here
    (b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + HEALTHZ, b"HTTP/1.0 200"),  # one answer
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x00",
     b"HTTP/1.1 200"),  # answered as HTTP, then the end: what follows is not HTTP
])
async def test_versions_and_upgrades_end_with_one_answer(raw, status):
    ep = await _endpoint()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(raw)
        async with asyncio.timeout(10):
            data = await r.read()
        assert data.startswith(status) and data.count(b"Content-Length: ") == 1 and b"Connection: close\r\n" in data
        w.close()
    finally:
        await ep.close()


async def test_connections_over_the_bound_are_refused_and_a_stalled_request_times_out(monkeypatch):
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(http, "READ_TIMEOUT_S", 0.2)
    ep = await _endpoint()
    try:
        conns = [await asyncio.open_connection("127.0.0.1", ep.port) for _ in range(3)]
        for r, w in conns:  # each is served, so each is open on the server's side
            w.write(HEALTHZ)
            async with asyncio.timeout(10):
                assert (await _answer(r))[0] == b"HTTP/1.1 200 OK"
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        async with asyncio.timeout(10):  # the fourth is dropped at accept, unanswered
            w.write(HEALTHZ)
            assert await r.read() == b""
        w.close()
        # Half a request: closed once the read timeout passes, with no answer.
        r, w = conns[0]
        w.write(b"GET /healthz HTTP/1.1\r\n")
        async with asyncio.timeout(10):
            assert await r.read() == b""
        for _, w in conns:
            w.close()
    finally:
        await ep.close()


async def test_answers_wait_while_the_client_takes_none_then_all_come_in_order(monkeypatch):
    paused = asyncio.Event()
    pause_writing = http._HTTPConnection.pause_writing

    def observed(self: http._HTTPConnection) -> None:
        pause_writing(self)
        paused.set()

    monkeypatch.setattr(http._HTTPConnection, "pause_writing", observed)
    ep = HTTPEndpoint(0, lambda: (True, "ok"), lambda: b"m 1\n")
    big = 1 << 20
    ep.route("GET", "/big", lambda req: Response(200, "text/plain", req.query.encode().ljust(big, b".")))
    await ep.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(b"".join(b"GET /big?%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(64)))  # 64 MiB of answers
        async with asyncio.timeout(10):  # the client reads nothing: the server stops writing, and reading
            await paused.wait()
        (conn,) = ep.connections
        assert conn.read_paused and conn.transport is not None
        assert conn.transport.get_write_buffer_size() < 8 * big
        assert len(conn.ready) > 32  # the rest are answered once the client takes these
        async with asyncio.timeout(30):
            got = [await _answer(r) for _ in range(64)]
        assert [b[:3].rstrip(b".") for _, _, b in got] == [str(i).encode() for i in range(64)]
        assert all(len(b) == big for _, _, b in got)
        w.close()
    finally:
        await ep.close()
