"""The metrics port's HTTP endpoint: Prometheus ``/metrics``, ``/healthz`` and added routes on ``--metrics-port``.

Role
    An HTTP/1.1 server on the daemon's asyncio loop: an ``asyncio.Protocol`` per connection, with the
    HTTP itself (request parsing, message framing, keep-alive, ``Expect: 100-continue``) done by h11,
    a small pure-Python HTTP/1.1 state machine with no I/O of its own. It listens on
    ``--metrics-host`` (127.0.0.1 unless configured). ``/metrics`` is rendered by prometheus-client's
    ``generate_latest`` at scrape time from ``Daemon.statistics()``: each family is declared by a
    stats field (``hkvd.transport.stat_fields``), none is named here. ``/healthz`` is 503 until the
    pool is pre-faulted and the control socket accepts, 200 while serving, 503 again once shutdown
    begins. Other features add routes (``HTTPEndpoint.route``): the usable-prefix lookups for routers
    (``hkvd.daemon.routing``).

    Keep-alive and pipelining: a connection answers its requests one at a time, in order; the next
    pipelined request is read once the answer before it is written. HTTP/1.0 clients get one answer
    per connection, in HTTP/1.0. An HTTP/1.1 request must carry ``Host`` (RFC 9112; every HTTP
    client sends it), else it is a 400.
    Bounds (module constants): request head, body size (``Content-Length`` only, no chunked bodies),
    open connections, read and idle timeouts; reading pauses while an answer is worked out or the
    client does not take what is written. Bad input is a 4xx answer and the connection's end (that
    answer's status line reads HTTP/1.0: the request's version may be unknown); a handler bug is a 500
    and a log line, never the daemon's end.

Why h11
    The wire format is the library's (h11, base dependency); the loop, the bounds and the routes stay
    ours. aiohttp would bring its own server and request machinery, several packages and other answers
    to the bounds (a 400 for an oversized head, chunked bodies taken). The cost: h11 is pure Python,
    some tens of microseconds of the loop per request, the same order as a usable-prefix lookup's own
    work.

Dependencies
    h11 (base). prometheus-client is optional (``pip install hkvd[metrics]``): it is imported only when
    this module builds the registry, so the base install runs without it. ``require_prometheus()``
    gives the error the CLI prints when ``--metrics-port`` is set and it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h11

from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.stat_fields import families, sample_name

log = logging.getLogger("hkvd.http")

READ_TIMEOUT_S = 5.0  # a request's head and body arrive within this
IDLE_TIMEOUT_S = 60.0  # a kept-alive connection with no request is closed after this
MAX_REQUEST_BYTES = 8192  # request line and headers
MAX_BODY_BYTES = 4 << 20  # a POST body (hkvd.daemon.routing takes up to 131072 token ids)
MAX_CONNECTIONS = 256  # open connections; more are refused at accept
HOST = "127.0.0.1"


class PrometheusMissing(StartupError, RuntimeError):
    """--metrics-port without prometheus_client installed; the message names the install."""

    exit_code = 2


def require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise PrometheusMissing("--metrics-port needs prometheus-client: pip install 'hkvd[metrics]' "
                                "(or prometheus-client), or leave --metrics-port unset") from None


class StatsCollector:
    """A prometheus-client collector: at each scrape, the families ``statistics()``'s fields declare
    (``hkvd.transport.stat_fields``; the daemon's: ``hkvd.daemon.app.DaemonStats``)."""

    def __init__(self, statistics: Callable[[], object]) -> None:
        self.statistics = statistics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric

        for fam in families(self.statistics()):
            m = Metric(fam.name, fam.help, fam.type)
            for labels, value in fam.samples:
                name, named = sample_name(fam, labels)
                m.add_sample(name, named, value)
            yield m


def build_registry(statistics: Callable[[], object]) -> Any:
    require_prometheus()
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(statistics))
    ProcessCollector(namespace="hkvd", registry=registry)
    return registry


