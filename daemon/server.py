"""The Unix-socket adapter: accepts engines, checks who they are, moves frames. No KV logic here.

Lifecycle of a connection
    accept -> SO_PEERCRED (pid/uid/gid from the kernel, never from a message) -> uid allowlist ->
    Hello within ``io_timeout_s`` (protocol version checked; the HelloAck names this daemon run and, to an
    engine with --in-step-loads on, the pool to map read-only: ``pool_offer``) -> frames until EOF -> wait
    for its in-flight jobs (each has its own timeout) -> release everything the connection held
    (``KVService.disconnect``).

Engines that die
    The pinned process's pidfd is watched on the loop: once it exits (SIGKILL included), the
    connection is aborted even if a child it forked still holds the socket. Either way, at its exit
    or when its connection ends, ``KVService.engine_gone`` has the copy engine abandon the copies
    that wait on the engine (``CopyEngine.abandon``: a GPU copy waiting on its step event ends at
    once), so the jobs end, and the release (registration, leases, IPC mappings) follows within
    moments, not after ``copy_timeout_s``. Their failures are logged at info.

Threading and flow
    Each connection is an ``asyncio.Protocol`` on the daemon's loop. Frames are served in order, at
    most ``FRAMES_PER_TURN`` per loop turn (a burst waits in the connection's backlog, and nothing
    more is read meanwhile, so other clients are served in between): a request that needs no wait
    (ping, status, release, abort, register, a lookup the pool answers) is answered before the next
    frame, with no task. While a client leaves its replies unread, none of its queued frames is
    served. Requests that wait (store, retrieve, step event, a lookup that reads the disk tier) run
    as tasks of the connection. Backpressure both ways: at
    ``MAX_TASKS_PER_CONN`` running tasks, or while the transport's write buffer is over its high
    mark (a client that does not read its replies), the connection stops reading; a client whose
    replies stay unread for ``io_timeout_s`` is disconnected.

Open-file descriptors
    A connection accepted with fewer than the budget's reserve of descriptors free
    (``daemon/fd_budget.py``) pins nothing: at its Hello, an engine is refused with
    ``ResourceExhausted`` (naming LimitNOFILE) and closed, while a tool (``hkvd status``) is served,
    up to ``MAX_RESERVE_TOOLS`` at once, and may not register. Running out while pinning an engine
    (EMFILE) is the same refusal. Connections already served are never touched. Should ``accept()``
    itself fail for want of a descriptor, the event loop pauses accepting (asyncio) or closes the
    pending connections (uvloop's libuv): the listening socket never spins.

Errors
    A frame that cannot be decoded, or a request that breaks the rules, gets ``Error(req_id, code,
    message)`` and the connection keeps serving; after ``MAX_CONSECUTIVE_ERRORS`` in a row, or on a
    frame-level fault (oversized length) that desynchronises the stream, it is closed. Other
    clients are never affected.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import grp
import itertools
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.client_process import ClientProcess
from hkvd.daemon.engines.connection import Conn, request_log
from hkvd.daemon.engines.service import KVService
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import (
    FrameTooLarge,
    InternalError,
    KVError,
    PermissionDenied,
    ProtocolViolation,
    ResourceExhausted,
    UnsupportedVersion,
)
from hkvd.transport.stat_fields import metric
from hkvd.transport.wire import PROTOCOL_VERSION, Message, control, kv

log = logging.getLogger("hkvd.server")

MAX_CONSECUTIVE_ERRORS = 32
MAX_TASKS_PER_CONN = 1024  # waiting requests per connection before it stops reading more
# Frames of one connection served per loop turn; the rest wait for a later turn (other clients go first).
FRAMES_PER_TURN = 64
# Error replies logged at warning (the daemon or the machine is in trouble); the rest at info.
_LOUD_CODES = {"TIMEOUT", "COPY_FAILED", "INTERNAL", "POOL_FULL"}
# Tool connections (hkvd status) served from the descriptor reserve at once; more are refused like engines.
MAX_RESERVE_TOOLS = 8
REFUSAL_LOG_EVERY_S = 60.0  # refusals for want of descriptors: one warning per minute, with the count
ENGINE_ROLES = ("worker", "scheduler")  # offered the pool (HelloAck.pool) with --in-step-loads on
SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108, with its NUL)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


@dataclass(frozen=True, slots=True)
class ServerStats:
    """The control socket's connections now (/metrics only)."""

    connections: int = metric("hkvd_connections", "Open control connections")
    inflight_copies: int = metric("hkvd_inflight_copies", "Copies running now")


