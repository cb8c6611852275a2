"""Done replies: what a store, retrieve, step event, pull or unregister returns, typed once for both ends.

Role
    The daemon answers each of these requests with ``Done(req_id, nbytes, info)``
    (``hkvd.transport.wire.kv``); ``info`` is a msgpack map whose keys differ per request. This module
    is the one place those keys are named. The daemon builds a reply and sends ``reply.to_done(req_id)``;
    the shim's client knows which request a ``Done`` answers (``REPLIES``) and reads it back with
    ``from_done(nbytes, info)``. Callers read ``reply.hit_chunks``: a misspelt or missing field is an
    error, never a 0.

Wire form
    ``to_info`` builds the map the daemon has sent since protocol 2: the same keys, in the same order,
    with the same types (tests/unit/test_replies.py pins them), so the bytes on the wire did not
    change. A group of fields only some replies carry is left out whole when all of it is at its
    default, as the daemon always did:
    - a retrieve's ``event``: CPU engines get no CUDA event;
    - a step event's ``stored/skipped/dropped/thinned``: the event started no copy. A copy starts only
      for offers and counts each offer once, so a step that copied never has all four at 0;
    - a pull's ``lookup_s/read_s/descs``: the pull read nothing from the peer (the hit was local).

Contracts
    - ``from_done`` raises ``ProtocolViolation`` naming the request and the field when ``info`` lacks
      a required field or has one of the wrong type (an int is taken as a float; a bool is never an
      int). Optional fields that are absent take their defaults. Extra keys are ignored: a newer
      daemon may add some.
    - Replies are frozen; the daemon completes one with ``dataclasses.replace``.
    - No torch, no I/O: the shim imports this inside vLLM, the daemon on its event loop.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.control import Unregister
from hkvd.transport.wire.events import StepEvent
from hkvd.transport.wire.kv import Done, Retrieve, Store
from hkvd.transport.wire.message import Message
from hkvd.transport.wire.peer import Pull

# The four counts of a write job (store, or a step event's offers), in their order on the wire.
_COUNTS = ("stored", "skipped", "dropped", "thinned")


def _field(info: dict[str, Any], key: str, kind: type, what: str, default: Any = dataclasses.MISSING) -> Any:
    if key not in info:
        if default is not dataclasses.MISSING:
            return default
        raise ProtocolViolation(f"the daemon's reply to a {what} lacks {key!r}; run hkvd serve and the shim "
                                "from the same hkvd version")
    value = info[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolViolation(f"the daemon's reply to a {what}: {key!r} is {type(value).__name__}, "
                                f"not {kind.__name__}")
    return value


class Reply(abc.ABC):
    """Base of the typed ``Done`` replies: frozen slotted dataclasses whose first field is ``nbytes``."""

    __slots__ = ()
    what: ClassVar[str]  # the request, as a ProtocolViolation names it
    nbytes: int  # bytes the job copied (Done.nbytes)

    @abc.abstractmethod
    def to_info(self) -> dict[str, Any]:
        """``Done.info`` for this reply (the daemon's side)."""

    @classmethod
    @abc.abstractmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> Self:
        """The reply a ``Done`` carries (the reading side); ``ProtocolViolation`` on a missing or mistyped field."""

    def to_done(self, req_id: int) -> Done:
        return Done(req_id, self.nbytes, self.to_info())


@dataclass(frozen=True, slots=True)
class Acknowledged(Reply):
    """A request whose only answer is that it was done: ``Done(req_id, 0, {})`` to an unregister (and,
    in the shim's client, a ``Pong``)."""

    what: ClassVar[str] = "request"
    nbytes: int = 0

    def to_info(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> Self:
        return cls(nbytes)


@dataclass(frozen=True, slots=True)
class StoreResult(Reply):
    what: ClassVar[str] = "store"
    nbytes: int
    stored: int  # entries written
    skipped: int  # entries already cached
    dropped: int  # entries that found no room, counted by the daemon
    thinned: int  # Mamba states left out by --mamba-checkpoint-interval

    def to_info(self) -> dict[str, Any]:
        return {"stored": self.stored, "skipped": self.skipped, "dropped": self.dropped, "thinned": self.thinned}

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> Self:
        return cls(nbytes, *(_field(info, k, int, cls.what) for k in _COUNTS))


@dataclass(frozen=True, slots=True)
class RetrieveResult(Reply):
    what: ClassVar[str] = "retrieve"
    nbytes: int
    entries: int
    event: bytes = b""  # GPU engines: IPC handle of the event recorded after the copy
    seconds: float = 0.0  # the daemon's time from taking the Retrieve to its reply (0: not measured)

    def to_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"entries": self.entries}
        if self.event:  # the engine's stream waits on it before a forward reads the blocks
            info["event"] = self.event
        if self.seconds:
            info["seconds"] = self.seconds
        return info

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> Self:
        return cls(nbytes, _field(info, "entries", int, cls.what), _field(info, "event", bytes, cls.what, b""),
                   _field(info, "seconds", float, cls.what, 0.0))


@dataclass(frozen=True, slots=True)
class StepResult(Reply):
    what: ClassVar[str] = "step event"
    nbytes: int
    outcome: str  # hkvd.daemon.engines.snapshots.StepOutcome's value
    stored: int = 0  # the counts of the offers' copy, as in StoreResult; all 0 when none started
    skipped: int = 0
    dropped: int = 0
    thinned: int = 0

    @classmethod
    def after_copy(cls, outcome: str, copied: StoreResult) -> Self:
        """A step event whose offers were copied, with that copy's bytes and counts."""
        return cls(copied.nbytes, outcome, copied.stored, copied.skipped, copied.dropped, copied.thinned)

    def to_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if self.stored or self.skipped or self.dropped or self.thinned:  # a copy ran (module docstring)
            info.update(stored=self.stored, skipped=self.skipped, dropped=self.dropped, thinned=self.thinned)
        info["outcome"] = self.outcome
        return info

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> Self:
        counts = (_field(info, k, int, cls.what, 0) for k in _COUNTS)
        return cls(nbytes, _field(info, "outcome", str, cls.what), *counts)


@dataclass(frozen=True, slots=True)
class PullResult(Reply):
    what: ClassVar[str] = "pull"
    nbytes: int
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    pulled: int  # entries read from the peer
    local: int  # entries this daemon already held
    seconds: float
    lookup_s: float = 0.0  # of ``seconds``: the peer's lookup; 0 when nothing had to be read
    read_s: float = 0.0  # of ``seconds``: the transport's READ
    descs: int = 0  # transfer descriptors the READ took

    def to_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"hit_chunks": self.hit_chunks, "lease_id": self.lease_id,
                                "lease_ttl_s": self.lease_ttl_s, "pulled": self.pulled, "local": self.local,
                                "seconds": self.seconds}
        if self.lookup_s or self.read_s or self.descs:  # the pull read from the peer (module docstring)
            info.update(lookup_s=self.lookup_s, read_s=self.read_s, descs=self.descs)
        return info

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> Self:
        w = cls.what
        return cls(nbytes, _field(info, "hit_chunks", int, w), _field(info, "lease_id", int, w),
                   _field(info, "lease_ttl_s", float, w), _field(info, "pulled", int, w),
                   _field(info, "local", int, w), _field(info, "seconds", float, w),
                   _field(info, "lookup_s", float, w, 0.0), _field(info, "read_s", float, w, 0.0),
                   _field(info, "descs", int, w, 0))


# Which reply a Done carries, by the request it answers. A Done to any other request is an Acknowledged.
REPLIES: dict[type[Message], type[Reply]] = {
    Store: StoreResult, Retrieve: RetrieveResult, StepEvent: StepResult, Pull: PullResult, Unregister: Acknowledged,
}


__all__ = ["REPLIES", "Acknowledged", "PullResult", "Reply", "RetrieveResult", "StepResult", "StoreResult"]
