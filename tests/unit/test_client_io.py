"""The shim client's own socket handling (non-blocking socket, its own timeouts), against a real
socket peer: writes larger than the socket buffers go out whole (also on a descriptor numbered past
1023, which vLLM's process may well use and select() cannot take), a peer that never reads times the
send out, and several replies in one read all complete."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hkvd.shim.client import DaemonClient
from hkvd.transport.codec import encode
from hkvd.transport.errors import KVTimeout
from hkvd.transport.wire import control


def _client_on(sock: socket.socket, timeout_s: float = 5.0) -> DaemonClient:
    """A client wired to one end of a socketpair, as ``connect`` leaves it (non-blocking, polled)."""
    c = DaemonClient("/nonexistent", client_name="t", role="worker", timeout_s=timeout_s)
    c._conn.adopt(sock)
    return c


@contextlib.contextmanager
def _numbered_past_1023(sock: socket.socket) -> Iterator[socket.socket]:
    """``sock`` moved to a descriptor numbered 1024 or more (the soft open-file limit raised for it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the open-file hard limit ({hard}) leaves no descriptor past 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    try:
        high = socket.socket(fileno=fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 1024))
        sock.close()
        with high:
            yield high
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("high", [False, True], ids=["low-fd", "fd-past-1023"])
def test_a_write_larger_than_the_socket_buffers_arrives_whole(high: bool) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    with contextlib.ExitStack() as stack:
        if high:
            a = stack.enter_context(_numbered_past_1023(a))
            assert a.fileno() >= 1024
        _write_whole(a, b)


def _write_whole(a: socket.socket, b: socket.socket) -> None:
    client = _client_on(a)
    frame = os.urandom(4 << 20)  # far beyond the socket buffers: partial sends and waits for room
    got = bytearray()

    def reader() -> None:
        while len(got) < len(frame):
            time.sleep(0.001)  # a slow reader: the client must wait for room, not fail
            data = b.recv(1 << 14)
            if not data:
                return
            got.extend(data)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        client._conn.send_bytes(frame)
        t.join(10)
    finally:
        a.close()  # a failed send still ends the reader (EOF)
    assert bytes(got) == frame
    t.join(10)
    b.close()


def test_a_peer_that_never_reads_times_the_send_out() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = _client_on(a, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="read none of our bytes"):
        client._conn.send_bytes(os.urandom(16 << 20))  # fills both socket buffers, then waits 0.3 s for room
    assert time.monotonic() - t0 < 5
    a.close()
    b.close()


def test_replies_that_arrive_together_all_complete() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = _client_on(a)
    ids = [client._submit(lambda r: control.Ping(r)) for _ in range(50)]
    sent = b"".join(encode(control.Ping(i)) for i in ids)
    seen = bytearray()
    while len(seen) < len(sent):
        seen += b.recv(1 << 16)
    assert bytes(seen) == sent
    b.sendall(b"".join(encode(control.Pong(i)) for i in ids))  # one write: read in one go by the client
    done = client.wait(ids, timeout_s=5)
    assert sorted(done) == ids and all(c.ok for c in done.values())
    a.close()
    b.close()


def test_wait_gives_up_after_its_timeout_when_no_reply_comes() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = _client_on(a)
    rid = client._submit(lambda r: control.Ping(r))
    t0 = time.monotonic()
    with pytest.raises(KVTimeout, match=r"no reply from hkvd within 0\.2"):
        client.wait([rid], timeout_s=0.2)
    assert 0.15 < time.monotonic() - t0 < 3
    a.close()
    b.close()