class Server:
    def __init__(self, cfg: DaemonConfig, service: KVService) -> None:
        self.cfg = cfg
        self.service = service
        self.server_id = service.server_id
        self._server: asyncio.AbstractServer | None = None
        self._conn_ids = itertools.count(1)
        self.connections: dict[int, Conn] = {}
        self._links: set[_Link] = set()
        allowed = set(cfg.allowed_uids) or {os.geteuid()}
        self.allowed_uids = allowed | {0}
        self.descriptors = service.descriptors
        self.reserve_tools = 0  # tool connections served from the descriptor reserve now
        self._refusals_unlogged = 0
        self._refusal_logged_at = -REFUSAL_LOG_EVERY_S

    def pool_offer(self, role: str) -> list[int]:
        """``HelloAck.pool``: ``[fd, size]`` of the pool for an engine's connection (a worker or scheduler)
        where the service answers lookups with places (--in-step-loads on); [] for tools and peers, or with the
        option off."""
        if role not in ENGINE_ROLES or self.service.places is None:
            return []
        pool = self.service.index.pool
        return [pool.fd, pool.size]

    async def start(self) -> None:
        path = Path(self.cfg.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(path):  # noqa: ASYNC240 - start-up, before serving
            if await self._socket_alive(path):
                raise OSError(f"another hkvd is already serving {path}; stop it or pass --socket")
            os.unlink(path)
        # The socket is bound under a private name and renamed into place once it listens with its
        # final mode and group: a client (or a script waiting for the file) that sees the path can
        # connect, and is never refused by a socket bound but not yet listening.
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        if len(os.fsencode(staging)) > SUN_PATH_MAX:
            raise OSError(f"socket path {path} is too long: the daemon binds {staging} first, and a Unix socket "
                          f"path holds at most {SUN_PATH_MAX} bytes; pass a shorter --socket")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)  # left by a process of this pid that died mid-start
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o117)  # the socket is born 0660: no window with wider permissions
        try:
            self._server = await loop.create_unix_server(lambda: _Link(self), path=str(staging))
            os.chmod(staging, self.cfg.socket_mode)
            if self.cfg.socket_group:
                os.chown(staging, -1, grp.getgrnam(self.cfg.socket_group).gr_gid)
            os.rename(staging, path)
        except BaseException:
            if self._server is not None:
                self._server.close()
                self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            raise
        finally:
            os.umask(old_umask)

    @staticmethod
    async def _socket_alive(path: Path) -> bool:
        try:
            async with asyncio.timeout(1.0):
                _, w = await asyncio.open_unix_connection(str(path))
        except (OSError, TimeoutError):
            return False
        w.close()
        return True

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.cfg.socket_path)

    def statistics(self) -> ServerStats:
        return ServerStats(connections=len(self.connections),
                           inflight_copies=sum(c.inflight for c in self.connections.values()))

    def close_connections(self) -> None:
        """Close every client connection (shutdown, after its copies drained)."""
        for link in list(self._links):
            link.close()

    def reply_error(self, conn: Conn, req_id: int, e: KVError, *, gone: bool = False) -> None:
        """Count and log the error, and answer it. ``gone``: the engine process exited or its connection
        ended, so its failed jobs are expected (logged at info, never warning)."""
        self.service.metrics.inc("errors", code=e.code.name)
        loud = e.code.name in _LOUD_CODES and not gone
        log.log(logging.WARNING if loud else logging.INFO, "request failed%s: %s: %s",
                " (the engine is gone)" if gone else "", e.code.name, e.message, extra=request_log(conn, req_id))
        conn.send(kv.Error(req_id, int(e.code), e.message))

    def refused_for_descriptors(self, conn: Conn, e: ResourceExhausted) -> None:
        """Count a connection refused for want of descriptors; warn once a minute, with the count."""
        self.service.metrics.inc("connections_refused", reason="descriptors")
        self.service.metrics.inc("errors", code=e.code.name)
        self._refusals_unlogged += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:
            log.warning("refused %d engine connection(s) (the last from pid %d): %s", self._refusals_unlogged,
                        conn.pid, e.message)
            self._refusals_unlogged = 0
            self._refusal_logged_at = now

    def internal_error(self, conn: Conn, req_id: int, e: Exception, what: str) -> None:
        """A bug: log it with its traceback, answer INTERNAL, and never let it take the daemon down."""
        log.error("internal error %s from pid %d", what, conn.pid, exc_info=e, extra=request_log(conn, req_id))
        self.service.metrics.inc("internal_errors")
        self.reply_error(conn, req_id, InternalError(f"internal error: {e!r}"))


