"""Framing: 4-byte big-endian length + msgpack body. Sans-IO: bytes in, messages out.

``encode`` turns a message into one frame. ``FrameDecoder.feed`` takes whatever bytes arrived and
returns the complete frames; it enforces the maximum frame size *before* buffering a body, so an
oversized length costs the daemon nothing but an error. msgpack decodes with ``raw=False`` and its
own size limits, so a hostile body cannot allocate more than the frame it came in.
"""

from __future__ import annotations

import struct

import msgpack

from hkvd.transport.errors import FrameTooLarge, ProtocolViolation
from hkvd.transport.wire import DEFAULT_MAX_FRAME_BYTES, Message, message_from_wire

_LEN = struct.Struct(">I")
HEADER_BYTES = _LEN.size


def encode(msg: Message) -> bytes:
    body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes | memoryview, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    try:
        obj: object = msgpack.unpackb(
            body, raw=False, strict_map_key=True,
            max_bin_len=max_frame_bytes, max_str_len=max_frame_bytes,
            max_array_len=max_frame_bytes, max_map_len=max_frame_bytes, max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as e:
        raise ProtocolViolation(f"malformed msgpack frame: {e}") from None
    return message_from_wire(obj)


class FrameDecoder:
    """Accumulates stream bytes and yields complete frame bodies."""

    __slots__ = ("_buf", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames: list[bytes] = []
        while len(self._buf) >= HEADER_BYTES:
            (length,) = _LEN.unpack_from(self._buf)
            if length > self.max_frame_bytes:
                raise FrameTooLarge(f"frame of {length} bytes exceeds the maximum of {self.max_frame_bytes}")
            if len(self._buf) < HEADER_BYTES + length:
                break
            frames.append(bytes(self._buf[HEADER_BYTES:HEADER_BYTES + length]))
            del self._buf[:HEADER_BYTES + length]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)