@dataclass(slots=True)
class Request:
    """One HTTP request as a route handler sees it (header names lower-case)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    version: str = "HTTP/1.1"


@dataclass(slots=True)
class Response:
    status: int
    content_type: str
    body: bytes


#: A route handler answers at once, or returns the awaitable that will (responses still go out in order).
Handler = Callable[[Request], "Response | Awaitable[Response]"]

REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 413: "Content Too Large",
           415: "Unsupported Media Type", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}


def text(status: int, message: str) -> Response:
    return Response(status, "text/plain", (message + "\n").encode())


def ipaddress_is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HTTPEndpoint:
    """``/metrics``, ``/healthz`` and the added routes on ``host:port`` (loopback unless configured).
    ``health()`` -> (ok, reason)."""

    def __init__(self, port: int, health: Callable[[], tuple[bool, str]], metrics_body: Callable[[], bytes],
                 host: str = HOST) -> None:
        self.port = port
        self.host = host
        self.health = health
        self.metrics_body = metrics_body
        self.routes: dict[tuple[str, str], Handler] = {}
        self.connections: set[_HTTPConnection] = set()
        self._server: asyncio.Server | None = None

    def route(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``method path`` (``GET`` routes answer ``HEAD`` too) with ``handler``."""
        self.routes[(method, path)] = handler

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _HTTPConnection(self), self.host, self.port,
                                                reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics and health on http://%s:%d/metrics and /healthz", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
            self._server = None

    def dispatch(self, req: Request) -> Response | Awaitable[Response]:
        path = req.path
        method = "GET" if req.method == "HEAD" else req.method
        handler = self.routes.get((method, path))
        if handler is not None:
            return handler(req)
        if any(p == path for _m, p in self.routes):
            allowed = sorted({m for m, p in self.routes if p == path})
            return text(405, f"{path} takes {' or '.join(allowed)}")
        if method != "GET":
            return text(405, "only GET and HEAD here")
        if path == "/healthz":
            ok, reason = self.health()
            return text(200 if ok else 503, reason)
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(200, CONTENT_TYPE_LATEST, self.metrics_body())
        return text(404, "try /metrics or /healthz" + "".join(f" or {m} {p}" for m, p in sorted(self.routes)))


