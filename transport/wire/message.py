"""The wire protocol's base: message types, versions, bounds and the message base class.

A frame is a 4-byte big-endian length followed by ``msgpack.packb([msg_type, *fields])``. Message
types are explicit, append-only integers grouped by family (control 1-19, kv 20-39, events 40-49,
peer 60-79): a number, once shipped, never changes meaning. Messages are frozen slotted dataclasses;
``from_wire`` type-checks every field (bad input gets ``ProtocolViolation``, never a crash) and
``validate`` checks the values. Trailing fields with defaults may be left out (``to_wire`` leaves out those at
their default), so a field added later with a default does not change the protocol version. A float field
takes an integer and holds it as a float. A list field of records (``list[Item]``) is decoded once, by the record
type's ``decode_list`` (validated: a ``ProtocolViolation`` names the first bad record), and encoded by its
``encode_list``: the message holds typed records, never raw arrays.

A message class registers in ``MESSAGE_CLASSES`` when its family module (``control``, ``kv``,
``events``, ``peer``) is imported; the package ``hkvd.transport.wire`` imports every family, and
importing this module runs the package first.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, ClassVar

from hkvd.transport.errors import ProtocolViolation, UnknownMessage
from hkvd.transport.keys import KEY_BYTES

# 2: EngineSpec.identity, Uncacheable, chunk keys with extra keys (LoRA, images, cache_salt).
# 3: every reply is a message of its own (StoreResult, RetrieveResult, StepResult, PullResult, ...) in place of
#    Done(req_id, nbytes, info) and its info map; Done's number (24) is retired.
PROTOCOL_VERSION = 3
DEFAULT_MAX_FRAME_BYTES = 16 << 20
# Bounds on list fields: far above real use (a 1M-token prompt in 256-token chunks is 4096 keys),
# low enough that one frame cannot make the daemon do unbounded work.
MAX_KEYS = 1 << 16
MAX_ITEMS = 1 << 16


class MsgType(enum.IntEnum):
    # control
    HELLO = 1
    HELLO_ACK = 2
    REGISTER = 3
    REGISTER_ACK = 4
    UNREGISTER = 5
    BYE = 6
    STATUS = 7
    STATUS_REPLY = 8
    PING = 9
    PONG = 10
    LIFT_QUARANTINE = 11
    UNPIN = 12
    UNREGISTERED = 13
    QUARANTINE_LIFTED = 14
    UNPINNED = 15
    # kv
    LOOKUP = 20
    LOOKUP_REPLY = 21
    STORE = 22
    RETRIEVE = 23
    # 24: Done (protocol 2), retired: never reused
    ABORT = 25
    ABORT_ACK = 26
    ERROR = 27
    RELEASE = 28
    UNCACHEABLE = 29
    WATCH_LEASE = 30
    VERIFY = 31
    PIN = 32
    STORE_RESULT = 33
    RETRIEVE_RESULT = 34
    VERIFY_RESULT = 35
    LEASE_WRITTEN = 36
    HINTS = 37
    # events
    STEP_EVENT = 40
    KV_EVENTS_POLL = 41
    KV_EVENTS = 42
    STEP_RESULT = 43
    # peer (transport/wire/peer.py): daemon <-> daemon, and the engine's Pull
    PEER_HELLO = 60
    PEER_CHALLENGE = 61
    PEER_AUTH = 62
    PEER_WELCOME = 63
    PEER_LOOKUP = 64
    PEER_LOOKUP_REPLY = 65
    PEER_RELEASE = 66
    PULL = 70
    PULL_RESULT = 71


MESSAGE_CLASSES: dict[int, type[Message]] = {}


class Records(typing.Protocol):
    """A record type a message's list field holds (``hkvd.transport.wire.kv.Item``): decoded and encoded whole."""

    @classmethod
    def decode_list(cls, raw: object, where: str) -> list[Any]:
        """The records of ``raw``, every one checked; ``ProtocolViolation`` naming ``where`` and the first bad one."""
        ...

    @staticmethod
    def encode_list(records: list[Any]) -> list[Any]:
        """The wire form of ``records``, the arrays ``decode_list`` takes."""
        ...


def _records(hint: object) -> type[Records] | None:
    """The record type of a ``list[R]`` field whose ``R`` decodes itself, else None."""
    if typing.get_origin(hint) is list:
        (inner,) = typing.get_args(hint)
        if hasattr(inner, "decode_list"):
            return typing.cast(type[Records], inner)
    return None


