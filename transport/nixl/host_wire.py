"""The pipe between the daemon and its transport host (``hkvd.transport.nixl.hosted`` / ``host``).

Role
    Frames and message shapes of the private socketpair that joins a daemon to the child process
    hosting its NIXL agent. Both ends are the same hkvd build (the daemon spawns the host from its
    own interpreter), so there is no version negotiation: a frame either end cannot parse is a bug
    and ends the child.

Format
    Frame = 4-byte big-endian length + ``msgpack.packb(list, use_bin_type=True)``; at most
    ``MAX_FRAME_BYTES``. Messages are lists whose first item is the kind:

    daemon -> host
        ``[CALL, call_id, op, *args]``   ``op`` one of ``OPS``; answered by OK or ERR
        ``[READ, xfer_id, peer, descs]`` a READ; ``descs`` packed by ``pack_descs``; answered by SETTLED
    host -> daemon
        ``[OK, call_id, value]`` / ``[ERR, call_id, code, message]`` (``code``: an ``ErrorCode``)
        ``[SETTLED, xfer_id, nbytes, code, message]`` ``code`` 0: the READ completed whole

    Addresses in a READ are the host's own: the daemon translates them (the host maps the pool at
    an address of its own choosing).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack

from hkvd.transport.base import Desc

CALL, READ, OK, ERR, SETTLED = 1, 2, 3, 4, 5
# Call ops: start(agent, backends, progress_delay_us) -> None; register(nbytes) -> host base address;
# metadata() -> bytes; add_peer(metadata) -> name; remove_peer(name) -> None.
OPS = ("start", "register", "metadata", "add_peer", "remove_peer")
# A READ of a 1 GiB pull in 4 KiB pieces packs 262144 x 24 bytes = 6 MiB; metadata is a few KiB.
MAX_FRAME_BYTES = 64 << 20
_LEN = struct.Struct(">I")
_DESC = struct.Struct("<QQQ")


class FrameError(Exception):
    """A frame on the host pipe is malformed (a bug on one side: the pipe is closed)."""


def encode(msg: Sequence[object]) -> bytes:
    body = msgpack.packb(list(msg), use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"a host-pipe frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(body)) + body


class Decoder:
    """Incremental: ``feed`` bytes as they arrive, iterate the complete messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[list[Any]]:
        self._buf += data
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME_BYTES:
                raise FrameError(f"host-pipe frame of {n} bytes announced (at most {MAX_FRAME_BYTES})")
            if len(self._buf) < _LEN.size + n:
                return
            body = bytes(self._buf[_LEN.size:_LEN.size + n])
            del self._buf[:_LEN.size + n]
            msg = msgpack.unpackb(body, raw=False)
            if not isinstance(msg, list) or not msg or not isinstance(msg[0], int):
                raise FrameError(f"host-pipe message is not [kind, ...]: {type(msg).__name__}")
            yield msg


def pack_descs(descs: Sequence[Desc]) -> bytes:
    return b"".join(_DESC.pack(*d) for d in descs)


def unpack_descs(data: bytes) -> list[Desc]:
    if len(data) % _DESC.size:
        raise FrameError(f"packed descriptors of {len(data)} bytes (not a multiple of {_DESC.size})")
    return [Desc(*t) for t in _DESC.iter_unpack(data)]


# Metadata a transport host exports: this prefix, the signed offset from the daemon's pool
# addresses to the host's (8 bytes, little-endian), then NIXL's own metadata. A peer adds the
# offset to the remote addresses it is given, which are the serving daemon's.
METADATA_MAGIC = b"HKVDTH1\0"
_OFFSET = struct.Struct("<q")


def wrap_metadata(nixl_md: bytes, offset: int) -> bytes:
    return METADATA_MAGIC + _OFFSET.pack(offset) + nixl_md


def unwrap_metadata(md: bytes) -> tuple[bytes, int]:
    """(NIXL's metadata, the remote address offset); metadata of an in-process agent has offset 0."""
    if not md.startswith(METADATA_MAGIC):
        return md, 0
    start = len(METADATA_MAGIC)
    (offset,) = _OFFSET.unpack_from(md, start)
    return md[start + _OFFSET.size:], offset
