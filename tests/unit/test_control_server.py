"""The control socket's adapter (``hkvd.daemon.server.Server``) on a real Unix socket, in-process.

The server, the service behind it and the clients share this test's event loop: frames go through
the kernel's socket, replies are read back with the daemon's own frame reader. Covered: the Hello
gate (a client of another protocol version refused, naming both versions and the fix, on either side),
frames in and replies out, a bad frame (answered, then the link keeps serving), a first
frame that is not Hello and an oversized length (answered and closed), the close after
``MAX_CONSECUTIVE_ERRORS`` bad frames in a row, and one client's burst not holding back another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import struct
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import pytest

from hkvd.daemon import server as server_mod
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.in_process import in_process_service
from hkvd.daemon.server import FRAMES_PER_TURN, MAX_CONSECUTIVE_ERRORS, Server
from hkvd.transport.aio import FrameStream
from hkvd.transport.codec import encode
from hkvd.transport.errors import ErrorCode, UnsupportedVersion
from hkvd.transport.wire import PROTOCOL_VERSION, Message, control, kv

MAX_FRAME = 1 << 20
BUDGET_S = 5.0  # per reply; a hung test fails by name instead (pytest timeout)


@pytest.fixture
def socket_path() -> Iterator[str]:
    # A short directory: a Unix socket path must fit in 108 bytes, and pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="hkvd-srv-", dir="/tmp") as d:
        yield str(Path(d) / "s.sock")


@contextlib.contextmanager
def unstarted_server(socket_path: str) -> Iterator[Server]:
    cfg = DaemonConfig(socket_path=socket_path, chunk_size=32, l1_size_bytes=16 << 20, hugepages="off",
                       max_frame_bytes=MAX_FRAME)
    with in_process_service(cfg) as parts:
        yield Server(cfg, parts.service)


@pytest.fixture
async def server(socket_path: str) -> AsyncIterator[Server]:
    with unstarted_server(socket_path) as srv:
        await srv.start()
        yield srv
        await srv.stop_accepting()
        srv.close_connections()
        for _ in range(3):  # connection_lost runs a loop turn after the close
            await asyncio.sleep(0)


async def connect(path: str) -> FrameStream:
    reader, writer = await asyncio.open_unix_connection(path)
    return FrameStream(reader, writer, MAX_FRAME)


async def greeted(path: str) -> FrameStream:
    s = await connect(path)
    await s.send(control.Hello(PROTOCOL_VERSION, "test", "tool"), BUDGET_S)
    ack = await s.recv(BUDGET_S)
    assert isinstance(ack, control.HelloAck), ack
    return s


async def closed_by_server(s: FrameStream) -> bool:
    """True once the server closed the connection (EOF, nothing more sent); False if it stays open."""
    try:
        async with asyncio.timeout(BUDGET_S):
            rest = await s.reader.read()  # until EOF
    except TimeoutError:  # before OSError: TimeoutError is one
        return False
    except ConnectionError:
        return True
    return rest == b""


def raw_frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def test_frames_in_replies_out(server: Server, socket_path: str) -> None:
    s = await greeted(socket_path)
    await s.send(control.Ping(7), BUDGET_S)
    assert await s.recv(BUDGET_S) == control.Pong(7)
    await s.send(control.Status(8), BUDGET_S)
    reply = await s.recv(BUDGET_S)
    assert isinstance(reply, control.StatusReply) and reply.req_id == 8
    assert len(server.connections) == 1
    await s.aclose()


async def test_a_first_frame_other_than_hello_is_a_protocol_violation_and_closes(server: Server,
                                                                                 socket_path: str) -> None:
    s = await connect(socket_path)
    await s.send(control.Ping(1), BUDGET_S)
    err = await s.recv(BUDGET_S)
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PROTOCOL_VIOLATION, err
    assert await closed_by_server(s)


OLDER = PROTOCOL_VERSION - 1  # protocol 2: replies in Done(req_id, nbytes, info)
VERSIONS_AND_FIX = (rf"protocol {OLDER}, this daemon speaks protocol {PROTOCOL_VERSION}; run the shim and hkvd "
                    r"serve from the same hkvd version")


async def test_a_client_of_an_older_protocol_is_refused_naming_both_versions_and_the_fix(
        server: Server, socket_path: str) -> None:
    s = await connect(socket_path)
    await s.send(control.Hello(OLDER, "old-shim", "worker"), BUDGET_S)
    err = await s.recv(BUDGET_S)
    assert isinstance(err, kv.Error) and err.req_id == 0 and err.code == ErrorCode.UNSUPPORTED_VERSION, err
    assert re.search(f"client speaks {VERSIONS_AND_FIX}", err.message), err.message
    assert await closed_by_server(s)


async def test_the_shims_client_raises_the_refusal_of_a_daemon_of_another_version(
        server: Server, socket_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hkvd.shim.client import DaemonClient

    monkeypatch.setattr(server_mod, "PROTOCOL_VERSION", OLDER)  # a daemon of protocol 2 ...
    client = DaemonClient(socket_path, client_name="t", role="tool", timeout_s=BUDGET_S)
    with pytest.raises(UnsupportedVersion) as refused:
        await asyncio.to_thread(client.connect)
    assert not client.connected
    # ... says which version the client speaks and which it does (its own words were "upgrade the older side")
    assert f"client speaks protocol {PROTOCOL_VERSION}, this daemon speaks protocol {OLDER}" in refused.value.message


def test_the_shims_client_refuses_a_hello_ack_of_another_version(socket_path: str) -> None:
    """A daemon refuses a client of another version before its HelloAck; the client checks the ack anyway."""
    from hkvd.shim.client import DaemonClient

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(socket_path)
        listener.listen(1)

        def acked_as_older() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)  # the Hello
                conn.sendall(encode(control.HelloAck(OLDER, 1, MAX_FRAME, "old")))
                conn.recv(1)  # until the client hangs up

        peer = threading.Thread(target=acked_as_older, daemon=True)
        peer.start()
        client = DaemonClient(socket_path, client_name="t", role="tool", timeout_s=BUDGET_S)
        with pytest.raises(UnsupportedVersion, match=rf"speaks protocol {OLDER}, this shim {PROTOCOL_VERSION}; "
                                                     r"run the shim and hkvd serve from the same hkvd version"):
            client.connect()
        assert not client.connected
        peer.join(BUDGET_S)


async def test_a_bad_frame_is_answered_and_the_link_keeps_serving(server: Server, socket_path: str) -> None:
    s = await greeted(socket_path)
    s.writer.write(raw_frame(b"\xc1 not msgpack"))  # 0xc1 is never valid msgpack
    err = await s.recv(BUDGET_S)
    assert isinstance(err, kv.Error) and err.code == ErrorCode.PROTOCOL_VIOLATION, err
    s.writer.write(raw_frame(msgpack.packb([60000, 1])))  # a message type nobody defined
    err = await s.recv(BUDGET_S)
    assert isinstance(err, kv.Error) and err.code in (ErrorCode.PROTOCOL_VIOLATION, ErrorCode.UNKNOWN_MESSAGE), err
    await s.send(control.Ping(3), BUDGET_S)
    assert await s.recv(BUDGET_S) == control.Pong(3)
    # Only errors *in a row* close it: a good frame between bad ones starts the count again.
    s.writer.write((raw_frame(b"\xc1") + encode(control.Ping(4))) * MAX_CONSECUTIVE_ERRORS)
    for _ in range(MAX_CONSECUTIVE_ERRORS):
        assert isinstance(await s.recv(BUDGET_S), kv.Error)
        assert await s.recv(BUDGET_S) == control.Pong(4)
    await s.aclose()


async def test_bad_frames_in_a_row_close_the_link(server: Server, socket_path: str) -> None:
    s = await greeted(socket_path)
    s.writer.write(raw_frame(b"\xc1") * MAX_CONSECUTIVE_ERRORS)
    for _ in range(MAX_CONSECUTIVE_ERRORS):
        err = await s.recv(BUDGET_S)
        assert isinstance(err, kv.Error) and err.code == ErrorCode.PROTOCOL_VIOLATION
    assert await closed_by_server(s)


async def test_an_oversized_length_is_refused_and_closes(server: Server, socket_path: str) -> None:
    s = await greeted(socket_path)
    s.writer.write(struct.pack(">I", MAX_FRAME + 1))  # the body never comes: the length alone decides
    err = await s.recv(BUDGET_S)
    assert isinstance(err, kv.Error) and err.code == ErrorCode.FRAME_TOO_LARGE, err
    assert await closed_by_server(s)


async def test_one_clients_burst_does_not_hold_back_another(server: Server, socket_path: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[int, Message]] = []  # replies in the order the server wrote them: (conn_id, msg)
    send = server_mod._Link._send

    def recording_send(link: server_mod._Link, msg: Message) -> None:
        assert link.conn is not None
        order.append((link.conn.conn_id, msg))
        send(link, msg)

    monkeypatch.setattr(server_mod._Link, "_send", recording_send)
    burst, other = await greeted(socket_path), await greeted(socket_path)
    ids = sorted(server.connections)
    n = 4 * FRAMES_PER_TURN
    # Both land in the kernel before the server's next loop turn: one burst of n frames, one frame.
    burst.writer.write(b"".join(encode(control.Ping(i)) for i in range(1, n + 1)))
    other.writer.write(encode(control.Ping(99)))
    for i in range(1, n + 1):
        assert await burst.recv(BUDGET_S) == control.Pong(i)
    assert await other.recv(BUDGET_S) == control.Pong(99)
    pongs = [(cid, m) for cid, m in order if isinstance(m, control.Pong)]
    served_other = pongs.index((ids[1], control.Pong(99)))
    # The other client's ping was served within the burst's first turns, not after all of it.
    assert served_other <= 2 * FRAMES_PER_TURN, served_other
    await burst.aclose()
    await other.aclose()


async def test_the_socket_is_born_with_the_configured_mode(server: Server, socket_path: str) -> None:
    assert os.stat(socket_path).st_mode & 0o777 == 0o660


async def test_the_socket_path_appears_only_once_it_listens(socket_path: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that finds the path can connect: a bound socket that does not yet listen would refuse it."""
    seen_at_listen: list[bool] = []
    real_start = asyncio.base_events.Server._start_serving

    def start_serving(self: asyncio.base_events.Server) -> None:
        seen_at_listen.append(os.path.exists(socket_path))
        real_start(self)

    monkeypatch.setattr(asyncio.base_events.Server, "_start_serving", start_serving)
    with unstarted_server(socket_path) as srv:
        await srv.start()
        try:
            assert seen_at_listen == [False]
            assert sorted(os.listdir(Path(socket_path).parent)) == ["s.sock"]  # no staging name left
            s = await greeted(socket_path)
            await s.aclose()
        finally:
            await srv.stop_accepting()
    assert os.listdir(Path(socket_path).parent) == []


async def test_a_socket_path_too_long_to_stage_is_refused_with_the_fix(socket_path: str) -> None:
    long_path = str(Path(socket_path).parent / ("x" * (server_mod.SUN_PATH_MAX - len(socket_path) + 4)))
    with unstarted_server(long_path) as srv, pytest.raises(OSError, match="pass a shorter --socket"):
        await srv.start()
    assert os.listdir(Path(socket_path).parent) == []