def _check(value: object, hint: Any, where: str) -> None:
    origin = typing.get_origin(hint)
    if hint is Any:
        return
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolViolation(f"{where}: expected a list, got {type(value).__name__}")
        (inner,) = typing.get_args(hint)
        if inner is not Any:
            for i, v in enumerate(value):
                _check(v, inner, f"{where}[{i}]")
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolViolation(f"{where}: expected a map, got {type(value).__name__}")
        return
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ProtocolViolation(f"{where}: expected a number, got {type(value).__name__}")
        return
    if hint is int and isinstance(value, bool):
        raise ProtocolViolation(f"{where}: expected an integer, got bool")
    if not isinstance(value, hint):
        raise ProtocolViolation(f"{where}: expected {hint.__name__}, got {type(value).__name__}")


class Message:
    """Base of every wire message. Subclasses are frozen slotted dataclasses with a ``TYPE``."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "TYPE" in cls.__dict__:
            prev = MESSAGE_CLASSES.get(cls.TYPE)
            # dataclass(slots=True) rebuilds the class, so the same class arrives twice.
            if prev is not None and prev.__qualname__ != cls.__qualname__:
                raise TypeError(f"message type {cls.TYPE!r} defined twice")
            MESSAGE_CLASSES[cls.TYPE] = cls

    @classmethod
    def _layout(cls) -> tuple[list[tuple[str, object, type[Records] | None]], int, tuple[object, ...]]:
        """(name, type hint, record type of a list of records) of each field, how many fields are required,
        each field's default.

        Computed once per class (to_wire and from_wire run for every frame). Fields added later get
        defaults, so older peers still parse.
        """
        layout = cls.__dict__.get("_layout_cache")
        if layout is None:
            fields = dataclasses.fields(cls)  # type: ignore[arg-type]
            resolved = typing.get_type_hints(cls)
            required = len([f for f in fields
                            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING])
            layout = ([(f.name, resolved[f.name], _records(resolved[f.name])) for f in fields], required,
                      tuple(f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                            for f in fields))
            cls._layout_cache = layout  # type: ignore[attr-defined]
        return layout

    def to_wire(self) -> list[object]:
        hints, required, defaults = self._layout()
        values = [getattr(self, name) if records is None else records.encode_list(getattr(self, name))
                  for name, _, records in hints]
        # Trailing optional fields left at their default are not sent.
        while len(values) > required and values[-1] == defaults[len(values) - 1]:
            values.pop()
        return [int(self.TYPE), *values]

    @classmethod
    def from_wire(cls, fields: list[object]) -> Message:
        hints, required, _ = cls._layout()
        if not required <= len(fields) <= len(hints):
            want = str(len(hints)) if required == len(hints) else f"{required} to {len(hints)}"
            lacks = f" (lacks {hints[len(fields)][0]!r})" if len(fields) < required else ""
            raise ProtocolViolation(f"{cls.__name__}: expected {want} fields, got {len(fields)}{lacks}")
        values = list(fields)
        for i, (name, hint, records) in enumerate(hints[:len(fields)]):
            if records is None:
                if type(values[i]) is hint:  # a scalar of exactly its type: the common case, nothing more to check
                    continue
                _check(values[i], hint, f"{cls.__name__}.{name}")
                if hint is float:
                    values[i] = float(typing.cast(int, values[i]))  # an integer (checked: never a bool)
            else:
                values[i] = records.decode_list(values[i], f"{cls.__name__}.{name}")
        msg = cls(*values)
        msg.validate()
        return msg

    def validate(self) -> None:
        """Value checks beyond types; raise ProtocolViolation."""


def message_from_wire(obj: object) -> Message:
    """Turn a decoded frame (a list) into a validated message."""
    if not isinstance(obj, list) or not obj:
        raise ProtocolViolation("a frame must be a non-empty array [msg_type, *fields]")
    mtype = obj[0]
    if not isinstance(mtype, int) or isinstance(mtype, bool):
        raise ProtocolViolation("the first element of a frame must be the integer message type")
    cls = MESSAGE_CLASSES.get(mtype)
    if cls is None:
        raise UnknownMessage(f"unknown message type {mtype}; this daemon speaks protocol {PROTOCOL_VERSION}")
    return cls.from_wire(obj[1:])


def check_u64(value: int, what: str) -> None:
    if not 0 <= value < 1 << 64:
        raise ProtocolViolation(f"{what} must be an unsigned 64-bit integer, got {value}")


__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "KEY_BYTES", "MAX_ITEMS", "MAX_KEYS", "MESSAGE_CLASSES", "PROTOCOL_VERSION",
    "Message", "MsgType", "Records", "check_u64", "message_from_wire",
]
