"""The shim client's own socket handling (non-blocking socket, its own timeouts), against a real
socket peer: writes larger than the socket buffers go out whole, a peer that never reads times the
send out, and several replies in one read all complete."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest

from hkvd.shim.client import DaemonClient
from hkvd.transport.codec import encode
from hkvd.transport.errors import KVTimeout
from hkvd.transport.wire import control


def _client_on(sock: socket.socket, timeout_s: float = 5.0) -> DaemonClient:
    """A client wired to one end of a socketpair, as ``connect`` leaves it (non-blocking, polled)."""
    c = DaemonClient("/nonexistent", client_name="t", role="worker", timeout_s=timeout_s)
    sock.setblocking(False)
    c._sock = sock
    c._poller = select.poll()
    c._poller.register(sock, select.POLLIN)
    return c


def test_a_write_larger_than_the_socket_buffers_arrives_whole() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    client = _client_on(a)
    frame = os.urandom(4 << 20)  # far beyond the socket buffers: partial sends and waits for room
    got = bytearray()

    def reader() -> None:
        while len(got) < len(frame):
            time.sleep(0.001)  # a slow reader: the client must wait for room, not fail
            got.extend(b.recv(1 << 14))

    t = threading.Thread(target=reader)
    t.start()
    client._send_bytes(frame)
    t.join(10)
    assert bytes(got) == frame
    a.close()
    b.close()


def test_a_peer_that_never_reads_times_the_send_out() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = _client_on(a, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="read none of our bytes"):
        client._send_bytes(os.urandom(16 << 20))  # fills both socket buffers, then waits 0.3 s for room
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
