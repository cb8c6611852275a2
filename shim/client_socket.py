"""The daemon client's transport: one non-blocking Unix-socket connection that carries framed messages.

Role
    ``FrameSocket`` is what ``hkvd.shim.client.DaemonClient`` sends and reads through: it connects,
    writes whole frames, waits for bytes, reads them and decodes them into messages, and waits for the
    handshake's reply. Which reply answers which request, and the completions, are the client's; each
    message read goes to the ``on_message`` the client passes to ``read``.

Threading model
    None of its own: the client calls it only under the client's lock. It never imports asyncio.

Contracts
    - The socket is non-blocking after connect and timeouts are kept here, with one ``poll`` object per
      connection: a request and its reply take three system calls (send, poll, recv). A socket timeout
      would make CPython poll before every send and recv, and each call costs a few microseconds, more
      on a VM: at ~100 us round trips the client's share is what shows.
    - Every wait is bounded: a send fails once the daemon has taken none of our bytes for ``timeout_s``,
      the handshake's reply is awaited at most its timeout, a read waits at most what it is given.
    - Only ``poll``, never ``select()``: vLLM's descriptors may number past 1023.
    - A connection that fails (a failed write, a failed or closed read, a handshake that fails) is
      ``lost``: the socket closes and ``on_lost(why)`` runs, where the client fails its outstanding
      requests. ``close`` closes it without that call.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import DaemonUnavailable, KVError, ProtocolViolation, error_from_wire
from hkvd.transport.wire import DEFAULT_MAX_FRAME_BYTES, Message, kv

READ_BYTES = 1 << 16
M = TypeVar("M", bound=Message)


class FrameSocket:
    """One connection to the daemon at ``socket_path``: framed messages over a non-blocking socket."""

    def __init__(self, socket_path: str, timeout_s: float, on_lost: Callable[[str], None]) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.sock: socket.socket | None = None
        self._on_lost = on_lost
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME_BYTES)
        self._poller = select.poll()

    @property
    def is_open(self) -> bool:
        return self.sock is not None

    def require(self) -> None:
        if self.sock is None:
            raise DaemonUnavailable(f"not connected to hkvd at {self.socket_path}")

    def open(self) -> None:
        """Connect (blocking, bounded by ``timeout_s``), then carry frames on the socket from here on."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot reach hkvd at {self.socket_path}: {e.strerror or e}; is "
                                    "`hkvd serve` running with the same --socket?") from None
        self.adopt(sock)

    def adopt(self, sock: socket.socket) -> None:
        """Use the connected ``sock``: non-blocking (timeouts are ours from here on), polled, a fresh decoder."""
        sock.setblocking(False)
        self.sock = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME_BYTES)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def lost(self, why: str) -> None:
        """The connection failed: close it and tell the client (``on_lost``)."""
        self.close()
        self._on_lost(why)

    def send(self, msg: Message) -> None:
        """Write ``msg``'s frame; a failed write loses the connection and raises ``DaemonUnavailable``."""
        try:
            self.send_bytes(encode(msg))
        except OSError as e:
            self.lost(f"send failed: {e}")
            raise DaemonUnavailable(f"lost the connection to hkvd: {e}") from None

    def send_bytes(self, data: bytes) -> None:
        """Write all of ``data`` on the non-blocking socket; fail once the daemon has taken none of it for
        ``timeout_s`` (a daemon that keeps reading a large frame, however slowly, is not cut off)."""
        sock = self.sock
        assert sock is not None
        view = memoryview(data)
        deadline = 0.0  # set when the socket is full, cleared by any progress
        while view:
            try:
                view = view[sock.send(view):]
                deadline = 0.0
                continue
            except BlockingIOError:
                pass
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            writable = select.poll()  # never select(): vLLM's descriptors may number past 1023
            writable.register(sock, select.POLLOUT)
            if now >= deadline or not writable.poll((deadline - now) * 1000.0):
                raise TimeoutError(f"hkvd read none of our bytes for {self.timeout_s:.1f} s")

    def read(self, timeout_s: float, on_message: Callable[[Message], None]) -> None:
        """Wait up to ``timeout_s`` for bytes, then take every byte there is and hand its messages to
        ``on_message``, in order."""
        sock = self.sock
        assert sock is not None
        try:
            if not self._poller.poll(max(timeout_s, 0.0) * 1000.0):
                return
            while True:
                try:
                    data = sock.recv(READ_BYTES)
                except BlockingIOError:
                    return
                if not data:
                    self.lost("the daemon closed the connection")
                    return
                for body in self._decoder.feed(data):
                    on_message(decode_body(body))
                if self.sock is None:  # a connection-level Error made on_message drop the link
                    return
                if len(data) < READ_BYTES:
                    return  # the socket had no more: the next recv would only fail
        except (OSError, KVError) as e:
            self.lost(f"read failed: {e}")

    def wait_message(self, cls: type[M], timeout_s: float) -> M:
        """The handshake's reply: the first message, which must be a ``cls``; an ``Error`` is raised as its
        ``KVError`` (the connection lost), and no reply within ``timeout_s`` is ``DaemonUnavailable``."""
        assert self.sock is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.lost("handshake timed out")
                raise DaemonUnavailable(f"hkvd at {self.socket_path} did not answer Hello within {timeout_s} s")
            if not self._poller.poll(left * 1000.0):
                continue
            try:
                data = self.sock.recv(READ_BYTES)
            except OSError as e:
                self.lost(str(e))
                raise DaemonUnavailable(f"hkvd closed the connection during the handshake: {e}") from None
            if not data:
                self.lost("closed during handshake")
                raise DaemonUnavailable("hkvd closed the connection during the handshake")
            for body in self._decoder.feed(data):
                msg = decode_body(body)
                if isinstance(msg, kv.Error):
                    err = error_from_wire(msg.code, msg.message)
                    self.lost(err.message)
                    raise err
                if isinstance(msg, cls):
                    return msg
                raise ProtocolViolation(f"expected {cls.__name__}, got {type(msg).__name__}")
