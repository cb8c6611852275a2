"""The metrics port's HTTP endpoint: Prometheus ``/metrics``, ``/healthz`` and added routes on ``--metrics-port``.

Role
    A small asyncio HTTP/1.1 server (an ``asyncio.Protocol``: keep-alive and pipelining, answers in
    request order; HTTP/1.0 clients get one answer per connection unless they ask to keep it). It
    listens on ``--metrics-host`` (127.0.0.1 unless configured). ``/metrics`` is rendered by
    prometheus-client's ``generate_latest`` at scrape time from ``Daemon.statistics()``: each family
    is declared by a stats field (``hkvd.transport.stat_fields``), none is named here. ``/healthz``
    is 503 until the pool is pre-faulted and the control socket accepts, 200 while serving, 503
    again once shutdown begins. Other features add routes
    (``HTTPEndpoint.route``): the usable-prefix lookups for routers (``hkvd.daemon.routing``).
    Bounds (module constants): request head, body size (``Content-Length`` only), answers waiting
    per connection, open connections, read and idle timeouts. Bad input is a 4xx answer; a handler
    bug is a 500 and a log line, never the daemon's end.

Dependencies
    prometheus-client is optional (``pip install hkvd[metrics]``): it is imported only when this
    module builds the registry, so the base install runs without it. ``require_prometheus()`` gives
    the error the CLI prints when ``--metrics-port`` is set and it is missing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hkvd.daemon.startup_errors import StartupError
from hkvd.transport.stat_fields import families, sample_name

log = logging.getLogger("hkvd.http")

READ_TIMEOUT_S = 5.0  # a request's head and body arrive within this
IDLE_TIMEOUT_S = 60.0  # a kept-alive connection with no request is closed after this
MAX_REQUEST_BYTES = 8192  # request line and headers
MAX_BODY_BYTES = 4 << 20  # a POST body (hkvd.daemon.routing takes up to 131072 token ids)
MAX_PIPELINED = 64  # answers waiting on one connection before it stops reading
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
    """One client: HTTP/1.1 with keep-alive and pipelining (HTTP/1.0 closes after each answer unless it
    asks to keep the connection). Answers go out in request order, also when a handler awaits. Bounds:
    a request head of ``MAX_REQUEST_BYTES``, a body of ``MAX_BODY_BYTES`` (``Content-Length`` only, no
    chunked bodies), ``MAX_PIPELINED`` answers waiting (reading pauses beyond), a head or body must
    arrive within ``READ_TIMEOUT_S`` and an idle connection is closed after ``IDLE_TIMEOUT_S``."""

    def __init__(self, endpoint: HTTPEndpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.queue: collections.deque[tuple[asyncio.Future[Response], bool, bool, str]] = collections.deque()
        self.closing = False  # the last answer carries Connection: close; nothing is read after it
        self.continued = False  # "100 Continue" sent for the request whose body is awaited
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
        for fut, *_ in self.queue:
            fut.cancel()
        self.queue.clear()
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
        self.buf += data
        now = asyncio.get_running_loop().time()
        self.last = now
        if not self.started:
            self.started = now
        out: list[bytes] = []
        parsed = False
        while not self.closing and self.buf:
            req = self._parse()
            if req is None:
                break
            parsed = True
            self._answer(req, out)
        if not self.buf:
            self.started = 0.0
        elif parsed:  # what is left is the start of the next request
            self.started = now
        if out and self.transport is not None:
            self.transport.write(b"".join(out))
        if self.closing and not self.queue and self.transport is not None:
            self.transport.close()
        self._update_reading()

    # ---- parsing -----------------------------------------------------------------------------------------
    def _parse(self) -> Request | tuple[int, str] | None:
        """The next complete request; (status, message) for a bad one (answered, then closed); None: wait."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n", 0, MAX_REQUEST_BYTES + 4)
        if end < 0:
            if len(buf) > MAX_REQUEST_BYTES:
                return 431, f"request head over {MAX_REQUEST_BYTES} bytes"
            return None
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, "bad request"
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return 400, "bad request: a header line without a colon"
            headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers:
            return 411, "send the body with a Content-Length (chunked bodies are not taken)"
        length = headers.get("content-length", "0")
        if not length.isdigit():
            return 400, "bad request: Content-Length is not a number"
        n = int(length)
        if n > MAX_BODY_BYTES:
            return 413, f"the body is {n} bytes; at most {MAX_BODY_BYTES} are taken"
        start = end + 4
        if len(buf) < start + n:
            if not self.continued and headers.get("expect", "").lower() == "100-continue" and not self.queue:
                self.continued = True  # the client waits for this before it sends the body
                if self.transport is not None:
                    self.transport.write(parts[2].encode() + b" 100 Continue\r\n\r\n")
            return None
        self.continued = False
        body = bytes(buf[start:start + n])
        del buf[:start + n]
        path, _, query = parts[1].partition("?")
        return Request(parts[0], path, query, headers, body, "HTTP/1.0" if parts[2] == "HTTP/1.0" else "HTTP/1.1")

    # ---- answering ---------------------------------------------------------------------------------------
    def _answer(self, req: Request | tuple[int, str], out: list[bytes]) -> None:
        if isinstance(req, tuple):
            self.buf.clear()
            self.closing = True
            self._emit(text(*req), "HTTP/1.0", False, True, out)
            return
        version = req.version
        conn = req.headers.get("connection", "").lower()
        keep = (conn != "close") if version == "HTTP/1.1" else (conn == "keep-alive")
        if not keep:
            self.closing = True
        head = req.method == "HEAD"
        try:
            got = self.endpoint.dispatch(req)
        except Exception:  # an answer must never take the daemon down
            log.exception("error answering %s %s", req.method, req.path)
            got = text(500, "internal error")
        if isinstance(got, Response):
            self._emit(got, version, head, not keep, out)
            return
        fut = asyncio.ensure_future(got)
        self.queue.append((fut, head, not keep, version))
        fut.add_done_callback(self._flush)

    def _emit(self, resp: Response, version: str, head: bool, close: bool, out: list[bytes]) -> None:
        if self.queue:  # an earlier answer is still being worked out: this one waits its turn
            fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
            fut.set_result(resp)
            self.queue.append((fut, head, close, version))
            return
        out.append(_head(resp, version, close))
        if not head:
            out.append(resp.body)

    def _flush(self, _fut: object = None) -> None:
        out: list[bytes] = []
        while self.queue and self.queue[0][0].done():
            fut, head, close, version = self.queue.popleft()
            if fut.cancelled():
                continue
            exc = fut.exception()
            if exc is not None:
                log.error("error answering a request", exc_info=exc)
                resp = text(500, "internal error")
            else:
                resp = fut.result()
            out.append(_head(resp, version, close))
            if not head:
                out.append(resp.body)
        if self.transport is None:
            return
        if out:
            self.transport.write(b"".join(out))
        if self.closing and not self.queue:
            self.transport.close()
        self._update_reading()

    def _update_reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        pause = self.write_paused or len(self.queue) >= MAX_PIPELINED
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
        if self.started and now - self.started > READ_TIMEOUT_S and not self.queue:
            t.close()  # a request that does not arrive whole in time
            return
        if not self.buf and not self.queue and now - self.last > IDLE_TIMEOUT_S:
            t.close()
            return
        self.timer = loop.call_later(READ_TIMEOUT_S, self._check_timeouts)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _head(resp: Response, version: str, close: bool) -> bytes:
    return (f"{version} {resp.status} {REASONS.get(resp.status, 'Unknown')}\r\nContent-Type: {resp.content_type}\r\n"
            f"Content-Length: {len(resp.body)}\r\n{'Connection: close' if close else 'Connection: keep-alive'}"
            "\r\n\r\n").encode()
