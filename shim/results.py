"""What each request to the daemon returns, as one typed result per request kind.

Role
    ``DaemonClient`` completes each request it sent with a ``Completion`` holding that request's
    result. The results of a ``Done`` (store, retrieve, step event, pull, unregister) are the wire's
    typed replies, ``hkvd.transport.wire.replies``, defined there once for the daemon and the shim;
    the results of the other replies (lookup, register, KV events poll) are here. A caller reads
    ``result.hit_chunks``: a misspelt or missing field is an error, never a 0.

Contracts
    - ``Completion.get(cls)`` returns the result if it is a ``cls``, else raises ``TypeError``: the
      caller asked for the wrong kind of result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias, TypeVar

from hkvd.transport.errors import KVError
from hkvd.transport.wire.replies import Reply


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit_chunks: int  # chunks of the prompt's prefix every group (and rank) can serve
    lease_id: int  # 0: no lease (no hit, or none asked for)
    lease_ttl_s: float


class RegisterAck(NamedTuple):
    engine_id: int
    fingerprint: bytes  # the layout fingerprint of this rank's entries
    chunk_size: int
    kv_events: int = 0  # hkvd.transport.wire.control.KV_EVENTS_*: 0 from a daemon that keeps no KV events
    lease_watch: bool = False  # it answers WatchLease (False from an older daemon)


@dataclass(frozen=True, slots=True)
class KVEventsResult:
    """A ``KVEventsPoll``'s answer: the engine layout's event batches (msgpack ``KVEventBatch`` each)."""

    next: int  # the ``since`` of the next poll
    lost: int  # batches the daemon no longer kept when asked (the poller fell behind)
    batches: list[bytes]


# Reply: a Done's (StoreResult, RetrieveResult, StepResult, PullResult; Acknowledged, also for a Pong).
# dict: a status report, free-form by design.
Result: TypeAlias = Reply | LookupResult | RegisterAck | KVEventsResult | dict[str, Any]
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