class _HTTPConnection(asyncio.Protocol):
    """One client, its HTTP state kept by an ``h11.Connection``. Requests are answered one at a time in
    order (reading pauses while an answer is worked out, also when a handler awaits). Bounds: a request
    head of ``MAX_REQUEST_BYTES``, a body of ``MAX_BODY_BYTES`` (``Content-Length`` only), a head and
    body must arrive within ``READ_TIMEOUT_S`` of the request's first byte, and a connection with no
    request is closed after ``IDLE_TIMEOUT_S``."""

    def __init__(self, endpoint: HTTPEndpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        self.request: h11.Request | None = None  # its head, while its body arrives
        self.body = bytearray()
        self.pending: asyncio.Future[Response] | None = None  # a handler's answer being worked out
        self.closing = False  # the last answer is written; nothing is read after it
        self.read_paused = False
        self.write_paused = False
        self.started = 0.0  # when the unfinished request's first byte came (0: none pending)
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are no asyncio.Transport
        if len(self.endpoint.connections) >= MAX_CONNECTIONS:
            log.warning("metrics port: %d connections open; refusing another", MAX_CONNECTIONS)
            self.transport.abort()  # type: ignore[union-attr]
            return
        self.endpoint.connections.add(self)
        loop = asyncio.get_running_loop()
        self.last = loop.time()
        self.timer = loop.call_later(READ_TIMEOUT_S, self._check_timeouts)

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        now = asyncio.get_running_loop().time()
        self.last = now
        if not self.started:
            self.started = now
        self.h11.receive_data(data)
        self._drive()

    # ---- reading -----------------------------------------------------------------------------------------
    def _drive(self) -> None:
        """Take h11's events until it needs more data or a request is being answered."""
        while self.transport is not None and not self.closing and self.pending is None:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                if e.error_status_hint == 431:
                    self._refuse(431, f"request head over {MAX_REQUEST_BYTES} bytes")
                else:
                    self._refuse(e.error_status_hint, f"bad request: {e}")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.Request):
                if not self._take_head(event):
                    return
            elif isinstance(event, h11.Data):
                self.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return
        self._update_reading()

    def _take_head(self, req: h11.Request) -> bool:
        """Check a request's head against the bounds (False: refused, the connection ends)."""
        # h11 bounds a head still arriving (max_incomplete_event_size); this, one that came whole: its
        # request line and header fields as parsed (the raw head differs only by optional whitespace).
        head_bytes = len(req.method) + len(req.target) + 12 + sum(len(k) + len(v) + 4 for k, v in req.headers)
        if head_bytes > MAX_REQUEST_BYTES:
            self._refuse(431, f"request head over {MAX_REQUEST_BYTES} bytes")
            return False
        headers = dict(req.headers)
        if b"transfer-encoding" in headers:
            self._refuse(411, "send the body with a Content-Length (chunked bodies are not taken)")
            return False
        n = int(headers.get(b"content-length", b"0"))  # h11 has checked that it is a number
        if n > MAX_BODY_BYTES:
            self._refuse(413, f"the body is {n} bytes; at most {MAX_BODY_BYTES} are taken")
            return False
        if self.h11.they_are_waiting_for_100_continue:  # the client waits for this before it sends the body
            self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
        self.request = req
        self.body = bytearray()
        return True

    # ---- answering ---------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        ev = self.request
        assert ev is not None  # an EndOfMessage follows its Request
        self.request = None
        self.started = 0.0
        target = ev.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in ev.headers}
        req = Request(ev.method.decode("latin-1"), path, query, headers, bytes(self.body),
                      "HTTP/1.0" if ev.http_version == b"1.0" else "HTTP/1.1")
        self.body = bytearray()
        try:
            got = self.endpoint.dispatch(req)
        except Exception:  # an answer must never take the daemon down
            log.exception("error answering %s %s", req.method, req.path)
            got = text(500, "internal error")
        if isinstance(got, Response):
            self._answer(got, req)
            return
        fut = asyncio.ensure_future(got)
        self.pending = fut
        self._update_reading()
        fut.add_done_callback(lambda f: self._answered(f, req))

    def _answered(self, fut: asyncio.Future[Response], req: Request) -> None:
        if fut.cancelled() or fut is not self.pending:
            return  # the connection is gone
        self.pending = None
        exc = fut.exception()
        if exc is not None:
            log.error("error answering %s %s", req.method, req.path, exc_info=exc)
            resp = text(500, "internal error")
        else:
            resp = fut.result()
        self._answer(resp, req)
        self._drive()  # a pipelined request may be waiting

    def _answer(self, resp: Response, req: Request) -> None:
        if self.transport is None:
            return
        out = _serialize(self.h11, resp, head_only=req.method == "HEAD", http10=req.version == "HTTP/1.0")
        self._write(out)
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            if self.h11.trailing_data[0]:  # the next request has begun
                self.started = asyncio.get_running_loop().time()
        else:  # Connection: close, from either side or HTTP/1.0
            self._close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that breaks the protocol or a bound, then close the connection."""
        try:
            out = _serialize(self.h11, text(status, message), head_only=False, http10=True, close=True)
        except h11.LocalProtocolError:  # no answer fits where the exchange stands: just close
            out = b""
        self._write(out)
        self._close()

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None:
            self.transport.write(data)

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _update_reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        pause = self.write_paused or self.pending is not None
        if pause and not self.read_paused:
            t.pause_reading()
            self.read_paused = True
        elif not pause and self.read_paused:
            t.resume_reading()
            self.read_paused = False

    def _check_timeouts(self) -> None:
        self.timer = None
        t = self.transport
        if t is None or t.is_closing():
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.started and now - self.started > READ_TIMEOUT_S and self.pending is None:
            t.close()  # a request that does not arrive whole in time
            return
        if not self.started and self.pending is None and now - self.last > IDLE_TIMEOUT_S:
            t.close()
            return
        self.timer = loop.call_later(READ_TIMEOUT_S, self._check_timeouts)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _serialize(conn: h11.Connection, resp: Response, *, head_only: bool, http10: bool, close: bool = False) -> bytes:
    """``resp`` as bytes through h11 (which sets ``Connection: close`` where the exchange ends). h11 writes
    HTTP/1.1 status lines; an answer to HTTP/1.0 or a refused request is rewritten to read HTTP/1.0."""
    headers = [("Content-Type", resp.content_type), ("Content-Length", str(len(resp.body))),
               ("Connection", "close" if close else "keep-alive")]
    head = conn.send(h11.Response(status_code=resp.status, headers=headers,
                                  reason=REASONS.get(resp.status, "Unknown")))
    assert head is not None and head.startswith(b"HTTP/1.1 ")
    if http10:
        head = b"HTTP/1.0" + head[8:]
    body = b"" if head_only else (conn.send(h11.Data(data=resp.body)) or b"")
    return head + body + (conn.send(h11.EndOfMessage()) or b"")