class _Link(asyncio.Protocol):
    """One client connection: frames in, replies out, flow control both ways. See the module docstring."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.service = server.service
        self.cfg = server.cfg
        self.decoder = FrameDecoder(server.cfg.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.conn: Conn | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.greeted = False
        self.errors_in_a_row = 0
        self.closing = False
        self._read_paused = False
        self._write_paused = False
        self._backlog: collections.deque[bytes] = collections.deque()  # frames read, not yet served
        self._turn_scheduled = False  # a later loop turn serves more of the backlog
        self._eof = False
        self._timer: asyncio.TimerHandle | None = None  # Hello deadline, then the unread-replies deadline
        self._closer: asyncio.Task[None] | None = None
        self._short: ResourceExhausted | None = None  # accepted within the descriptor reserve: see _hello
        self._reserve_tool = False

    # ---- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = self.transport.get_extra_info("socket")
        pid, uid, _gid = peer_credentials(sock)
        conn = self.conn = Conn(conn_id=next(self.server._conn_ids), pid=pid, uid=uid, send=self._send)
        if uid not in self.server.allowed_uids:
            log.warning("refused connection from uid %d (pid %d): not in the allowlist", uid, pid)
            self._send(kv.Error(0, PermissionDenied.code, f"uid {uid} may not use this hkvd; add it to "
                                "allowed-uids in the daemon config"))
            self.close()
            return
        fd = sock.fileno()
        if self.server.descriptors.short(fd):  # pin nothing; the Hello decides (an engine is refused)
            self._short = self.server.descriptors.refusal(f"engine connection from pid {pid}", fd)
        else:
            try:  # the process itself, pinned: see hkvd.daemon.engines.client_process
                conn.process = ClientProcess.from_socket(sock)
                self._watch(conn.process)
            except ResourceExhausted as e:
                self._short = e
            except KVError as e:  # gone already, or not the process the kernel reported
                self._send(kv.Error(0, e.code, e.message))
                self.close()
                return
        self.server.connections[conn.conn_id] = conn
        self.server._links.add(self)
        self._timer = asyncio.get_running_loop().call_later(self.cfg.io_timeout_s, self._timed_out, "sending Hello")

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            frames = self.decoder.feed(data)
        except FrameTooLarge as e:
            assert self.conn is not None
            self._send(kv.Error(0, e.code, e.message))
            self.close()  # the stream cannot be resynchronised after a bad length
            return
        self._backlog.extend(frames)
        self._serve_backlog()

    def _serve_backlog(self) -> None:
        """Serve queued frames in order: at most ``FRAMES_PER_TURN`` per loop turn, so one client's burst
        never holds the loop, and none while its replies go unread (its writes are paused)."""
        self._turn_scheduled = False
        served = 0
        while self._backlog and not self.closing and not self._write_paused:
            if served == FRAMES_PER_TURN:
                self._turn_scheduled = True
                asyncio.get_running_loop().call_soon(self._serve_backlog)
                break
            served += 1
            self._serve(self._backlog.popleft())
        if self._eof and not self._backlog and not self.closing:
            self._finish_eof()
        self._update_reading()

    def _serve(self, body: bytes) -> None:
        if not self.greeted:
            self._hello(body)
        elif self._dispatch(body):
            self.errors_in_a_row = 0
        else:
            self.errors_in_a_row += 1
            if self.errors_in_a_row >= MAX_CONSECUTIVE_ERRORS:
                assert self.conn is not None
                log.warning("closing connection %d (pid %d): %d bad requests in a row", self.conn.conn_id,
                            self.conn.pid, self.errors_in_a_row)
                self.close()

    def eof_received(self) -> bool:
        """The client is done sending (it may still read): serve what it sent, answer its jobs, then close."""
        self._eof = True
        if self._backlog:
            return True  # _serve_backlog finishes the EOF once the last queued frame is served
        self._finish_eof()
        return bool(self.tasks)  # True keeps our side open until the last job answered (_job_done)

    def _finish_eof(self) -> None:
        self.closing = True
        if not self.tasks and self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        """The client is not reading its replies: read no more of its requests, and give it ``io_timeout_s``."""
        self._write_paused = True
        self._update_reading()
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(self.cfg.io_timeout_s, self._timed_out,
                                                            "reading its replies")

    def resume_writing(self) -> None:
        self._write_paused = False
        self._cancel_timer()
        if self._backlog and not self._turn_scheduled:  # frames held back while the replies went unread
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._serve_backlog)
        self._update_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._cancel_timer()
        conn = self.conn
        if conn is None or conn.conn_id not in self.server.connections:
            return
        if exc is not None:
            log.debug("connection %d (pid %d) ended: %s", conn.conn_id, conn.pid, exc)
        self.service.engine_gone(conn)  # nobody reads the replies: copies waiting on the engine end now
        if self.tasks:  # in-flight copies still use the engine's pages: release once they end
            self._closer = asyncio.get_running_loop().create_task(self._release_after(list(self.tasks)))
        else:
            self._release()

    # ---- the engine process -------------------------------------------------------------------
    def _watch(self, process: ClientProcess) -> None:
        """Notice the process's exit on the loop (its pidfd turns readable), even while a child it
        forked keeps the socket open."""
        loop = asyncio.get_running_loop()
        fd = process.pidfd
        loop.add_reader(fd, self._process_exited)
        assert self.conn is not None

        def unwatch() -> None:
            loop.remove_reader(fd)

        self.conn.unwatch = unwatch

    def _process_exited(self) -> None:
        conn = self.conn
        assert conn is not None
        if conn.unwatch is not None:  # the pidfd stays readable: one notice is enough
            conn.unwatch()
            conn.unwatch = None
        log.info("connection %d (pid %d): the process exited; ending the connection and releasing what it held",
                 conn.conn_id, conn.pid)
        self.service.engine_gone(conn)
        if self.transport is not None:
            self.transport.abort()  # its replies have no reader; connection_lost releases once its jobs end

    # ---- frames ------------------------------------------------------------------------------
    def _hello(self, body: bytes) -> None:
        conn = self.conn
        assert conn is not None
        try:
            msg = decode_body(body, self.cfg.max_frame_bytes)
            if not isinstance(msg, control.Hello):
                raise ProtocolViolation(f"the first message must be Hello, got {type(msg).__name__}")
            if msg.version != PROTOCOL_VERSION:
                raise UnsupportedVersion(f"client speaks protocol {msg.version}, this daemon speaks protocol "
                                         f"{PROTOCOL_VERSION}; run the shim and hkvd serve from the same hkvd "
                                         "version (upgrade the older side)")
        except KVError as e:
            self._send(kv.Error(0, e.code, e.message))
            self.close()
            return
        if self._short is not None:
            if msg.role != "tool" or self.server.reserve_tools >= MAX_RESERVE_TOOLS:
                self.server.refused_for_descriptors(conn, self._short)
                self._send(kv.Error(0, self._short.code, self._short.message))
                self.close()
                return
            self.server.reserve_tools += 1  # hkvd status must answer when engines are refused
            self._reserve_tool = True
            conn.register_refusal = self._short
        self.greeted = True
        self._cancel_timer()
        conn.role = msg.role
        self._send(control.HelloAck(PROTOCOL_VERSION, os.getpid(), self.cfg.max_frame_bytes,
                                    self.server.server_id, self.server.pool_offer(msg.role)))

    def _dispatch(self, body: bytes) -> bool:
        """Serve one frame; False when it earned an error reply (counted towards the close)."""
        conn = self.conn
        assert conn is not None
        req_id = 0
        try:
            msg = decode_body(body, self.cfg.max_frame_bytes)
            req_id = getattr(msg, "req_id", 0)
            rest = self.service.handle(conn, msg)
        except KVError as e:
            self.server.reply_error(conn, req_id, e)
            return False
        except Exception as e:  # a bug: never let it take the daemon down
            self.server.internal_error(conn, req_id, e, "handling a request")
            return False
        if rest is not None:
            self._spawn(req_id, rest)
        return True

    def _spawn(self, req_id: int, rest: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(self._job(req_id, rest))
        self.tasks.add(task)
        task.add_done_callback(self._job_done)
        self._update_reading()

    async def _job(self, req_id: int, rest: Awaitable[None]) -> None:
        conn = self.conn
        assert conn is not None
        try:
            await rest
        except KVError as e:
            self.server.reply_error(conn, req_id, e, gone=conn.gone)
        except Exception as e:
            self.server.internal_error(conn, req_id, e, f"in job {req_id}")
        finally:
            conn.jobs.discard(req_id)
            conn.aborted.discard(req_id)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self.closing and not self.tasks and self.transport is not None:
            self.transport.close()  # after EOF (or a close request): the last reply is out
            return
        self._update_reading()

    # ---- output, flow, close -----------------------------------------------------------------
    def _send(self, msg: Message) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(encode(msg))

    def _update_reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        # Queued frames count too: nothing more is read (and buffered) until they are served.
        pause = self._write_paused or len(self.tasks) >= MAX_TASKS_PER_CONN or bool(self._backlog)
        if pause and not self._read_paused:
            t.pause_reading()
        elif not pause and self._read_paused:
            t.resume_reading()
        self._read_paused = pause

    def _timed_out(self, what: str) -> None:
        conn = self.conn
        assert conn is not None
        self._timer = None
        log.info("closing connection %d (pid %d): no progress %s within %.0f s", conn.conn_id, conn.pid, what,
                 self.cfg.io_timeout_s)
        if self.transport is not None:
            self.transport.abort()  # its buffered replies cannot be delivered anyway

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Stop reading; close once the buffered replies (an error, usually) are written."""
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    async def _release_after(self, tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.wait(tasks)  # each job is bounded by its own copy or disk timeout
        self._release()

    def _release(self) -> None:
        conn = self.conn
        assert conn is not None
        self.server.connections.pop(conn.conn_id, None)
        self.server._links.discard(self)
        if self._reserve_tool:
            self._reserve_tool = False
            self.server.reserve_tools -= 1
        self.service.disconnect(conn)
        conn.closed = True
