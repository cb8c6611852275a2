"""The metrics port's HTTP endpoint: Prometheus ``/metrics``, ``/healthz`` and added routes on ``--metrics-port``.

Role
    An HTTP/1.1 server on the daemon's asyncio loop: an ``asyncio.Protocol`` per connection, with the
    request parsing (request line, header fields, ``Content-Length`` framing, keep-alive) done by
    httptools, the llhttp C parser behind a Python binding. It listens on ``--metrics-host``
    (127.0.0.1 unless configured). ``/metrics`` is rendered by prometheus-client's ``generate_latest``
    at scrape time from ``Daemon.statistics()``: each family is declared by a stats field
    (``hkvd.transport.stat_fields``), none is named here. ``/healthz`` is 503 until the pool is
    pre-faulted and the control socket accepts, 200 while serving, 503 again once shutdown begins.
    Other features add routes (``HTTPEndpoint.route``): the usable-prefix lookups for routers
    (``hkvd.daemon.routing``), asked once per routed request.

    Keep-alive and pipelining: a connection answers its requests one at a time, in order; what one
    read brings is parsed at once, and reading pauses while a handler's answer is awaited. Answers go
    out together, in writes of up to about ``WRITE_BATCH_BYTES``; while the client takes none
    (``pause_writing``) no more are worked out. HTTP/1.0 clients get one answer per connection, in
    HTTP/1.0; ``Expect: 100-continue`` gets its interim answer in turn. An HTTP/1.1 request must carry ``Host``
    (RFC 9112; every HTTP client sends it), else it is a 400.
    Bounds (module constants): request head, body size (``Content-Length`` only, no chunked bodies),
    open connections, read and idle timeouts; reading pauses while an answer is worked out or the
    client does not take what is written. A header field still arriving is counted once whole or once
    a later read brings more of its head, so a head over the bound is refused within one read's worth
    of bytes. Bad input is a 4xx answer (after the answers to the requests before it) and the
    connection's end (that answer's status line reads HTTP/1.0: the request's version may be unknown);
    a handler bug is a 500 and a log line, never the daemon's end.

Why httptools
    Routers ask this endpoint on every request they route, so its cost per request is the floor under
    their lookups. Measured on a 2-vCPU x86_64 VM shared with other work (2026-11-27; pipelined
    ``GET /healthz``, 4 keep-alive connections x 16 in flight, client in another process, server on
    uvloop; 8-11 alternating runs each): httptools 95,000-164,000 answers/s at 5.5-10.5 us of server
    CPU per answer, on par with a minimal hand-written parser (99,000-146,000, 5.5-9.5 us); h11 (pure
    Python) 6,900-10,200 answers/s at 97-144 us (its parse and serialization alone took about 88 us
    per request there). A server library measured the same way (2026-12-02, same VM, other work beside it,
    4 alternating runs each): uvicorn 0.55 with httptools and uvloop, serving a minimal ASGI app, took
    30.6-36.1 us of server CPU per answer (14,000-16,500 answers/s) where this loop took 7.0-7.3 us
    (76,000-124,000); the parser being the same, uvicorn's protocol and ASGI calls per request make the
    difference. aiohttp would bring its own server and request machinery, several packages
    and other answers to the bounds (a 400 for an oversized head, chunked bodies taken). With
    httptools the wire parsing is the library's (C, also uvicorn's parser); the loop, the bounds, the
    answers' framing and the routes stay here.

Dependencies
    httptools (base; binary wheels for CPython on Linux). prometheus-client is optional
    (``pip install hkvd[metrics]``): it is imported only when this module builds the registry, so the
    base install runs without it. ``require_prometheus()`` gives the error the CLI prints when
    ``--metrics-port`` is set and it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httptools

from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.stat_fields import families, sample_name

if TYPE_CHECKING:  # prometheus-client is optional (the metrics extra): for annotations only
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

log = logging.getLogger("hkvd.http")

READ_TIMEOUT_S = 5.0  # a request's head and body arrive within this
IDLE_TIMEOUT_S = 60.0  # a kept-alive connection with no request is closed after this
MAX_REQUEST_BYTES = 8192  # request line and headers
MAX_BODY_BYTES = 4 << 20  # a POST body (hkvd.daemon.routing takes up to 131072 token ids)
MAX_CONNECTIONS = 256  # open connections; more are refused at accept
WRITE_BATCH_BYTES = 1 << 16  # answers to pipelined requests are written together up to about this
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

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import Metric

        for fam in families(self.statistics()):
            m = Metric(fam.name, fam.help, fam.type)
            for labels, value in fam.samples:
                name, named = sample_name(fam, labels)
                m.add_sample(name, named, value)
            yield m


def build_registry(statistics: Callable[[], object]) -> CollectorRegistry:
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


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal to send is ``_HTTPConnection.refusal``."""


