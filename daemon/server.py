"""The Unix-socket adapter: accepts engines, checks who they are, moves frames. No KV logic here.

Lifecycle of a connection
    accept -> SO_PEERCRED (pid/uid/gid from the kernel, never from a message) -> uid allowlist ->
    Hello within ``io_timeout_s`` (protocol version checked) -> frames until EOF -> release at
    once everything the connection held (``KVService.disconnect``) -> wait for its in-flight
    copies (each has its own timeout) -> close.

Errors
    A frame that cannot be decoded, or a request that breaks the rules, gets ``Error(req_id, code,
    message)`` and the connection keeps serving; after ``MAX_CONSECUTIVE_ERRORS`` in a row, or on a
    frame-level fault (oversized length) that desynchronises the stream, it is closed. Other
    clients are never affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import itertools
import logging
import os
import socket
import struct
import uuid
from pathlib import Path

from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.errors import (
    FrameTooLarge,
    InternalError,
    KVError,
    PermissionDenied,
    ProtocolViolation,
    UnsupportedVersion,
)
from hkvd.daemon.service import Conn, KVService, request_log
from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.wire import PROTOCOL_VERSION, Message, control, events, kv

log = logging.getLogger("hkvd.server")

MAX_CONSECUTIVE_ERRORS = 32
READ_BYTES = 1 << 16
_JOBS = (kv.Store, kv.Retrieve, events.StepEvent)
# Error replies logged at warning (the daemon or the machine is in trouble); the rest at info.
_LOUD_CODES = {"TIMEOUT", "COPY_FAILED", "INTERNAL", "POOL_FULL"}


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


class Server:
    def __init__(self, cfg: DaemonConfig, service: KVService) -> None:
        self.cfg = cfg
        self.service = service
        self.server_id = uuid.uuid4().hex[:12]
        self._server: asyncio.Server | None = None
        self._conn_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections: dict[int, Conn] = {}
        allowed = set(cfg.allowed_uids) or {os.geteuid()}
        self.allowed_uids = allowed | {0}

    async def start(self) -> None:
        path = Path(self.cfg.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(path):  # noqa: ASYNC240 - start-up, before serving
            if await self._socket_alive(path):
                raise OSError(f"another hkvd is already serving {path}; stop it or pass --socket")
            os.unlink(path)
        old_umask = os.umask(0o117)  # the socket is born 0660: no window with wider permissions
        try:
            self._server = await asyncio.start_unix_server(self._on_client, path=str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, self.cfg.socket_mode)
        if self.cfg.socket_group:
            os.chown(path, -1, grp.getgrnam(self.cfg.socket_group).gr_gid)

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

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, _gid = peer_credentials(sock)
        conn_id = next(self._conn_ids)

        def send(msg: Message) -> None:
            if not writer.is_closing():
                writer.write(encode(msg))

        conn = Conn(conn_id=conn_id, pid=pid, uid=uid, send=send)
        try:
            if uid not in self.allowed_uids:
                log.warning("refused connection from uid %d (pid %d): not in the allowlist", uid, pid)
                send(kv.Error(0, PermissionDenied.code, f"uid {uid} may not use this hkvd; add it to "
                              "allowed-uids in the daemon config"))
                await self._drain(writer)
                return
            self.connections[conn_id] = conn
            await self._serve(conn, reader, writer)
        except (ConnectionError, TimeoutError) as e:
            log.debug("connection %d (pid %d) ended: %s", conn_id, pid, e)
        finally:
            self.connections.pop(conn_id, None)
            self.service.disconnect(conn)
            conn.closed = True
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.cfg.io_timeout_s):
            await writer.drain()

    async def _hello(self, conn: Conn, reader: asyncio.StreamReader, decoder: FrameDecoder) -> list[bytes]:
        async with asyncio.timeout(self.cfg.io_timeout_s):
            frames: list[bytes] = []
            while not frames:
                data = await reader.read(READ_BYTES)
                if not data:
                    raise ConnectionError("closed before Hello")
                frames = decoder.feed(data)
        msg = decode_body(frames[0], self.cfg.max_frame_bytes)
        if not isinstance(msg, control.Hello):
            raise ProtocolViolation(f"the first message must be Hello, got {type(msg).__name__}")
        if msg.version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"client speaks protocol {msg.version}, this daemon speaks "
                                     f"{PROTOCOL_VERSION}; upgrade the older side")
        conn.role = msg.role
        conn.send(control.HelloAck(PROTOCOL_VERSION, os.getpid(), self.cfg.max_frame_bytes, self.server_id))
        return frames[1:]

    async def _serve(self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder(self.cfg.max_frame_bytes)
        try:
            frames = await self._hello(conn, reader, decoder)
        except KVError as e:
            conn.send(kv.Error(0, e.code, e.message))
            await self._drain(writer)
            return
        await self._drain(writer)
        errors_in_a_row = 0
        async with asyncio.TaskGroup() as jobs:
            while True:
                for body in frames:
                    ok = await self._dispatch(conn, body, jobs)
                    errors_in_a_row = 0 if ok else errors_in_a_row + 1
                    if errors_in_a_row >= MAX_CONSECUTIVE_ERRORS:
                        log.warning("closing connection %d (pid %d): %d bad requests in a row", conn.conn_id,
                                    conn.pid, errors_in_a_row)
                        return
                await self._drain(writer)
                data = await reader.read(READ_BYTES)
                if not data:
                    return
                try:
                    frames = decoder.feed(data)
                except FrameTooLarge as e:
                    conn.send(kv.Error(0, e.code, e.message))
                    await self._drain(writer)
                    return  # the stream cannot be resynchronised after a bad length

    async def _dispatch(self, conn: Conn, body: bytes, jobs: asyncio.TaskGroup) -> bool:
        req_id = 0
        try:
            msg = decode_body(body, self.cfg.max_frame_bytes)
            req_id = getattr(msg, "req_id", 0)
            if isinstance(msg, _JOBS):
                conn.jobs.add(req_id)  # before any later frame (an Abort of it) is dispatched
                jobs.create_task(self._job(conn, msg))
            else:
                await self.service.handle(conn, msg)
            return True
        except KVError as e:
            self._reply_error(conn, req_id, e)
            return False
        except Exception as e:  # a bug: never let it take the daemon down
            log.exception("internal error handling a request from pid %d", conn.pid,
                          extra=request_log(conn, req_id))
            self.service.metrics.inc("internal_errors")
            self._reply_error(conn, req_id, InternalError(f"internal error: {e!r}"))
            return False

    async def _job(self, conn: Conn, msg: Message) -> None:
        req_id = getattr(msg, "req_id", 0)
        try:
            await self.service.handle(conn, msg)
        except KVError as e:
            self._reply_error(conn, req_id, e)
        except Exception as e:
            log.exception("internal error in job %d from pid %d", req_id, conn.pid,
                          extra=request_log(conn, req_id))
            self.service.metrics.inc("internal_errors")
            self._reply_error(conn, req_id, InternalError(f"internal error: {e!r}"))
        finally:
            conn.jobs.discard(req_id)
            conn.aborted.discard(req_id)

    def _reply_error(self, conn: Conn, req_id: int, e: KVError) -> None:
        self.service.metrics.inc("errors", code=e.code.name)
        log.log(logging.WARNING if e.code.name in _LOUD_CODES else logging.INFO, "request failed: %s: %s",
                e.code.name, e.message, extra=request_log(conn, req_id))
        conn.send(kv.Error(req_id, int(e.code), e.message))
