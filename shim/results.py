"""What each request to the daemon returns, as one typed result per request kind.

Role
    The daemon answers a store, retrieve, step event or pull with ``Done(nbytes, info)`` and a
    lookup with ``LookupReply``; ``info``'s keys differ per request. ``DaemonClient`` knows which
    request each reply answers and turns it into the matching result here, checking every key, so
    a caller reads ``result.hit_chunks`` and a misspelt or missing field is an error, never a 0.

Contracts
    - ``from_done(nbytes, info)`` raises ``ProtocolViolation`` naming the request and the field
      when ``info`` lacks a field or has one of the wrong type. Extra keys are ignored (a newer
      daemon may add some).
    - ``Completion.get(cls)`` returns the result if it is a ``cls``, else raises ``TypeError``: the
      caller asked for the wrong kind of result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

from hkvd.transport.errors import KVError, ProtocolViolation


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


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit_chunks: int  # chunks of the prompt's prefix every group (and rank) can serve
    lease_id: int  # 0: no lease (no hit, or none asked for)
    lease_ttl_s: float


@dataclass(frozen=True, slots=True)
class StoreResult:
    what: ClassVar[str] = "store"
    nbytes: int
    stored: int  # entries written
    skipped: int  # entries already cached
    dropped: int  # entries that found no room, counted by the daemon
    thinned: int  # Mamba states left out by --mamba-checkpoint-interval

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> StoreResult:
        return cls(nbytes, *(_field(info, k, int, cls.what) for k in ("stored", "skipped", "dropped", "thinned")))


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    what: ClassVar[str] = "retrieve"
    nbytes: int
    entries: int
    event: bytes = b""  # GPU engines: IPC handle of the event recorded after the copy

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> RetrieveResult:
        return cls(nbytes, _field(info, "entries", int, cls.what), _field(info, "event", bytes, cls.what, b""))


@dataclass(frozen=True, slots=True)
class StepResult:
    what: ClassVar[str] = "step event"
    nbytes: int
    outcome: str  # hkvd.daemon.snapshots.StepOutcome's value
    stored: int = 0
    skipped: int = 0
    dropped: int = 0
    thinned: int = 0

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> StepResult:
        counts = (_field(info, k, int, cls.what, 0) for k in ("stored", "skipped", "dropped", "thinned"))
        return cls(nbytes, _field(info, "outcome", str, cls.what), *counts)


@dataclass(frozen=True, slots=True)
class PullResult:
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

    @classmethod
    def from_done(cls, nbytes: int, info: dict[str, Any]) -> PullResult:
        w = cls.what
        return cls(nbytes, _field(info, "hit_chunks", int, w), _field(info, "lease_id", int, w),
                   _field(info, "lease_ttl_s", float, w), _field(info, "pulled", int, w),
                   _field(info, "local", int, w), _field(info, "seconds", float, w),
                   _field(info, "lookup_s", float, w, 0.0), _field(info, "read_s", float, w, 0.0),
                   _field(info, "descs", int, w, 0))


class RegisterAck(NamedTuple):
    engine_id: int
    fingerprint: bytes  # the layout fingerprint of this rank's entries
    chunk_size: int


@dataclass(frozen=True, slots=True)
class Acknowledged:
    """A request whose only answer is that it was done (ping, unregister)."""


Result = (LookupResult | StoreResult | RetrieveResult | StepResult | PullResult | RegisterAck | Acknowledged
          | dict[str, Any])  # dict: a status report, free-form by design
R = TypeVar("R")


class Completion(NamedTuple):
    req_id: int
    ok: bool
    result: Result | None  # None when the request failed
    error: KVError | None

    def get(self, cls: type[R]) -> R:
        """The result as a ``cls``; raises the request's error if it failed."""
        if self.error is not None:
            raise self.error
        if not isinstance(self.result, cls):
            raise TypeError(f"request {self.req_id} returned a {type(self.result).__name__}, not a {cls.__name__}")
        return self.result