@dataclass(slots=True)
class _Refusal:
    status: int
    message: str


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: What a connection has parsed and not yet answered, in order: a request (and whether its answer ends the
#: connection), the interim answer to ``Expect: 100-continue``, or a refusal (the connection's last answer).
_Item = tuple[Request, bool] | bytes | _Refusal


class _HTTPConnection(asyncio.Protocol):
    """One client; httptools parses what it sends, calling the ``on_*`` methods. Requests are answered
    one at a time in order: what one read brings is parsed at once, the requests it completes wait in
    ``ready``, and reading pauses while an answer is worked out (a handler that awaits). The answers to
    one read go out in one write. Bounds: a request head of ``MAX_REQUEST_BYTES``, a body of
    ``MAX_BODY_BYTES`` (``Content-Length`` only), a head and body must arrive within ``READ_TIMEOUT_S``
    of the request's first byte, and a connection with no request is closed after ``IDLE_TIMEOUT_S``."""

    def __init__(self, endpoint: HTTPEndpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        # the request being parsed
        self.in_message = False
        self.head_done = False
        self.began = False  # a request began in the data being parsed
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.head_bytes = 0  # its request line and header fields as parsed so far
        self.head_raw = 0  # bytes received of a head still arriving (an upper bound once it spans reads)
        self.refusal: _Refusal | None = None  # set by a callback that raises _Refused
        self.ready: deque[_Item] = deque()
        self.pending: asyncio.Future[Response] | None = None  # a handler's answer being worked out
        self.closing = False  # nothing more is read; the transport closes once ``ready`` is answered
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
        self.ready.clear()
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._drive([])  # answers held back while the client took none

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        now = asyncio.get_running_loop().time()
        self.last = now
        if not self.started:
            self.started = now
        self.began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # what follows an upgrade request is no HTTP taken here
            if self.ready and isinstance(self.ready[-1], tuple):
                self.ready[-1] = (self.ready[-1][0], True)
            self.closing = True
        except httptools.HttpParserCallbackError as e:
            if not self.closing:  # else: parsing stopped after a request that ends the connection
                if self.refusal is None:  # a bug in a callback below
                    log.error("error parsing a request", exc_info=e.__context__)
                self._refuse(self.refusal or _Refusal(500, "internal error"))
        except httptools.HttpParserError as e:
            self._refuse(_Refusal(400, f"bad request: {e}"))
        else:
            if self.in_message and not self.head_done:  # a head still arriving
                # Where it began, what was parsed of it (a header field being received is not counted
                # until whole, bounding it by one read); every later read is head until it ends.
                self.head_raw = self.head_bytes if self.began else self.head_raw + len(data)
                if self.head_raw > MAX_REQUEST_BYTES:
                    self._refuse(_Refusal(431, f"request head over {MAX_REQUEST_BYTES} bytes"))
        if not self.in_message:
            self.started = 0.0
        elif self.began:
            self.started = now
        self._drive([])

    # ---- parsing (httptools' callbacks) -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_message = True
        self.head_done = False
        self.began = True
        self.url = b""
        self.headers = {}
        self.body = bytearray()
        self.head_bytes = 12  # the request line's spaces, "HTTP/1.x" and CRLF (its method is added later)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_REQUEST_BYTES:
            self._stop(431, f"request head over {MAX_REQUEST_BYTES} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        """Check a request's head against the bounds (a refusal ends the connection)."""
        self.head_done = True
        if self.head_bytes + len(self.parser.get_method()) > MAX_REQUEST_BYTES:
            self._stop(431, f"request head over {MAX_REQUEST_BYTES} bytes")
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            self._stop(400, f"bad request: HTTP/{version}; HTTP/1.1 and HTTP/1.0 are taken")
        headers = self.headers
        if version == "1.1" and "host" not in headers:
            self._stop(400, "bad request: an HTTP/1.1 request needs a Host header (RFC 9112)")
        if "transfer-encoding" in headers:
            self._stop(411, "send the body with a Content-Length (chunked bodies are not taken)")
        n = int(headers.get("content-length", "0"))  # httptools has checked that it is a number
        if n > MAX_BODY_BYTES:
            self._stop(413, f"the body is {n} bytes; at most {MAX_BODY_BYTES} are taken")
        if version == "1.1" and headers.get("expect", "").lower() == "100-continue":
            self.ready.append(_CONTINUE)  # the client waits for this before it sends the body

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.in_message = False
        http10 = self.parser.get_http_version() == "1.0"
        close = http10 or not self.parser.should_keep_alive()  # HTTP/1.0: one answer per connection
        path, _, query = self.url.decode("latin-1").partition("?")
        req = Request(self.parser.get_method().decode("latin-1"), path, query, self.headers, bytes(self.body),
                      "HTTP/1.0" if http10 else "HTTP/1.1")
        self.body = bytearray()
        self.ready.append((req, close))
        if close:
            self.closing = True
            raise _Refused  # nothing after it is parsed

    def _stop(self, status: int, message: str) -> None:
        self.refusal = _Refusal(status, message)
        raise _Refused

    # ---- answering ---------------------------------------------------------------------------------------
    def _drive(self, out: list[bytes]) -> None:
        """Answer what is ready, in order, until a handler awaits or the client stops taking answers
        (``pause_writing``); answers go out together, in writes of about ``WRITE_BATCH_BYTES``."""
        t = self.transport
        size = sum(map(len, out))
        while self.ready and self.pending is None and not self.write_paused and t is not None:
            if size >= WRITE_BATCH_BYTES:
                t.write(b"".join(out))  # may pause writing: what is left waits for resume_writing
                out.clear()
                size = 0
                continue
            item = self.ready.popleft()
            if isinstance(item, bytes):
                out.append(item)
                size += len(item)
            elif isinstance(item, _Refusal):
                size += _emit(out, text(item.status, item.message), "HTTP/1.0", close=True, head_only=False)
            else:
                req, close = item
                fut: asyncio.Future[Response] | None = None
                try:
                    got = self.endpoint.dispatch(req)
                    if not isinstance(got, Response):
                        fut = asyncio.ensure_future(got)
                except Exception:  # an answer must never take the daemon down
                    log.exception("error answering %s %s", req.method, req.path)
                    got, fut = text(500, "internal error"), None
                if fut is None:
                    assert isinstance(got, Response)
                    size += _emit(out, got, req.version, close=close, head_only=req.method == "HEAD")
                else:
                    self.pending = fut
                    fut.add_done_callback(functools.partial(self._answered, req=req, close=close))
        if t is None or t is not self.transport:
            return
        if out:
            t.write(b"".join(out))
        if self.closing and not self.ready and self.pending is None:
            t.close()
        else:
            self._update_reading()

    def _answered(self, fut: asyncio.Future[Response], *, req: Request, close: bool) -> None:
        if fut.cancelled() or fut is not self.pending:
            return  # the connection is gone
        self.pending = None
        exc = fut.exception()
        if exc is not None:
            log.error("error answering %s %s", req.method, req.path, exc_info=exc)
            resp = text(500, "internal error")
        else:
            resp = fut.result()
        if self.in_message:  # the next request's bytes were held back while this one was worked out
            self.started = asyncio.get_running_loop().time()
        out: list[bytes] = []
        _emit(out, resp, req.version, close=close, head_only=req.method == "HEAD")
        self._drive(out)  # a pipelined request may be waiting

    def _refuse(self, refusal: _Refusal) -> None:
        """Answer a request that breaks the protocol or a bound once those before it are, then close."""
        self.ready.append(refusal)
        self.closing = True

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


def _emit(out: list[bytes], resp: Response, version: str, *, close: bool, head_only: bool) -> int:
    """``resp``'s status line, headers and (unless answering HEAD) body onto ``out``; how many bytes."""
    head = (f"{version} {resp.status} {REASONS.get(resp.status, 'Unknown')}\r\nContent-Type: {resp.content_type}"
            f"\r\nContent-Length: {len(resp.body)}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n"
            ).encode("latin-1")
    out.append(head)
    if head_only:
        return len(head)
    out.append(resp.body)
    return len(head) + len(resp.body)
