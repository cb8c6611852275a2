"""Asyncio frame I/O over a stream: one message in, one message out, each with a time budget.

Used by the peer link on both ends (``hkvd.daemon.peers.serving`` / ``pulling``). Framing and
validation are ``hkvd.transport.codec``'s; this only moves bytes.

Errors
    ``recv`` raises ``ConnectionError`` at EOF, ``KVTimeout`` when nothing complete arrived within
    the budget, ``FrameTooLarge`` / ``ProtocolViolation`` for bad input (the stream cannot be trusted
    after those: close it). ``send`` writes and drains within the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from hkvd.transport.codec import HEADER_BYTES, FrameDecoder, decode_body, encode
from hkvd.transport.errors import KVTimeout
from hkvd.transport.wire import Message

READ_BYTES = 1 << 16


class FrameStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes)
        self._frames: deque[bytes] = deque()

    def set_max_frame_bytes(self, max_frame_bytes: int) -> None:
        """Change the frame cap from the next frame on: a peer link allows a few KiB until it is
        authenticated, then its requests' size."""
        self.max_frame_bytes = max_frame_bytes
        self._decoder.max_frame_bytes = max_frame_bytes

    @property
    def peername(self) -> str:
        peer = self.writer.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    async def recv(self, timeout_s: float) -> Message:
        try:
            async with asyncio.timeout(timeout_s):
                while not self._frames:
                    # At most one largest frame per read: under a small cap (a peer not yet authenticated)
                    # that is all a stranger parks here.
                    data = await self.reader.read(min(READ_BYTES, HEADER_BYTES + self.max_frame_bytes))
                    if not data:
                        raise ConnectionError(f"{self.peername} closed the connection")
                    self._frames.extend(self._decoder.feed(data))
        except TimeoutError:
            raise KVTimeout(f"no message from {self.peername} within {timeout_s:.1f} s") from None
        return decode_body(self._frames.popleft(), self.max_frame_bytes)

    async def send(self, msg: Message, timeout_s: float) -> None:
        if self.writer.is_closing():
            raise ConnectionError(f"the connection to {self.peername} is closed")
        self.writer.write(encode(msg))
        try:
            async with asyncio.timeout(timeout_s):
                await self.writer.drain()
        except TimeoutError:
            raise KVTimeout(f"{self.peername} did not take a message within {timeout_s:.1f} s") from None

    async def aclose(self) -> None:
        """Close; never raises, waits at most 1 s for the transport to shut."""
        self.writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.writer.wait_closed()
