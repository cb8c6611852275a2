"""hkvd's wire protocol: the base (``message``) and the message families, imported here so every
class is registered before a frame is parsed.

The base types live in ``hkvd.transport.wire.message``; the families (``control``, ``kv``, ``events``,
``peer``) import them from there, never from this package, so nothing imports in a circle.
"""

from __future__ import annotations

from hkvd.transport.wire import control, events, kv, peer
from hkvd.transport.wire.message import (
    DEFAULT_MAX_FRAME_BYTES,
    KEY_BYTES,
    MAX_ITEMS,
    MAX_KEYS,
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Message,
    MsgType,
    check_u64,
    message_from_wire,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "KEY_BYTES", "MAX_ITEMS", "MAX_KEYS", "MESSAGE_CLASSES", "PROTOCOL_VERSION",
    "Message", "MsgType", "check_u64", "control", "events", "kv", "message_from_wire", "peer",
]
